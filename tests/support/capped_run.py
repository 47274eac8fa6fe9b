"""A run of allocwatch's core under PyTorch's settings and a memory fraction that runs out of
memory, recorded as PyTorch records one: what replay, tune and diagnose are tested on where no
GPU recorded a trace."""

from __future__ import annotations

import random
from typing import Any

import allocator_ext as ae
from allocator_ext.replay.trace import RECORDING_KEY

MiB = 1 << 20


def record_capped_run(total: int = 1 << 30, fraction: float | None = 0.25,
                      keep_cap: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
    """run_capped_steps on PyTorch's settings on a device of `total` bytes, under a memory
    fraction unless None: its snapshot, in PyTorch's layout, with the cap it ran under as
    allocwatch's allocator keeps it (RECORDING_KEY), or without it unless `keep_cap` (as
    PyTorch's own snapshot, which keeps none), and its final statistics."""
    allocator = ae.Allocator(ae.SimDevice(capacity=total), "native")
    if fraction is not None:
        allocator.set_memory_fraction(fraction)
    allocator.record_history(True, 1_000_000)
    run_capped_steps(allocator)
    snapshot = allocator.snapshot()
    if not keep_cap:
        del snapshot[RECORDING_KEY]
    return snapshot, allocator.stats()


def run_capped_steps(allocator: Any) -> None:
    """A training-like loop that skips a step that runs out of memory (as jobs that survive
    one do): under PyTorch's settings it fails several times in 256 MiB."""
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
