"""The benchmarks' statistics source (bench.lib.allocators.Counters): allocwatch's core where it
serves PyTorch, found once PyTorch has made it.

No GPU here: allocwatch is not installed into this CPU build of torch, so the two calls that
find its core are replaced; the core itself is a real one, on the simulated device.
"""

from __future__ import annotations

import pytest

import allocator_ext
from bench.lib.allocators import Counters

torch = pytest.importorskip("torch")


def test_the_core_made_after_the_counters_is_found_at_the_next_read(monkeypatch) -> None:
    # A workload with nothing on the device before its first step (the stream pipeline): the
    # core does not exist when the counters are built, and PyTorch's statistics lack its host
    # waits, so a step's waits read as not counted.
    made: list[allocator_ext.Allocator] = []
    monkeypatch.setattr(allocator_ext, "installed", lambda: True)
    monkeypatch.setattr(allocator_ext, "allocator", lambda device=0: made[0] if made else None)
    counters = Counters(torch)
    assert "num_host_waits.device" not in counters.stats()
    core = allocator_ext.Allocator(allocator_ext.SimDevice())
    made.append(core)
    core.free(core.malloc(1 << 20, 0))
    stats = counters.stats()
    assert stats["num_host_waits.device"] == 0
    assert stats["allocation.all.allocated"] == 1
    counters.reset_peak()
    assert counters.stats()["allocated_bytes.all.peak"] == 0


def test_without_allocwatch_pytorchs_statistics_serve(monkeypatch) -> None:
    monkeypatch.setattr(allocator_ext, "installed", lambda: False)
    monkeypatch.setattr(allocator_ext, "allocator", lambda device=0: pytest.fail("looked up"))
    counters = Counters(torch)
    expected = dict(torch.cuda.memory_stats(0)) if torch.cuda.is_available() else {}
    assert counters.stats().keys() == expected.keys()
