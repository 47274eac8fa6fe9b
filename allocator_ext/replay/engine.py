"""Replaying a recorded trace as `allocwatch replay` does: the report, and optionally the memory
over time for a plot. How events are replayed is the Replayer's (replayer.py).

With several passes the trace's program runs again and again on the one allocator, each pass
freeing what it still holds at its end, as the steps of a long run repeat: the report stays the
first pass's (what the recorded run itself would have done), and gains each pass's figures and
what the last pass reached (`passes`, `long_run`): whether reserved memory keeps growing, and
what the device calls cost once the cache is warm."""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from allocator_ext.replay.costs import CostTable, load_cost_table
from allocator_ext.replay.peak import PeakWatch
from allocator_ext.replay.replayer import PassResult, Replayer
from allocator_ext.replay.trace import Trace, TraceEvent


@dataclass
class Timeline:
    """The replay's memory after each step, for plots, on the trace's active clock (the time
    `trace_seconds` reports): requested, allocated and reserved bytes and what the recorded run
    reserved; the steps at which the allocator retried or ran out of memory; its cap."""

    time_s: list[float] = field(default_factory=list)
    event_index: list[int] = field(default_factory=list)  # the last event each step replayed
    requested: list[int] = field(default_factory=list)
    allocated: list[int] = field(default_factory=list)
    reserved: list[int] = field(default_factory=list)
    recorded_reserved: list[int] = field(default_factory=list)
    retries_at: list[int] = field(default_factory=list)  # steps (indices above) that retried
    ooms_at: list[int] = field(default_factory=list)     # steps that ran out of memory
    cap_bytes: int = 0                 # what the allocator may reserve (0: no cap)
    memory_fraction: float | None = None
    # Where each pass after the first began, on the same clock.
    pass_starts_s: list[float] = field(default_factory=list)

    def recorder(self, replayer: Replayer,
                 steps_per_point: int = 1) -> Callable[[TraceEvent], None]:
        """A Replayer `after_step` callback that appends the replayer's figures: one point per
        `steps_per_point` steps, each series at its highest over them (so that a long replay
        draws in bounded memory and no peak is lost), and the last step of a pass its own."""
        self.cap_bytes = replayer.allocator.memory_limit or replayer.device_memory
        self.memory_fraction = replayer.memory_fraction
        clock = replayer.active_s
        events = len(clock)
        counts = {"num_alloc_retries": 0, "num_ooms": 0}
        marks = {"num_alloc_retries": self.retries_at, "num_ooms": self.ooms_at}
        series = (self.requested, self.allocated, self.reserved, self.recorded_reserved)
        pending: list[int] = []
        steps_in_point = [0]

        def record(_event: TraceEvent) -> None:
            s = replayer.allocator.stats()
            last = replayer.position - 1
            for key, seen in counts.items():
                if s[key] > seen:
                    marks[key].append(len(self.time_s))  # the point this step goes into
                    counts[key] = s[key]
            # Passes follow one another on the clock; event indices count on across them.
            start = replayer.passes * clock[-1]
            if replayer.passes and last == 0:
                self.pass_starts_s.append(start)
            values = (replayer.requested, s["allocated_bytes.all.current"],
                      s["reserved_bytes.all.current"], replayer.recorded_reserved)
            if steps_in_point[0] == 0:
                pending[:] = values
            else:
                pending[:] = [max(a, b) for a, b in zip(pending, values, strict=True)]
            steps_in_point[0] += 1
            if steps_in_point[0] >= steps_per_point or replayer.position >= events:
                self.time_s.append(start + clock[last])
                self.event_index.append(replayer.passes * events + last)
                for kept, value in zip(series, pending, strict=True):
                    kept.append(value)
                steps_in_point[0] = 0

        return record

    def step_of_event(self, event_index: int) -> int:
        """The step that replayed event `event_index`: the first whose last event is at or
        after it."""
        return min(bisect.bisect_left(self.event_index, event_index), len(self.event_index) - 1)


@dataclass
class ReplayResult:
    report: dict[str, Any]
    timeline: Timeline


