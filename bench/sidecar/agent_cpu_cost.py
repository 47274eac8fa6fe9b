"""The agent's own CPU time: an upper bound on what it can take from a training loop.

    python -m bench.sidecar.agent_cpu_cost [--seconds 30] [--interval 1.0]
                                           [--source sim|pytorch|allocwatch] [--json FILE]

A process holds 1,000 blocks in use and runs the agent publishing to a real sidecar (its own
process) for SECONDS; the same process without the agent is the baseline. The blocks come from
allocwatch's core on the simulated device (--source sim, no GPU, NVML off), or, on a GPU, from
CUDA tensors under PyTorch's allocator (--source pytorch: the agent reads
torch.cuda.memory_stats) or allocwatch's (--source allocwatch), with NVML read as in training.
Reported: the agent's CPU seconds per wall-clock second (all its threads: sampling,
serialising, gRPC), and the time one sample takes while holding the GIL (samples spaced as in
training, beyond the NVML reader's cache) — the part that can delay the training thread.
Whatever the step time, the agent cannot cost a loop more than its share of one core; this
bounds the overhead that bench/sidecar/agent_overhead.py measures on the GPU, where noise hides
anything this small.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.lib.sidecar_process import SidecarProcess

MiB = 1 << 20


SIZES = [512, 4096, MiB, 8 * MiB, 64 * MiB] * 200  # 1,000 blocks, 14.26 GiB


def hold_blocks(source: str) -> tuple[list, object, bool]:
    """(blocks held, the agent's source, whether to read NVML)"""
    import allocator_ext as ae

    if source == "sim":
        alloc = ae.Allocator(ae.SimDevice(capacity=80 << 30))
        return [alloc.malloc(size) for size in SIZES], alloc, False
    import torch

    if source == "allocwatch":
        assert ae.install(), "allocwatch did not install"
    held = [torch.empty(size, dtype=torch.uint8, device="cuda") for size in SIZES]
    torch.cuda.synchronize()
    return held, source, True


def child(seconds: float, interval: float, target: str, source: str) -> dict:
    held, agent_source, nvml = hold_blocks(source)
    agent = None
    samples: list[float] = []
    if target:
        from allocator_ext.agent import start_agent

        agent = start_agent(target, interval=interval, source=agent_source, nvml=nvml,
                            stop_at_exit=False)
        time.sleep(2 * interval)  # connected and publishing
    before = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_SELF)
    out: dict[str, Any] = {
        "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        "wall_s": wall, "blocks_in_use": len(held)}
    if agent is not None:
        out["reports_sent"] = agent.reports_sent
        out["sample_errors"] = agent.sample_errors
        out["nvml"] = ("off" if not nvml else "unavailable" if agent.nvml is None
                       else agent.nvml.failure or "read")
        # The sampling step alone, as the sampler thread runs it: spaced beyond the NVML
        # reader's cache (half the interval), so that each sample reads NVML as in training.
        for _ in range(20):
            time.sleep(0.6 * interval)
            t0 = time.perf_counter()
            agent.sample_once()
            samples.append(time.perf_counter() - t0)
        out["sample_median_us"] = statistics.median(samples) * 1e6
        agent.stop()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--interval", type=float, default=1.0)
    p.add_argument("--source", choices=["sim", "pytorch", "allocwatch"], default="sim",
                   help="whose blocks the agent samples (pytorch and allocwatch need a GPU)")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        seconds, interval, target = float(args.child[0]), float(args.child[1]), args.child[2]
        print(json.dumps(child(seconds, interval, "" if target == "-" else target, args.source)))
        return 0

    sidecar = SidecarProcess("allocwatch-agent-cpu-").start()
    time.sleep(3)
    runs = {}
    try:
        for name, target in (("without", "-"), ("with", sidecar.target)):
            out = subprocess.run([sys.executable, "-m", __spec__.name, "--child", str(args.seconds),
                                  str(args.interval), target, "--source", args.source],
                                 capture_output=True, text=True,
                                 timeout=args.seconds + 120, env=dict(os.environ))
            if out.returncode != 0:
                print(out.stderr[-800:], file=sys.stderr)
                return 1
            runs[name] = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        sidecar.stop()
    if not runs["with"].get("reports_sent"):
        print("the agent sent no report to the sidecar: no figure", file=sys.stderr)
        return 1
    extra = runs["with"]["cpu_s"] - runs["without"]["cpu_s"]
    summary = {"command": " ".join(sys.argv), "source": args.source, "runs": runs,
               "agent_cpu_share_of_one_core": extra / runs["with"]["wall_s"],
               "sample_median_us": runs["with"]["sample_median_us"],
               "reports_sent": runs["with"]["reports_sent"],
               "sample_errors": runs["with"]["sample_errors"], "nvml": runs["with"]["nvml"]}
    print(f"agent: {100 * summary['agent_cpu_share_of_one_core']:.3f} % of one core "
          f"({runs['with']['reports_sent']} reports in {runs['with']['wall_s']:.0f} s); "
          f"one sample {summary['sample_median_us']:.0f} us; NVML {summary['nvml']}, "
          f"{summary['sample_errors']} sample errors")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
