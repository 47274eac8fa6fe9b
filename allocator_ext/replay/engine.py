"""Replaying a recorded trace through the core on the simulated device.

The trace's own allocations and frees drive a fresh allocator, per stream:

- ``alloc`` allocates the recorded request size on the recorded stream;
- ``free_requested`` immediately followed by its ``free_completed`` is a plain free;
- a ``free_completed`` that comes later is a cross-stream wait (``record_stream``): the block is
  freed pending an event, which completes where the trace says the wait ended;
- a run of recorded ``segment_free`` that the allocator did not cause (one not followed by the
  segment allocation it made room for) is the user's ``empty_cache()`` and is replayed as one.

The simulated device counts every device call; the cost table prices them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import allocator_ext as ae
from allocator_ext.replay.costs import CostTable, load_cost_table
from allocator_ext.replay.trace import KNOWN_ACTIONS, Trace, TraceError, free_completes_at_once

# Pending frees wait on events of streams that exist only in the replay.
PENDING_STREAM_BASE = 1 << 62
# Gaps between events longer than this are idle time (data loading, evaluation, a pause),
# not allocator-relevant activity.
ACTIVE_GAP_CAP_US = 100_000


@dataclass
class Timeline:
    """Requested, allocated and reserved bytes after each event, for plots."""

    time_s: list[float] = field(default_factory=list)
    requested: list[int] = field(default_factory=list)
    allocated: list[int] = field(default_factory=list)
    reserved: list[int] = field(default_factory=list)
    recorded_reserved: list[int] = field(default_factory=list)


@dataclass
class ReplayResult:
    report: dict[str, Any]
    timeline: Timeline


def _is_allocator_release(events: list, i: int) -> bool:
    """Whether the run of segment frees starting at i made room for an allocation."""
    j = i
    while j < len(events) and events[j].action in ("segment_free", "segment_unmap"):
        j += 1
    return j < len(events) and events[j].action in ("segment_alloc", "segment_map", "oom")


def _check_starts_empty(trace: Trace) -> None:
    """Refuses a trace whose history does not begin with an empty allocator."""
    segments: list[tuple[int, int]] = []
    live: set[int] = set()
    for i, e in enumerate(trace.events):
        if e.action in ("segment_alloc", "segment_map"):
            segments.append((e.addr, e.addr + e.size))
        elif e.action == "alloc":
            if not any(lo <= e.addr < hi for lo, hi in segments):
                raise TraceError(
                    f"{trace.path}: event {i} allocates at {e.addr:#x}, inside no segment the "
                    "trace allocated: recording started after the allocator was in use (or the "
                    "ring buffer wrapped); record from the start of the process with a "
                    "max_entries large enough for the whole run"
                )
            live.add(e.addr)
        elif e.action == "free_requested":
            if e.addr not in live:
                raise TraceError(
                    f"{trace.path}: event {i} frees {e.addr:#x}, which the trace never "
                    "allocated: the recording does not start from an empty allocator"
                )
            live.discard(e.addr)


def trace_seconds(trace: Trace) -> float:
    """The trace's active time: gaps between events, each capped (idle time is not work)."""
    total = 0
    times = [e.time_us for e in trace.events]
    for a, b in zip(times, times[1:], strict=False):
        total += min(max(b - a, 0), ACTIVE_GAP_CAP_US)
    return total / 1e6


