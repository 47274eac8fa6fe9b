"""Remote tuning rescuing a capped training run, on a GPU.

    python -m bench.gpu.policy_under_cap --fraction-of-peak 1.10 --steps 40 [--json FILE]

bench/gpu/torch_bench.py's transformer runs under a per-process memory cap of F x its peak requested
bytes, with PyTorch's default settings, for each source allocator (PyTorch's own, and
allocwatch's with `native` settings):
  fixed  — no sidecar: with PyTorch's defaults this runs out of memory or retries heavily;
  tuned  — the agent publishes to a sidecar whose policy switches the running process to
           expandable segments as soon as fragmentation shows (a set_config sent while it runs).
Reported per run (printed; with --json also written as one JSON object): steps completed, the
out-of-memory error if any, retries, peak reserved, allocated and requested bytes, device calls;
and how many policy actions the sidecar logged.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench import REPO
from bench.lib.sidecar_process import SidecarProcess

BENCH = REPO / "bench" / "gpu" / "torch_bench.py"
POLICY = """\
policy:
  interval: 0.5s
  rules:
    - name: switch-to-expandable
      metric: fragmentation_ratio
      above: 0.05
      for: 0s
      cooldown: 1h
      max_actions_per_hour: 1
      action: set_config
      settings: "expandable_segments:True"
"""


def child(allocator: str, steps: int, fraction: float, peak: int, agent: str | None) -> dict:
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="")
    if allocator == "allocwatch":
        env.update(ALLOCWATCH_BENCH_INSTALL="1", ALLOCWATCH_ALLOC_CONF="native")
    if agent:
        env["ALLOCWATCH_BENCH_AGENT"] = agent
    out = subprocess.run([sys.executable, str(BENCH), "--child", "train", str(steps),
                          str(fraction), str(peak)], env=env, capture_output=True, text=True,
                         timeout=900)
    if out.returncode != 0:
        return {"error": out.stderr[-600:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fraction-of-peak", type=float, default=1.03,
                   help="the cap, as a multiple of the workload's peak requested bytes")
    p.add_argument("--steps", type=int, default=40, help="training steps a run tries")
    p.add_argument("--json", metavar="FILE", help="also write every run's figures here")
    args = p.parse_args()

    reference = child("pytorch", args.steps, 0.0, 0, None)
    peak = int(reference.get("peak_requested", 0))
    sidecar = SidecarProcess("allocwatch-policy-", extra_yaml=POLICY).start()
    time.sleep(3)
    runs = []
    try:
        for allocator in ("pytorch", "allocwatch"):
            for mode in ("fixed", "tuned"):
                agent = sidecar.target if mode == "tuned" else None
                result = child(allocator, args.steps, args.fraction_of_peak, peak, agent)
                runs.append({"allocator": allocator, "mode": mode, **result})
                print(json.dumps(runs[-1]), flush=True)
    finally:
        sidecar.stop()
    actions = [line for line in sidecar.log.read_text().splitlines()
               if "switch-to-expandable" in line and '"act"' in line]
    summary = {"command": " ".join(sys.argv), "peak_requested": peak, "runs": runs,
               "policy_actions_logged": len(actions)}
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
