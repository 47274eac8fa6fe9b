"""A seeded workload's memory history, recorded in a fresh process under PyTorch's own allocator
(`reference`) or under allocwatch's native back end (`allocwatch`). tests/pytorch/test_native_gpu.py
replays allocwatch's recording with PyTorch's rules and expects the reference's own figures.

    python tests/pytorch/seeded_snapshot.py reference|allocwatch OUT_DIR

Writes OUT_DIR/snapshot.pickle (torch.cuda.memory._snapshot()) and OUT_DIR/stats.json
(torch.cuda.memory_stats()). The workload is deterministic: sizes and lifetimes from a seeded
generator, on two streams, each block freed on the stream it was allocated on (a cross-stream
free would make reuse depend on when the GPU finishes), and matrix products of fixed shapes.
"""

from __future__ import annotations

import json
import pickle
import random
import sys
from pathlib import Path

import torch

SIZES = (512, 4096, 65536, 1 << 20, 3 << 20, (7 << 20) + 1234, 24 << 20, 100 << 20)


def workload(seed: int = 7, steps: int = 600) -> None:
    rng = random.Random(seed)
    streams = [torch.cuda.current_stream(), torch.cuda.Stream()]
    live: list[list[torch.Tensor]] = [[], []]
    weights = torch.ones(512, 512, device="cuda")
    for step in range(steps):
        which = 0 if rng.random() < 0.75 else 1
        with torch.cuda.stream(streams[which]):
            if live[which] and rng.random() < 0.45:
                live[which].pop(rng.randrange(len(live[which])))
            else:
                size = rng.choice(SIZES) + rng.randrange(4096)
                live[which].append(torch.empty(size, dtype=torch.uint8, device="cuda"))
            if step % 50 == 0:
                live[which].append(weights @ weights)
            if step % 200 == 199:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
    torch.cuda.synchronize()


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    if mode == "allocwatch":
        import allocator_ext

        assert allocator_ext.install() and allocator_ext.torch_integration.native(), \
            "the native back end did not install"
    else:
        assert mode == "reference", mode
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    workload()
    out.mkdir(parents=True, exist_ok=True)
    (out / "snapshot.pickle").write_bytes(pickle.dumps(torch.cuda.memory._snapshot()))
    (out / "stats.json").write_text(json.dumps(torch.cuda.memory_stats()))
    print(f"PASS {mode}: backend {torch.cuda.get_allocator_backend()}, peak reserved "
          f"{torch.cuda.memory_stats()['reserved_bytes.all.peak']}")


if __name__ == "__main__":
    main()
