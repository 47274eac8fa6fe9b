"""A seeded workload's memory history, recorded in a fresh process under PyTorch's own allocator
(`reference`) or under allocwatch's native back end with its defaults (`allocwatch`).
tests/pytorch/test_native_gpu.py replays allocwatch's recording with PyTorch's rules and expects
the reference's own figures; tests/pytorch/test_seeded_replay.py runs the same workload on the
core and the simulated device.

    python tests/pytorch/seeded_snapshot.py reference|allocwatch OUT_DIR

Writes OUT_DIR/snapshot.pickle (torch.cuda.memory._snapshot()) and OUT_DIR/stats.json
(torch.cuda.memory_stats()). The workload is deterministic: sizes and lifetimes from a seeded
generator, on two streams, each block freed on the stream it was allocated on (a cross-stream
free would make reuse depend on when the GPU finishes), and matrix products of fixed shapes.

It never calls empty_cache(): a trace says so only through the memory a call releases, and
under allocwatch's defaults (paged segments, free pages moved to where memory grows) a call
often releases nothing, or releases pages just before a growth, which reads as a move; a
replay with PyTorch's rules then cannot know that PyTorch's allocator would have released
segments there.
"""

from __future__ import annotations

import json
import pickle
import random
import sys
from pathlib import Path
from typing import Any, Protocol

SIZES = (512, 4096, 65536, 1 << 20, 3 << 20, (7 << 20) + 1234, 24 << 20, 100 << 20)


class Ops(Protocol):
    """What the workload does on stream 0 or 1; each result is a live block until freed."""

    def allocate(self, stream: int, size: int) -> Any: ...
    def matmul(self, stream: int) -> Any: ...
    def free(self, block: Any) -> None: ...


def workload(ops: Ops, seed: int = 7, steps: int = 600) -> None:
    rng = random.Random(seed)
    live: list[list[Any]] = [[], []]
    for step in range(steps):
        which = 0 if rng.random() < 0.75 else 1
        if live[which] and rng.random() < 0.45:
            ops.free(live[which].pop(rng.randrange(len(live[which]))))
        else:
            live[which].append(ops.allocate(which, rng.choice(SIZES) + rng.randrange(4096)))
        if step % 50 == 0:
            live[which].append(ops.matmul(which))


class TorchOps:
    """On the GPU through torch: a block is a tensor, freed when its last reference goes."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.streams = [torch.cuda.current_stream(), torch.cuda.Stream()]
        self.weights = torch.ones(512, 512, device="cuda")

    def allocate(self, stream: int, size: int) -> Any:
        with self.torch.cuda.stream(self.streams[stream]):
            return self.torch.empty(size, dtype=self.torch.uint8, device="cuda")

    def matmul(self, stream: int) -> Any:
        with self.torch.cuda.stream(self.streams[stream]):
            return self.weights @ self.weights

    def free(self, block: Any) -> None:
        del block


def main() -> None:
    import torch

    mode, out = sys.argv[1], Path(sys.argv[2])
    if mode == "allocwatch":
        import allocator_ext

        assert allocator_ext.install() and allocator_ext.torch_integration.native(), \
            "the native back end did not install"
    else:
        assert mode == "reference", mode
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    workload(TorchOps())
    torch.cuda.synchronize()
    out.mkdir(parents=True, exist_ok=True)
    (out / "snapshot.pickle").write_bytes(pickle.dumps(torch.cuda.memory._snapshot()))
    (out / "stats.json").write_text(json.dumps(torch.cuda.memory_stats()))
    print(f"PASS {mode}: backend {torch.cuda.get_allocator_backend()}, peak reserved "
          f"{torch.cuda.memory_stats()['reserved_bytes.all.peak']}")


if __name__ == "__main__":
    main()