def replay(
    trace: Trace,
    config: str | None = None,
    device_memory: int = 0,
    memory_fraction: float | None = None,
    costs: CostTable | None = None,
    progress: Callable[[int], None] | None = None,
    timeline: bool = False,
    passes: int = 1,
    explain_peak: bool = False,
) -> ReplayResult:
    """Replays `trace` under `config` (None: allocwatch's defaults; "native": PyTorch's),
    `passes` times on one allocator (the report is the first pass's; with more, it gains
    `passes` and `long_run`).

    `device_memory` caps the simulated device (0: unlimited); `memory_fraction` applies
    ``set_per_process_memory_fraction``. `progress` is called with the number of events done,
    over all passes. With `explain_peak` the report gains `peak_anatomy`: what the first
    pass's reserved memory held at its peak (peak.py; a snapshot at each new high).
    """
    if passes < 1:
        raise ValueError(f"passes must be at least 1, not {passes}")
    costs = costs or load_cost_table()
    replayer = Replayer(trace, config, device_memory, memory_fraction)
    tl = Timeline()
    # About as many points as one pass has steps, however many passes are drawn.
    recorder = tl.recorder(replayer, steps_per_point=passes) if timeline else None
    watch = PeakWatch(replayer) if explain_peak else None
    n = len(trace.events)
    looped = passes > 1  # every pass then gets a row, and the report a long-run verdict
    rows: list[dict[str, Any]] = []
    report: dict[str, Any] = {}
    for done in range(passes):
        def pass_progress(events: int, done: int = done) -> None:
            if progress is not None:
                progress(done * n + events)

        before = replayer.allocator.stats() if looped else {}
        result = replayer.run_pass(progress=pass_progress,
                                   after_step=_both(recorder, watch if done == 0 else None))
        if done == 0:
            # The first pass is the recorded run's own: its report before anything is freed.
            report = replayer.report(costs)
            if watch is not None and watch.anatomy is not None:
                report["peak_anatomy"] = watch.anatomy.as_dict()
        if looped:
            rows.append(_pass_row(done + 1, replayer, before, result, costs))
        if done + 1 < passes:
            replayer.release_held()
    if looped:
        report["passes"] = rows
        report["long_run"] = _long_run(rows, report)
    return ReplayResult(report, tl)


def _both(*callbacks: Callable[[TraceEvent], None] | None
          ) -> Callable[[TraceEvent], None] | None:
    """One after_step callback that calls each of `callbacks` given (None: none given)."""
    given = [c for c in callbacks if c is not None]
    if len(given) <= 1:
        return given[0] if given else None

    def each(event: TraceEvent) -> None:
        for callback in given:
            callback(event)

    return each


def _pass_row(number: int, replayer: Replayer, before: dict[str, int], result: PassResult,
              costs: CostTable) -> dict[str, Any]:
    """One pass's figures: peak reserved so far, what the pass itself cost and ran into."""
    after = replayer.allocator.stats()
    seconds, calls = costs.price(result.device_calls)
    trace_s = replayer.active_s[-1]
    reached = [o for o in replayer.ooms if o.recurred is not None]
    return {
        "pass": number,
        "peak_reserved_bytes": result.peak_reserved_bytes,
        "reserved_ratio": (result.peak_reserved_bytes / replayer.peak_requested
                           if replayer.peak_requested else 0.0),
        "reserved_bytes_at_end": result.reserved_bytes,
        "mapped_bytes_at_end": mapped_bytes(replayer.device),
        "device_calls": calls,
        "device_call_seconds_estimate": seconds,
        "device_call_share": seconds / trace_s if trace_s else 0.0,
        "num_device_alloc": after["num_device_alloc"] - before["num_device_alloc"],
        "num_device_free": after["num_device_free"] - before["num_device_free"],
        "num_alloc_retries": after["num_alloc_retries"] - before["num_alloc_retries"],
        "num_ooms": after["num_ooms"] - before["num_ooms"],
        "recorded_ooms_recurred": sum(1 for o in reached if o.recurred),
    }


def mapped_bytes(device: Any) -> int:
    """The address space the simulated device has mapped: each address a page is mapped at
    counts, so aliased pages (alias_pages) count once per address, while reserved memory
    counts them once; without aliases the two differ only by pages moved and not yet unmapped."""
    c = device.counters()

    def made(call: str) -> int:
        return int(c.get(call, {}).get("bytes", 0))

    unmapped = made("unmap") + made("unmap_off_thread")
    return made("map_only") - unmapped + made("malloc") - made("free")


# A long run's bar (bench/replay/steady_state.py; tune's verdict on a setting that keeps
# mapping new addresses): once settled, what it reserves, and the address space it maps beyond
# that, grow by at most this share.
STEADY_GROWTH_MARGIN = 0.002


def mapped_beyond_reserved(row: dict[str, Any]) -> int:
    """A pass row's address space mapped beyond its reserved memory at the pass's end: aliased
    pages' extra addresses (0 without aliases)."""
    return int(row["mapped_bytes_at_end"] - row["reserved_bytes_at_end"])


def _long_run(rows: list[dict[str, Any]], first: dict[str, Any]) -> dict[str, Any]:
    """What the passes add up to: the last pass's peak beside the first's, and the worst of
    what the passes after the first cost and ran into."""
    last, later = rows[-1], rows[1:]
    return {
        "passes": len(rows),
        "peak_reserved_bytes": last["peak_reserved_bytes"],
        "reserved_ratio": last["reserved_ratio"],
        "growth_over_first_pass": (last["peak_reserved_bytes"] / first["peak_reserved_bytes"]
                                   if first["peak_reserved_bytes"] else 1.0),
        "device_call_share_last_pass": last["device_call_share"],
        "device_call_share_worst_later_pass": max(r["device_call_share"] for r in later),
        "num_alloc_retries_later_passes": sum(r["num_alloc_retries"] for r in later),
        "num_ooms_later_passes": sum(r["num_ooms"] for r in later),
        # Aliased pages' addresses beyond reserved memory: flat once the layout has settled.
        "mapped_beyond_reserved_first_pass": mapped_beyond_reserved(rows[0]),
        "mapped_beyond_reserved_last_pass": mapped_beyond_reserved(last),
    }
