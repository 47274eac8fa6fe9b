"""The replay stepper: one allocator on the simulated device, driven by a trace's events.

The trace's own allocations and frees drive a fresh allocator, per stream:

- ``alloc`` allocates the recorded request size on the recorded stream;
- ``free_requested`` immediately followed by its ``free_completed`` is a plain free;
- a ``free_completed`` that comes later is a cross-stream wait (``record_stream``): the block is
  freed pending an event, which completes where the trace says the wait ended;
- a run of recorded ``segment_free`` that the allocator did not cause (one not followed by the
  segment allocation it made room for) is the user's ``empty_cache()`` and is replayed as one;
- ``oom`` is the request that failed in the recorded run (its rounded size, on its stream): the
  replay makes it too. Where the allocator serves it, the program holds it until the first
  ``free_requested`` after it, where the recorded run began unwinding from the error.

Everything else a replay reports is counted here too: the program's requested bytes, the trace's
own recorded figures, whether each recorded out-of-memory error recurred, and the device calls
of each pass (a pass is the whole trace; passes repeat on the same allocator, as the steps of
a long run do, when each frees what it still holds at its end).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import allocator_ext._core as ae
from allocator_ext.protocol.service import check_settings_text
from allocator_ext.replay.costs import CostTable
from allocator_ext.replay.trace import (
    KNOWN_ACTIONS,
    Trace,
    TraceError,
    TraceEvent,
    active_times,
    free_completes_at_once,
    private_pools,
)

# Pending frees wait on events of streams that exist only in the replay.
PENDING_STREAM_BASE = 1 << 62
SEGMENT_GROWS = ("segment_alloc", "segment_map")
SEGMENT_SHRINKS = ("segment_free", "segment_unmap")
PROGRESS_EVERY = 1024  # events between progress callbacks


@dataclass(frozen=True)
class RecordedFigures:
    """What the recorded run itself did, counted from its trace."""

    peak_reserved_bytes: int
    num_segment_alloc: int
    num_ooms: int
    reserved_at_ooms: tuple[int, ...]  # reserved at each out-of-memory error, after the flush


@dataclass
class RecordedOom:
    """A request that ran out of memory in the recorded run, and what the replay made of it."""

    event_index: int
    size: int
    stream: int
    device_free: int  # the recorded device's free memory at that moment
    time_s: float     # on the trace's active clock (trace.active_times), as trace_seconds
    time_us: int      # the recorded timestamp, to find it in the run's own logs
    recurred: bool | None = None  # None until the replay reaches it

    def as_dict(self) -> dict[str, Any]:
        return {"event_index": self.event_index, "size": self.size, "stream": self.stream,
                "device_free": self.device_free, "time_s": self.time_s,
                "time_us": self.time_us, "recurred": self.recurred}


@dataclass(frozen=True)
class PassResult:
    """One pass over the trace: the device calls it made, and the reserved memory after it."""

    device_calls: dict[str, dict[str, int]]  # the simulated device's counters, this pass only
    peak_reserved_bytes: int  # the allocator's peak so far (every pass up to this one)
    reserved_bytes: int       # reserved at the end of the pass


def recorded_figures(trace: Trace) -> RecordedFigures:
    reserved = peak = segments = 0
    at_ooms: list[int] = []
    for e in trace.events:
        if e.action in SEGMENT_GROWS:
            reserved += e.size
            peak = max(peak, reserved)
            segments += 1
        elif e.action in SEGMENT_SHRINKS:
            reserved -= e.size
        elif e.action == "oom":
            at_ooms.append(reserved)
    return RecordedFigures(peak, segments, len(at_ooms), tuple(at_ooms))


def check_starts_empty(trace: Trace) -> None:
    """Refuses a trace whose history does not begin with an empty allocator."""
    covered = _Intervals()
    live: set[int] = set()
    for i, e in enumerate(trace.events):
        if e.action in SEGMENT_GROWS:
            covered.add(e.addr, e.addr + e.size)
        elif e.action == "alloc":
            if not covered.contains(e.addr):
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


class _Intervals:
    """The union of address ranges seen so far, as sorted disjoint [start, end) pairs."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []

    def add(self, lo: int, hi: int) -> None:
        if hi <= lo:
            return
        # Every range that overlaps or touches [lo, hi) merges into it.
        first = bisect.bisect_left(self._ends, lo)
        last = bisect.bisect_right(self._starts, hi)
        if first < last:
            lo = min(lo, self._starts[first])
            hi = max(hi, self._ends[last - 1])
        self._starts[first:last] = [lo]
        self._ends[first:last] = [hi]

    def contains(self, addr: int) -> bool:
        i = bisect.bisect_right(self._starts, addr) - 1
        return i >= 0 and addr < self._ends[i]


