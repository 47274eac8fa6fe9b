"""A training script that imports torch and nothing of allocwatch: it stands in for an example's
`train.py` where what is tested is the start-up itself, so that the only agent it can have is
the one the start-up hook starts when the program imports torch.

    python train_torch.py STOP_FILE

It prints its pid, waits until STOP_FILE exists, then prints whether CUDA was ever initialised
(the hook must not have: CUDA starts at the program's own first use of it)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch


def main() -> int:
    stop = Path(sys.argv[1])
    print(f"worker pid {os.getpid()}", flush=True)
    weights = torch.ones(1 << 16)  # a CPU tensor: this machine's torch has no CUDA
    while not stop.exists():
        time.sleep(0.1)
    print(f"cuda initialised: {torch.cuda.is_initialized()}; sum {weights.sum().item():.0f}",
          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
