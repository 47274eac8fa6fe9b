"""The seeded workload of seeded_snapshot.py on allocwatch's core and the simulated device: its
history recorded under allocwatch's defaults, replayed with PyTorch's rules (`allocwatch
replay --config native`), gives the peak reserved bytes and device allocations that the same
workload gets from the core under PyTorch's rules directly. It is the GPU test's claim
(test_native_gpu.py) with the core's native preset standing in for PyTorch's allocator: a
failure here is the replay's or the workload's, not the back end's. What the GPU adds and this
cannot: cuBLAS's workspace, allocated once per stream by the first matrix product."""

from __future__ import annotations

from typing import Any

import pytest
from seeded_snapshot import workload

import allocator_ext as ae
from allocator_ext.replay import replay
from allocator_ext.replay.trace import parse_snapshot

MiB = 1 << 20


class CoreOps:
    def __init__(self, config: str | None) -> None:
        self.allocator = ae.Allocator(ae.SimDevice(), config)
        self.allocator.record_history(True, 1_000_000)

    def allocate(self, stream: int, size: int) -> Any:
        return self.allocator.malloc(size, stream)

    def matmul(self, stream: int) -> Any:
        return self.allocator.malloc(512 * 512 * 4, stream)  # the product's output

    def free(self, block: Any) -> None:
        self.allocator.free(block)


@pytest.mark.parametrize("seed", [7, 11, 23])
def test_a_history_recorded_under_allocwatchs_defaults_replays_to_pytorchs_figures(
        seed: int) -> None:
    reference, recorded = CoreOps("native"), CoreOps(None)
    workload(reference, seed=seed)
    workload(recorded, seed=seed)
    assert recorded.allocator.config()["expandable_segments"]  # a layout unlike the reference's
    expected = reference.allocator.stats()
    report = replay(parse_snapshot(recorded.allocator.snapshot(), device=0),
                    config="native").report
    assert (report["peak_reserved_bytes"], report["num_device_alloc"]) == \
        (expected["reserved_bytes.all.peak"], expected["num_device_alloc"])
    assert recorded.allocator.stats()["reserved_bytes.all.peak"] < \
        expected["reserved_bytes.all.peak"]  # the recording's own figures are not the answer
