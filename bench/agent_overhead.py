"""What the agent costs a training loop: bench/torch_bench.py's transformer, under allocwatch's
allocator (or PyTorch's with --allocator pytorch), with and without the agent publishing to a
running sidecar every second; runs interleaved, median step times compared.

    python bench/agent_overhead.py --rounds 4 --steps 40 [--allocator allocwatch|pytorch]
                                   [--json FILE]                                   (on a GPU)

The bar (DESIGN.md): overhead <= 0.5 %. Each run is a fresh process (torch_bench's child).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _sidecar_process import SidecarProcess

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench" / "torch_bench.py"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--allocator", choices=["allocwatch", "pytorch"], default="allocwatch")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()

    sidecar = SidecarProcess("allocwatch-overhead-").start()
    time.sleep(3)
    runs: list[dict] = []
    try:
        for r in range(args.rounds):
            for with_agent in (False, True) if r % 2 == 0 else (True, False):
                env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="")
                if args.allocator == "allocwatch":
                    env["ALLOCWATCH_BENCH_INSTALL"] = "1"
                if with_agent:
                    env["ALLOCWATCH_BENCH_AGENT"] = sidecar.target
                out = subprocess.run([sys.executable, str(BENCH), "--child", "train",
                                      str(args.steps), "0", "0"], env=env, capture_output=True,
                                     text=True, timeout=600)
                result = (json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0
                          else {"error": out.stderr[-400:]})
                runs.append({"round": r, "agent": with_agent, **result})
                print(json.dumps(runs[-1]), flush=True)
    finally:
        sidecar.stop()
    with_ = [x["median_step_s"] for x in runs if x.get("agent") and x.get("median_step_s")]
    without = [x["median_step_s"] for x in runs if not x.get("agent") and x.get("median_step_s")]
    summary = {"command": " ".join(sys.argv), "allocator": args.allocator, "runs": runs}
    if with_ and without:
        summary["median_with_agent_s"] = statistics.median(with_)
        summary["median_without_agent_s"] = statistics.median(without)
        summary["overhead"] = statistics.median(with_) / statistics.median(without) - 1
        print(f"overhead of the agent: {100 * summary['overhead']:+.2f} % "
              f"(bar: 0.5 %; spread between runs is the noise floor)")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