def _allocator_releases(events: list[TraceEvent]) -> list[bool]:
    """Per event: whether it starts a run of segment frees that the user's empty_cache() made
    (not the allocator making room for the allocation that follows it)."""
    starts = [False] * len(events)
    i, n = 0, len(events)
    while i < n:
        if events[i].action not in SEGMENT_SHRINKS:
            i += 1
            continue
        j = i
        while j < n and events[j].action in SEGMENT_SHRINKS:
            j += 1
        starts[i] = not (j < n and events[j].action in ("segment_alloc", "segment_map", "oom"))
        i = j
    return starts


def _counter_delta(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]
                   ) -> dict[str, dict[str, int]]:
    return {k: {f: v[f] - before.get(k, {}).get(f, 0) for f in ("count", "bytes")}
            for k, v in after.items()}


class Replayer:
    """A trace's program replayed on a fresh allocator, one event at a time (`step`) or one
    whole trace at a time (`run_pass`).

    `config`: allocator settings (None: allocwatch's defaults; "native": PyTorch's);
    `device_memory` caps the simulated device (0: unlimited); `memory_fraction` applies
    ``set_per_process_memory_fraction`` to it.
    """

    def __init__(self, trace: Trace, config: str | None = None, device_memory: int = 0,
                 memory_fraction: float | None = None) -> None:
        if not trace.events:
            raise TraceError(f"{trace.path}: the trace holds no events to replay")
        check_starts_empty(trace)
        self.trace = trace
        self.device_memory = device_memory
        self.memory_fraction = memory_fraction
        self.device = ae.SimDevice(capacity=device_memory)
        # With unmap_off_thread, moved pages' old places are unmapped by the allocator's own
        # thread, as on CUDA, here in lockstep with the replay: the same calls every run,
        # priced apart from the share of the allocating thread (costs.OFF_THREAD).
        self.device.set_unmap_thread("own_in_lockstep")
        # Best fit breaks ties by address, so the recorded segment addresses are reused.
        self.device.plan_addresses(
            [(e.size, e.addr) for e in trace.events if e.action == "segment_alloc"])
        # The recorded streams' own work is taken to keep up with the program (events recorded
        # on them complete at once); frees that waited on other streams have streams of their
        # own, completed where the trace says the wait ended.
        for stream in {e.stream for e in trace.events}:
            self.device.set_stream_auto_complete(stream, True)
        self.allocator = ae.Allocator(self.device, config if config is None
                                      else check_settings_text(config))
        if memory_fraction is not None:
            self.allocator.set_memory_fraction(memory_fraction)
        self.recorded = recorded_figures(trace)

        events = trace.events
        self._events = events
        self._empty_cache_at = _allocator_releases(events)
        self._free_at_once = [e.action == "free_requested" and free_completes_at_once(events, i)
                              for i, e in enumerate(events)]
        self._pool_of = private_pools(trace)
        self.active_s = active_times(trace)  # each event's time, as the report counts it
        self.ooms = [RecordedOom(i, e.size, e.stream, e.addr, self.active_s[i], e.time_us)
                     for i, e in enumerate(events) if e.action == "oom"]
        self._oom_at = {o.event_index: o for o in self.ooms}

        self.position = 0           # the next event of the current pass
        self.passes = 0             # passes completed
        self.events_replayed = 0
        self.empty_cache_calls = 0
        self.unknown_actions: dict[str, int] = {}
        self.requested = 0          # bytes the program holds (including frees still waiting)
        self.peak_requested = 0
        self.recorded_reserved = 0  # what the recorded run reserved at this point of the trace
        self._held: dict[int, int] = {}     # trace address -> replay pointer
        self._sizes: dict[int, int] = {}    # trace address -> requested size, until completed
        self._waiting: dict[int, int] = {}  # trace address -> replay stream its free waits on
        self._failed: set[int] = set()      # trace addresses whose allocation ran out of memory
        self._served_ooms: list[tuple[int, int]] = []  # (pointer, size) of recorded OOMs served
        self._next_stream = PENDING_STREAM_BASE

    # ------------------------------------------------------------------ stepping

    @property
    def at_end(self) -> bool:
        return self.position >= len(self._events)

    def step(self) -> TraceEvent:
        """Replays the next event (a plain free together with its completion); returns it."""
        i = self.position
        e = self._events[i]
        a = e.action
        consumed = 1
        if a == "alloc":
            self._allocate(e.addr, e.size, e.stream, self._pool_of[i])
        elif a == "free_requested":
            if self._served_ooms:
                self._release_served_ooms()
            at_once = self._free_at_once[i]
            if at_once:
                consumed = 2
            if e.addr in self._failed:
                self._failed.discard(e.addr)
            elif at_once:
                self.allocator.free(self._held.pop(e.addr))
                self.requested -= self._sizes.pop(e.addr)
            else:
                ptr = self._held.pop(e.addr)
                stream = self._next_stream
                self._next_stream += 1
                self.allocator.record_stream(ptr, stream)
                self.allocator.free(ptr)
                self._waiting[e.addr] = stream
        elif a == "free_completed":
            if e.addr in self._waiting:
                self.device.complete_stream(self._waiting.pop(e.addr))
                self.allocator.process_events()
                self.requested -= self._sizes.pop(e.addr)
        elif a in SEGMENT_GROWS:
            self.recorded_reserved += e.size
        elif a in SEGMENT_SHRINKS:
            if self._empty_cache_at[i]:
                self.allocator.empty_cache()
                self.empty_cache_calls += 1
            self.recorded_reserved -= e.size
        elif a == "oom":
            self._replay_oom(self._oom_at[i])
        elif a not in KNOWN_ACTIONS:
            self.unknown_actions[a] = self.unknown_actions.get(a, 0) + 1
        self.position = i + consumed
        self.events_replayed += consumed
        return e

    def _allocate(self, addr: int, size: int, stream: int,
                  pool: tuple[int, int] | None = None) -> None:
        # A private pool's allocations are made into it, as during the graph's capture, in
        # plain segments: PyTorch lays its private pools out so whatever expandable_segments
        # says, and so does allocwatch's native back end (docs/torch.md, "Private pools").
        if pool is not None:
            self.allocator.begin_allocate_to_pool(pool, stream, plain_segments=True)
        try:
            self._held[addr] = self.allocator.malloc(size, stream)
        except ae.OutOfMemoryError:
            self._failed.add(addr)
            return
        finally:
            if pool is not None:
                self.allocator.end_allocate_to_pool(pool)
        self._sizes[addr] = size
        self.requested += size
        if self.requested > self.peak_requested:
            self.peak_requested = self.requested

    def _replay_oom(self, oom: RecordedOom) -> None:
        try:
            ptr = self.allocator.malloc(oom.size, oom.stream)
        except ae.OutOfMemoryError:
            oom.recurred = True
            return
        oom.recurred = False
        self._served_ooms.append((ptr, oom.size))
        self.requested += oom.size
        self.peak_requested = max(self.peak_requested, self.requested)

    def _release_served_ooms(self) -> None:
        for ptr, size in self._served_ooms:
            self.allocator.free(ptr)
            self.requested -= size
        self._served_ooms.clear()

    # ------------------------------------------------------------------ passes

    def run_pass(self, release: bool = False,
                 progress: Callable[[int], None] | None = None,
                 after_step: Callable[[TraceEvent], None] | None = None) -> PassResult:
        """Replays the whole trace. `release`: free what the program still holds at the end
        and let every waiting free complete, so that another pass can follow. `progress` is
        called with the number of this pass's events done; `after_step` after each step."""
        if self.at_end and self.position:
            if self.holds_memory:
                raise RuntimeError("the previous pass still holds memory: run it with "
                                   "release=True to repeat the trace")
            self.position = 0
            self.recorded_reserved = 0  # the recorded run's figure, from its start again
        if self.position:
            raise RuntimeError(f"a pass starts at the trace's first event, not at "
                               f"event {self.position}")
        before = self.device.counters()
        n = len(self._events)
        next_report = PROGRESS_EVERY
        while self.position < n:
            event = self.step()
            if after_step is not None:
                after_step(event)
            if progress is not None and self.position >= next_report:
                progress(self.position)
                next_report = (self.position // PROGRESS_EVERY + 1) * PROGRESS_EVERY
        if progress is not None:
            progress(n)
        if release:
            self.release_held()
        self.passes += 1
        stats = self.allocator.stats()
        return PassResult(_counter_delta(before, self.device.counters()),
                          stats["reserved_bytes.all.peak"], stats["reserved_bytes.all.current"])

    @property
    def holds_memory(self) -> bool:
        return bool(self._held or self._waiting or self._served_ooms)

    def release_held(self) -> None:
        """Frees everything the program still holds and completes every waiting free."""
        self._release_served_ooms()
        for ptr in self._held.values():
            self.allocator.free(ptr)
        for stream in self._waiting.values():
            self.device.complete_stream(stream)
        self.allocator.process_events()
        self._held.clear()
        self._waiting.clear()
        self._sizes.clear()
        self._failed.clear()
        self.requested = 0

    # ------------------------------------------------------------------ the report

    def report(self, costs: CostTable) -> dict[str, Any]:
        """The replay's figures so far (DESIGN.md's `replay --json` fields and more)."""
        stats = self.allocator.stats()
        estimate, calls = costs.price(self.device.counters())
        trace_s = self.active_s[-1]
        peak_reserved = stats["reserved_bytes.all.peak"]
        reached = [o for o in self.ooms if o.recurred is not None]
        return {
            "trace": self.trace.path,
            "config": self.allocator.config_string(),
            "device_memory": self.device_memory,
            "memory_fraction": self.memory_fraction,
            "peak_requested_bytes": self.peak_requested,
            "peak_allocated_bytes": stats["allocated_bytes.all.peak"],
            "peak_reserved_bytes": peak_reserved,
            "reserved_ratio": peak_reserved / self.peak_requested if self.peak_requested else 0.0,
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
            "events_replayed": self.events_replayed,
            "empty_cache_calls_replayed": self.empty_cache_calls,
            "unknown_actions": dict(self.unknown_actions),
            "recorded_ooms": [o.as_dict() for o in self.ooms],
            "recorded_ooms_survived": sum(1 for o in reached if not o.recurred),
            "recorded_ooms_recurred": sum(1 for o in reached if o.recurred),
            "recorded": {
                "config": self.trace.recorded_config,
                "peak_reserved_bytes": self.recorded.peak_reserved_bytes,
                "num_segment_alloc": self.recorded.num_segment_alloc,
                "num_ooms": self.recorded.num_ooms,
            },
        }
