"""The replay stepper: a step is one event, a pass the whole trace, and passes repeat on one
allocator when each frees what it still holds."""

from __future__ import annotations

import pytest
from support.paths import REPO

from allocator_ext.replay import Replayer, load_cost_table, load_trace, replay
from allocator_ext.replay.trace import parse_snapshot

EXAMPLE = REPO / "allocator_ext" / "data" / "example_trace.pickle.gz"
MiB = 1 << 20


def _event(action: str, addr: int, size: int, time_us: int, stream: int = 0) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": time_us}


def test_stepping_event_by_event_is_the_pass() -> None:
    trace = load_trace(EXAMPLE)
    by_steps = Replayer(trace)
    while not by_steps.at_end:
        by_steps.step()
    costs = load_cost_table()
    assert by_steps.report(costs) == replay(trace).report
    assert by_steps.events_replayed == len(trace.events)


def test_a_plain_free_is_one_step_and_a_waiting_free_two() -> None:
    seg = 1 << 30
    events = [_event("segment_alloc", seg, 20 * MiB, 1),
              _event("alloc", seg, 4 * MiB, 2),
              _event("alloc", seg + 4 * MiB, 4 * MiB, 3),
              _event("free_requested", seg, 4 * MiB, 4),      # plain: completed at once
              _event("free_completed", seg, 4 * MiB, 5),
              _event("free_requested", seg + 4 * MiB, 4 * MiB, 6),  # waits for another stream
              _event("alloc", seg + 8 * MiB, 1 * MiB, 7),
              _event("free_completed", seg + 4 * MiB, 4 * MiB, 8)]
    r = Replayer(parse_snapshot({"device_traces": [events]}), "native")
    positions, held = [], []
    while not r.at_end:
        r.step()
        positions.append(r.position)
        held.append(r.requested)
    assert positions == [1, 2, 3, 5, 6, 7, 8]
    # The waiting free still counts as requested until its completion.
    assert held == [0, 4 * MiB, 8 * MiB, 4 * MiB, 4 * MiB, 5 * MiB, 1 * MiB]
    assert r.peak_requested == 8 * MiB


def test_passes_repeat_when_each_releases_what_it_holds() -> None:
    r = Replayer(load_trace(EXAMPLE), "native")
    first = r.run_pass(release=True)
    assert not r.holds_memory and r.requested == 0
    second = r.run_pass(release=True)
    # PyTorch's defaults cache every segment: the second pass asks nothing of the device.
    assert first.device_calls["malloc"]["count"] > 100
    assert second.device_calls.get("malloc", {}).get("count", 0) == 0
    assert second.peak_reserved_bytes == first.peak_reserved_bytes
    assert r.passes == 2 and r.events_replayed == 2 * len(r.trace.events)


def test_a_pass_that_kept_its_memory_cannot_be_repeated() -> None:
    r = Replayer(load_trace(EXAMPLE))
    r.run_pass()
    assert r.holds_memory  # the trace ends with its model's weights still allocated
    with pytest.raises(RuntimeError, match="release=True"):
        r.run_pass()


def test_progress_counts_events_up_to_the_whole_trace() -> None:
    trace = load_trace(EXAMPLE)
    seen: list[int] = []
    Replayer(trace).run_pass(progress=seen.append)
    assert seen == sorted(seen) and seen[-1] == len(trace.events) and len(seen) > 50
