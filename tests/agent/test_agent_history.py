"""A history that began with memory in use is preceded, in the snapshot the agent writes, by the
state it began from, rebuilt by undoing the history from the snapshot's end state: the rebuilt
state must be exactly what the allocator held when the history started (checked against a
snapshot taken then), under PyTorch's settings and allocwatch's (expandable segments), across
segment releases, and the result must replay."""

from __future__ import annotations

import random

import pytest

import allocator_ext as ae
from allocator_ext.agent.history import PROLOGUE, with_starting_state
from allocator_ext.replay.engine import replay
from allocator_ext.replay.trace import parse_snapshot

MiB = 1 << 20


def joined(ranges: list[tuple[int, int]]) -> set[tuple[int, int]]:
    """Address ranges, contiguous ones joined."""
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and out[-1][1] == lo:
            out[-1][1] = hi
        else:
            out.append([lo, hi])
    return {(lo, hi) for lo, hi in out}


def state(snapshot: dict) -> tuple[set[tuple[int, int]], set[tuple[int, int]]]:
    """(mapped ranges joined where contiguous, live blocks and the size asked for each) of a
    snapshot's segments."""
    ranges = [(s["address"], s["address"] + s["total_size"]) for s in snapshot["segments"]]
    live = {(b["address"], b["requested_size"]) for s in snapshot["segments"]
            for b in s["blocks"] if b["state"] == "active_allocated"}
    return joined(ranges), live


def rebuilt(prologue: list[dict]) -> tuple[set[tuple[int, int]], set[tuple[int, int]]]:
    """The same, of the entries the agent puts in front of a history."""
    ranges = [(e["addr"], e["addr"] + e["size"]) for e in prologue
              if e["action"] in ("segment_alloc", "segment_map")]
    live = {(e["addr"], e["size"]) for e in prologue if e["action"] == "alloc"}
    return joined(ranges), live


def workload(allocator, rng: random.Random, steps: int, live: list[int]) -> None:
    for step in range(steps):
        if live and rng.random() < 0.4:
            allocator.free(live.pop(rng.randrange(len(live))))
        else:
            size = rng.choice([rng.randrange(1, 1 << 20), rng.randrange(1, 64) * MiB // 3])
            live.append(allocator.malloc(size, stream=0))
        if step % 97 == 96:
            allocator.empty_cache()  # segments released inside the history


@pytest.mark.parametrize("config", [None, "native"], ids=["allocwatch", "pytorch-defaults"])
@pytest.mark.parametrize("seed", range(6))
def test_the_rebuilt_start_is_the_state_the_history_began_from(config, seed: int) -> None:
    rng = random.Random(seed)
    allocator = ae.Allocator(ae.SimDevice(capacity=16 << 30), config)
    live: list[int] = []
    workload(allocator, rng, rng.randrange(0, 400), live)
    at_start = allocator.snapshot()  # history off: this records nothing
    allocator.record_history(True, 1_000_000)
    workload(allocator, rng, 300, live)
    snapshot = allocator.snapshot()

    fixed = with_starting_state(snapshot)
    [trace] = fixed["device_traces"]
    prologue = [e for e in trace if e.get("user_metadata") == PROLOGUE]
    assert trace[len(prologue):] == snapshot["device_traces"][0]  # the history itself unchanged
    assert rebuilt(prologue) == state(at_start)
    replay(parse_snapshot(fixed), config=config)  # starts from an empty allocator now


def test_a_history_that_began_empty_or_no_history_is_left_alone() -> None:
    allocator = ae.Allocator(ae.SimDevice(capacity=1 << 30))
    assert with_starting_state(allocator.snapshot()) == allocator.snapshot()
    allocator.record_history(True, 1000)
    allocator.free(allocator.malloc(MiB, stream=0))
    snapshot = allocator.snapshot()
    assert with_starting_state(snapshot)["device_traces"] == snapshot["device_traces"]


def test_a_free_pending_when_the_history_began_is_requested_in_the_prologue() -> None:
    segments = [{"address": 0, "total_size": 2 * MiB, "stream": 0, "is_expandable": False,
                 "blocks": [{"address": 0, "size": 2 * MiB, "state": "inactive"}]}]
    trace = [{"action": "free_completed", "addr": 0, "size": 512, "stream": 0, "time_us": 7}]
    [entries] = with_starting_state({"segments": segments, "device_traces": [trace]})[
        "device_traces"]
    assert [(e["action"], e["addr"], e["size"]) for e in entries] == [
        ("segment_alloc", 0, 2 * MiB), ("alloc", 0, 512), ("free_requested", 0, 512),
        ("free_completed", 0, 512)]
    assert all(e["time_us"] == 7 for e in entries)