def replay(
    trace: Trace,
    config: str | None = None,
    device_memory: int = 0,
    memory_fraction: float | None = None,
    costs: CostTable | None = None,
    progress: Callable[[int], None] | None = None,
    timeline: bool = False,
) -> ReplayResult:
    """Replays `trace` under `config` (None: allocwatch's defaults; "native": PyTorch's).

    `device_memory` caps the simulated device (0: unlimited); `memory_fraction` applies
    ``set_per_process_memory_fraction``. `progress` is called with the number of events done.
    """
    _check_starts_empty(trace)
    costs = costs or load_cost_table()
    device = ae.SimDevice(capacity=device_memory)
    # Best fit breaks ties by address, so the recorded segment addresses are reused.
    device.plan_addresses([(e.size, e.addr) for e in trace.events if e.action == "segment_alloc"])
    alloc = ae.Allocator(device, config)
    if memory_fraction is not None:
        alloc.set_memory_fraction(memory_fraction)

    events = trace.events
    addr_map: dict[int, int] = {}     # trace address -> replay pointer
    sizes: dict[int, int] = {}        # trace address -> requested size (of live allocations)
    pending: dict[int, int] = {}      # trace address -> replay stream its free waits on
    failed: set[int] = set()          # trace addresses whose allocation ran out of memory
    unknown: dict[str, int] = {}
    requested = peak_requested = 0
    recorded_reserved = recorded_peak = recorded_segments = recorded_ooms = 0
    empty_cache_calls = 0
    next_pending_stream = PENDING_STREAM_BASE
    tl = Timeline()
    t0 = events[0].time_us if events else 0

    i = 0
    n = len(events)
    while i < n:
        e = events[i]
        a = e.action
        if a == "alloc":
            try:
                addr_map[e.addr] = alloc.malloc(e.size, e.stream)
                sizes[e.addr] = e.size
                requested += e.size
                peak_requested = max(peak_requested, requested)
            except ae.OutOfMemoryError:
                failed.add(e.addr)
        elif a == "free_requested":
            at_once = free_completes_at_once(events, i)
            if e.addr in failed:
                failed.discard(e.addr)
                if at_once:
                    i += 1
            else:
                ptr = addr_map.pop(e.addr)
                if at_once:
                    alloc.free(ptr)
                    requested -= sizes.pop(e.addr)
                    i += 1
                else:
                    stream = next_pending_stream
                    next_pending_stream += 1
                    alloc.record_stream(ptr, stream)
                    alloc.free(ptr)
                    pending[e.addr] = stream
        elif a == "free_completed":
            if e.addr in pending:
                stream = pending.pop(e.addr)
                device.complete_stream(stream)
                alloc.process_events()
                requested -= sizes.pop(e.addr)
        elif a in ("segment_alloc", "segment_map"):
            recorded_reserved += e.size
            recorded_peak = max(recorded_peak, recorded_reserved)
            recorded_segments += 1
        elif a in ("segment_free", "segment_unmap"):
            starts_run = i == 0 or events[i - 1].action not in ("segment_free", "segment_unmap")
            if starts_run and not _is_allocator_release(events, i):
                alloc.empty_cache()
                empty_cache_calls += 1
            recorded_reserved -= e.size
        elif a == "oom":
            recorded_ooms += 1
        elif a not in KNOWN_ACTIONS:
            unknown[a] = unknown.get(a, 0) + 1
        if timeline:
            s = alloc.stats()
            tl.time_s.append((e.time_us - t0) / 1e6)
            tl.requested.append(requested)
            tl.allocated.append(s["allocated_bytes.all.current"])
            tl.reserved.append(s["reserved_bytes.all.current"])
            tl.recorded_reserved.append(recorded_reserved)
        i += 1
        if progress is not None and (i & 1023) == 0:
            progress(i)
    if progress is not None:
        progress(n)

    stats = alloc.stats()
    counters = device.counters()
    estimate, calls = costs.price(counters)
    trace_s = trace_seconds(trace)
    peak_reserved = stats["reserved_bytes.all.peak"]
    report: dict[str, Any] = {
        "trace": trace.path,
        "config": alloc.config_string(),
        "device_memory": device_memory,
        "peak_requested_bytes": peak_requested,
        "peak_allocated_bytes": stats["allocated_bytes.all.peak"],
        "peak_reserved_bytes": peak_reserved,
        "reserved_ratio": peak_reserved / peak_requested if peak_requested else 0.0,
        "num_alloc_retries": stats["num_alloc_retries"],
        "num_ooms": stats["num_ooms"],
        "num_device_alloc": stats["num_device_alloc"],
        "num_device_free": stats["num_device_free"],
        "num_sync_all_streams": stats["num_sync_all_streams"],
        "device_calls": calls,
        "device_call_seconds_estimate": estimate,
        "trace_seconds": trace_s,
        "device_call_share": estimate / trace_s if trace_s else 0.0,
        "cost_table": costs.source,
        "events_replayed": n,
        "empty_cache_calls_replayed": empty_cache_calls,
        "unknown_actions": unknown,
        "recorded": {
            "config": trace.recorded_config,
            "peak_reserved_bytes": recorded_peak,
            "num_segment_alloc": recorded_segments,
            "num_ooms": recorded_ooms,
        },
    }
    return ReplayResult(report, tl)
