"""A run of allocwatch's core under PyTorch's settings and a memory fraction that runs out of
memory, recorded as PyTorch records one: what replay, tune and diagnose are tested on where no
GPU recorded a trace."""

from __future__ import annotations

import random
from typing import Any

import allocator_ext as ae
from allocator_ext.replay.trace import RECORDING_KEY

MiB = 1 << 20


def record_capped_run(total: int = 1 << 30, fraction: float = 0.25
                      ) -> tuple[dict[str, Any], dict[str, Any]]:
    """A training-like loop on PyTorch's settings under a memory fraction, which skips a step
    that runs out of memory (as jobs that survive one do): its snapshot, in PyTorch's layout,
    with the cap kept as allocwatch's recorders keep it, and its final statistics."""
    allocator = ae.Allocator(ae.SimDevice(capacity=total), "native")
    allocator.set_memory_fraction(fraction)
    allocator.record_history(True, 1_000_000)
    rng = random.Random(3)
    for _weight in range(4):  # allocated once and kept, as a model's weights are
        allocator.malloc(rng.choice([3, 7, 30]) * MiB)
    for _step in range(40):
        live = []
        try:
            for _ in range(rng.randint(6, 24)):
                live.append(allocator.malloc(rng.randint(1, 4000) * 1024))
            live.append(allocator.malloc(rng.randint(20, 90) * MiB))
        except ae.OutOfMemoryError:
            pass
        for ptr in reversed(live):
            allocator.free(ptr)
    snapshot = allocator.snapshot()
    snapshot[RECORDING_KEY] = {"memory_fraction": fraction, "device_total_bytes": total}
    return snapshot, allocator.stats()
