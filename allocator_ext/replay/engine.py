"""Replaying a recorded trace once, as `allocwatch replay` does: the report, and optionally the
memory over time for a plot. How events are replayed is the Replayer's (replayer.py)."""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from allocator_ext.replay.costs import CostTable, load_cost_table
from allocator_ext.replay.replayer import Replayer
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

    def recorder(self, replayer: Replayer) -> Callable[[TraceEvent], None]:
        """A Replayer `after_step` callback that appends the replayer's figures."""
        self.cap_bytes = replayer.allocator.memory_limit or replayer.device_memory
        self.memory_fraction = replayer.memory_fraction
        clock = replayer.active_s
        counts = {"num_alloc_retries": 0, "num_ooms": 0}
        marks = {"num_alloc_retries": self.retries_at, "num_ooms": self.ooms_at}

        def record(_event: TraceEvent) -> None:
            s = replayer.allocator.stats()
            last = replayer.position - 1
            for key, seen in counts.items():
                if s[key] > seen:
                    marks[key].append(len(self.time_s))
                    counts[key] = s[key]
            self.time_s.append(clock[last])
            self.event_index.append(last)
            self.requested.append(replayer.requested)
            self.allocated.append(s["allocated_bytes.all.current"])
            self.reserved.append(s["reserved_bytes.all.current"])
            self.recorded_reserved.append(replayer.recorded_reserved)

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
) -> ReplayResult:
    """Replays `trace` once under `config` (None: allocwatch's defaults; "native": PyTorch's).

    `device_memory` caps the simulated device (0: unlimited); `memory_fraction` applies
    ``set_per_process_memory_fraction``. `progress` is called with the number of events done.
    """
    replayer = Replayer(trace, config, device_memory, memory_fraction)
    tl = Timeline()
    replayer.run_pass(progress=progress, after_step=tl.recorder(replayer) if timeline else None)
    return ReplayResult(replayer.report(costs or load_cost_table()), tl)
