"""A small training script for the deploy tests: it stands in for an example's `train.py`.

torch here is a CPU build: under `allocwatch run` it would keep PyTorch's allocator (saying so),
whose agent has no CUDA device to report. To publish a real allocator's figures this script
runs what a training step asks of a GPU allocator -- a transformer-like pattern of weights,
activations of varying size and their release -- through allocwatch's core on the simulated
device, and publishes it with an agent of its own (allocator_ext.start_agent, the in-code way),
on the address the container's environment gives (ALLOCWATCH_TARGET). It does not import torch,
so `allocwatch run`'s hook, which acts when a program imports torch, leaves it alone and this
agent is the process's only one (tests/pytorch/test_startup_hook.py tests the hook itself).
Its memory history is recorded from the start, so that a snapshot of it replays.

    python train_sim.py [--seconds S] [--stop-file F]
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

import allocator_ext as ae
from allocator_ext.agent import start_agent

MiB = 1 << 20


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--stop-file", type=Path)
    args = parser.parse_args()

    allocator = ae.Allocator(ae.SimDevice(capacity=8 << 30))
    allocator.record_history(True, 1_000_000)
    agent = start_agent(source=allocator, interval=0.2, nvml=False)
    rank = int(os.environ.get("RANK", "0"))
    rng = random.Random(rank)
    weights = [allocator.malloc(size * MiB, stream=0) for size in (64, 64, 16, 4)]
    deadline = time.monotonic() + args.seconds
    step = 0
    while time.monotonic() < deadline:
        if args.stop_file is not None and args.stop_file.exists():
            break
        sequence = rng.choice((128, 256, 384, 512))
        activations = [allocator.malloc(sequence * k * 64 * 1024, stream=0) for k in (1, 2, 4)]
        scratch = allocator.malloc(rng.randrange(1, 512) * 1024, stream=0)
        for ptr in (scratch, *reversed(activations)):
            allocator.free(ptr)
        step += 1
        if step % 20 == 0:
            print(f"rank {rank} step {step} reserved "
                  f"{allocator.stats()['reserved_bytes.all.current'] // MiB} MiB", flush=True)
        time.sleep(0.02)
    for ptr in weights:
        allocator.free(ptr)
    agent.stop()
    print(f"rank {rank} done after {step} steps", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
