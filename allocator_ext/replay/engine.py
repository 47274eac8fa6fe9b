"""Replaying a recorded trace once, as `allocwatch replay` does: the report, and optionally the
memory over time for a plot. How events are replayed is the Replayer's (replayer.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from allocator_ext.replay.costs import CostTable, load_cost_table
from allocator_ext.replay.replayer import Replayer
from allocator_ext.replay.trace import Trace, TraceEvent


@dataclass
class Timeline:
    """Requested, allocated and reserved bytes after each step, for plots."""

    time_s: list[float] = field(default_factory=list)
    requested: list[int] = field(default_factory=list)
    allocated: list[int] = field(default_factory=list)
    reserved: list[int] = field(default_factory=list)
    recorded_reserved: list[int] = field(default_factory=list)

    def recorder(self, replayer: Replayer) -> Callable[[TraceEvent], None]:
        """A Replayer `after_step` callback that appends the replayer's figures."""
        events = replayer.trace.events
        t0 = events[0].time_us if events else 0

        def record(event: TraceEvent) -> None:
            s = replayer.allocator.stats()
            self.time_s.append((event.time_us - t0) / 1e6)
            self.requested.append(replayer.requested)
            self.allocated.append(s["allocated_bytes.all.current"])
            self.reserved.append(s["reserved_bytes.all.current"])
            self.recorded_reserved.append(replayer.recorded_reserved)

        return record


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
