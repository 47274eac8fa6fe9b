"""What the agent costs a training loop: allocator_ext.workloads' transformer, under allocwatch's
allocator (or PyTorch's with --allocator pytorch), with and without the agent publishing to a
running sidecar every second.

    python -m bench.sidecar.agent_overhead --blocks 12 --steps 30 [--allocator allocwatch|pytorch]
                                   [--model transformer|convnet] [--json FILE]     (on a GPU)

The bar (docs/benchmarks.md): overhead <= 0.5 %. Step times of identical runs in separate processes
differ by several per cent on a shared host, far more than the effect sought, so the comparison
is made inside one process: blocks of STEPS steps alternate without and with the agent
(ABBA order), every block replaying the same sequence of batch shapes, seen once before timing
begins (a shape's first step pays for cuBLAS/cuDNN plan selection and the allocator's growth,
several times a later step's cost); the agent is started
before a block's timing begins (connected, first report sent) and stopped after it ends.
Reported: each pair's ratio of total step time, their mean with its standard error, and the
ratio of the blocks' medians.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.lib.sidecar_process import SidecarProcess
from bench.lib.stats import mean_and_stderr


def child(steps: int, blocks: int, target: str, allocator: str, model_name: str) -> dict:
    """One process: warm up, then timed blocks alternating without/with the agent."""
    import torch

    if allocator == "allocwatch":
        import allocator_ext

        assert allocator_ext.install(), "allocwatch did not install"
    from allocator_ext import workloads
    from allocator_ext.agent import start_agent

    work = workloads.build(model_name, torch.device("cuda"), seed=0)

    def run_block() -> list[float]:
        work.reseed(1)  # every block sees the same batch shapes
        return [workloads.timed_step(work, work.draw()) for _ in range(steps)]

    run_block()  # warm-up: the allocator's cache and cuBLAS/cuDNN plans settle
    out: list[dict] = []
    for b in range(blocks):
        with_agent = (b % 4) in (1, 2)  # ABBA: drift over time cancels out of each pair
        agent = None
        if with_agent:
            agent = start_agent(target, interval=1.0, source=allocator, stop_at_exit=False)
            time.sleep(1.5)  # connected and publishing before timing starts
        times = run_block()
        if agent is not None:
            out.append({"agent": True, "reports_sent": agent.reports_sent,
                        "connected": agent.connected.is_set()})
            agent.stop()
        else:
            out.append({"agent": False})
        out[-1].update(block=b, total_s=sum(times), median_step_s=statistics.median(times))
        print(json.dumps(out[-1]), file=sys.stderr, flush=True)
    return {"blocks": out}


def summarize(blocks: list[dict]) -> dict:
    ratios = []
    for i in range(0, len(blocks) - 1, 2):
        a, b = blocks[i], blocks[i + 1]
        with_, without = (a, b) if a["agent"] else (b, a)
        if with_["agent"] and not without["agent"]:
            ratios.append(with_["total_s"] / without["total_s"] - 1)
    out: dict = {"pair_overheads": ratios}
    if ratios:
        out["overhead"], out["overhead_stderr"] = mean_and_stderr(ratios)
    medians = {flag: statistics.median(x["median_step_s"] for x in blocks if x["agent"] is flag)
               for flag in (True, False) if any(x["agent"] is flag for x in blocks)}
    if len(medians) == 2:
        out["median_with_agent_s"] = medians[True]
        out["median_without_agent_s"] = medians[False]
        out["median_overhead"] = medians[True] / medians[False] - 1
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=12, help="timed blocks (a multiple of 4)")
    p.add_argument("--steps", type=int, default=30, help="training steps per block")
    p.add_argument("--allocator", choices=["allocwatch", "pytorch"], default="allocwatch")
    p.add_argument("--model", choices=["transformer", "moe", "convnet"], default="transformer")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--child", metavar="TARGET", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.steps, args.blocks, args.child, args.allocator, args.model)))
        return 0

    sidecar = SidecarProcess("allocwatch-overhead-").start()
    time.sleep(3)
    try:
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="")
        out = subprocess.run([sys.executable, "-m", __spec__.name, "--child", sidecar.target,
                              "--steps", str(args.steps), "--blocks", str(args.blocks),
                              "--allocator", args.allocator, "--model", args.model],
                             env=env, stdout=subprocess.PIPE, text=True, timeout=900)
    finally:
        sidecar.stop()
    if out.returncode != 0:
        print(f"the training process failed (exit {out.returncode})", file=sys.stderr)
        return 1
    blocks = json.loads(out.stdout.strip().splitlines()[-1])["blocks"]
    summary = {"command": " ".join(sys.argv), "allocator": args.allocator, "model": args.model,
               "blocks": blocks, **summarize(blocks)}
    if "overhead" in summary:
        se = summary["overhead_stderr"]
        print(f"overhead of the agent: {100 * summary['overhead']:+.2f} %"
              + (f" ± {100 * se:.2f} % (standard error over {len(summary['pair_overheads'])} "
                 f"pairs)" if se is not None else "")
              + f"; medians of blocks: {100 * summary.get('median_overhead', math.nan):+.2f} %"
              " (bar: 0.5 %)")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
