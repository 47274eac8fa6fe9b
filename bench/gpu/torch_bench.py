"""allocwatch's allocator inside PyTorch on the GPU, beside PyTorch's own allocators.

    python -m bench.gpu.torch_bench hotpath [--rounds N] [--json FILE]
        alloc + free pairs through torch's C++ raw_alloc/raw_delete (512 B, 64 KiB, 4 MiB,
        64 MiB, and a mix with 1,000 blocks in use), and torch.empty from Python, under
        PyTorch's allocator and allocwatch's (native back end, and pluggable path); ns per pair.
        One process per allocator, all three alive at once and taking turns batch by batch
        (who goes first rotates), since a host's CPU can change pace within seconds: each
        ratio to PyTorch's compares batches run moments apart. Reported: per
        pattern the median over rounds of those ratios, and their geometric mean over the
        five C++ patterns.
    python -m bench.gpu.torch_bench train [--model transformer|moe|convnet] [--rounds N]
                                          [--steps N] [--fraction-of-peak F] [--json FILE]
        One of allocator_ext.workloads' training workloads (random shapes every step; its
        docstring says which). Under PyTorch's default, its expandable segments,
        cudaMallocAsync and allocwatch, runs interleaved; mean and median step time (steps 6
        on) and peak reserved / peak requested; the per-allocator summary compares means,
        paired by round. With --fraction-of-peak 1.03 every run is capped by
        set_per_process_memory_fraction at 1.03 x the workload's peak requested bytes.
Each measurement runs in a fresh process, since the allocator is chosen before CUDA starts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from bench.lib.allocators import ALLOCATORS, setup_in_child
from bench.lib.stats import mean_and_stderr

TRAINED = ("transformer", "moe", "convnet")  # allocator_ext.workloads' training workloads

HOTPATH_CPP = r"""
#include <c10/cuda/CUDACachingAllocator.h>
#include <chrono>
#include <vector>
double pairs_ns(int64_t size, int64_t n, int64_t live) {
  auto* a = c10::cuda::CUDACachingAllocator::get();
  std::vector<void*> held;
  for (int64_t i = 0; i < live; ++i) held.push_back(a->raw_alloc(512 + (i * 4096) % (64 << 10)));
  std::vector<int64_t> sizes;
  if (size > 0) sizes = {size};
  else sizes = {512, 4096, 65536, 1 << 20, 4 << 20, 64 << 20};
  for (int r = 0; r < 2; ++r) for (auto s : sizes) a->raw_delete(a->raw_alloc(s));
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; ++i) a->raw_delete(a->raw_alloc(sizes[i % sizes.size()]));
  auto t1 = std::chrono::steady_clock::now();
  for (void* p : held) a->raw_delete(p);
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / n;
}
"""


HOTPATH_PATTERNS = {  # name: (size, blocks held in use); size 0: the mix of sizes
    "512B": (512, 0), "64KiB": (64 << 10, 0), "4MiB": (4 << 20, 0), "64MiB": (64 << 20, 0),
    "mix1000": (0, 1000),
}
TORCH_EMPTY = "torch.empty 64KiB (Python)"


def child_hotpath_server() -> None:
    """Runs one batch of a pattern per line read from stdin, printing its ns a pair."""
    torch = setup_in_child()
    from torch.utils.cpp_extension import load_inline

    ext = load_inline("hotpath_ext", cpp_sources=HOTPATH_CPP, functions=["pairs_ns"],
                      extra_cflags=["-O2"], with_cuda=True, verbose=False)
    torch.cuda.init()

    def torch_empty_ns() -> float:
        t0 = time.perf_counter_ns()
        for _ in range(2000):
            torch.empty(1 << 16, dtype=torch.uint8, device="cuda")
        return (time.perf_counter_ns() - t0) / 2000

    for size, live in HOTPATH_PATTERNS.values():  # warm every pattern once
        ext.pairs_ns(size, 2000, live)
    torch_empty_ns()
    print("ready", flush=True)
    for line in sys.stdin:
        name = line.strip()
        if name == TORCH_EMPTY:
            ns = torch_empty_ns()
        else:
            size, live = HOTPATH_PATTERNS[name]
            ns = ext.pairs_ns(size, 20000, live)
        print(json.dumps(ns), flush=True)


class HotpathServer:
    """A child process serving hot-path batches under one allocator."""

    def __init__(self, allocator: str):
        self.allocator = allocator
        env = dict(os.environ, **ALLOCATORS[allocator])
        self.proc = subprocess.Popen(
            [sys.executable, "-m", __spec__.name, "--child", "hotpath-server"], env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def wait_ready(self) -> None:
        # Anything the set-up printed (a build's messages) comes before "ready".
        assert self.proc.stdout
        for line in self.proc.stdout:
            if line.strip() == "ready":
                return
        raise RuntimeError(f"{self.allocator}: the hot-path child did not start "
                           f"(exit {self.proc.wait()})")

    def batch(self, pattern: str) -> float:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(pattern + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.allocator}: the hot-path child died "
                               f"(exit {self.proc.poll()})")
        return float(json.loads(line))

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def hotpath_lockstep(allocators: list[str], rounds: int) -> dict:
    """Every round, every pattern: one batch per allocator, in rotating order."""
    servers = [HotpathServer(a) for a in allocators]
    try:
        for s in servers:
            s.wait_ready()
        samples: list[dict] = []
        for r in range(rounds):
            for pattern in [*HOTPATH_PATTERNS, TORCH_EMPTY]:
                k = r % len(servers)
                for s in servers[k:] + servers[:k]:
                    samples.append({"round": r, "pattern": pattern, "allocator": s.allocator,
                                    "ns": s.batch(pattern)})
    finally:
        for s in servers:
            s.close()
    return {"samples": samples, **compare_hotpath(samples)}


def compare_hotpath(samples: list[dict], reference: str = "pytorch") -> dict:
    """Per allocator and pattern: the median ns, and the median over rounds of the ratio to
    the reference's batch of the same round; the geometric mean of those medians over the C++
    patterns."""
    ns: dict[tuple[str, str], list[float]] = {}
    by_round: dict[tuple[int, str], dict[str, float]] = {}
    for x in samples:
        ns.setdefault((x["allocator"], x["pattern"]), []).append(x["ns"])
        by_round.setdefault((x["round"], x["pattern"]), {})[x["allocator"]] = x["ns"]
    medians = {a: {p: statistics.median(v) for (a2, p), v in ns.items() if a2 == a}
               for a, _ in ns}
    ratios: dict[str, dict[str, float]] = {}
    for a in medians:
        if a == reference:
            continue
        per_pattern: dict[str, list[float]] = {}
        for (_, pattern), got in by_round.items():
            if a in got and reference in got:
                per_pattern.setdefault(pattern, []).append(got[a] / got[reference])
        ratios[a] = {p: statistics.median(v) for p, v in per_pattern.items()}
    geomean = {a: statistics.geometric_mean([r[p] for p in HOTPATH_PATTERNS])
               for a, r in ratios.items() if all(p in r for p in HOTPATH_PATTERNS)}
    return {"median_ns": medians, "ratio_to_" + reference: ratios, "geomean_ratio": geomean}


def child_train(steps: int, fraction_of_peak: float, peak_requested: int,
                model_name: str = "transformer") -> dict:
    torch = setup_in_child()
    from allocator_ext import workloads

    work = workloads.build(model_name, torch.device("cuda"), seed=0)
    if fraction_of_peak and peak_requested:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(fraction_of_peak * peak_requested / total)
    times = []
    oom = None
    for step in range(steps):
        batch = work.draw()
        try:
            times.append(workloads.timed_step(work, batch))
        except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
            oom = f"step {step}: {str(e)[:160]}"
            break
    s = torch.cuda.memory_stats()
    return {
        "steps_done": len(times), "oom": oom,
        "median_step_s": statistics.median(times[5:]) if len(times) > 5 else None,
        # With random shapes, step times spread widely and the median jumps between them with
        # small perturbations; the mean over the same shape sequence is the steadier figure.
        "mean_step_s": statistics.fmean(times[5:]) if len(times) > 5 else None,
        "step_times_s": [round(t, 6) for t in times],
        "peak_reserved": s.get("reserved_bytes.all.peak", 0),
        "peak_allocated": s.get("allocated_bytes.all.peak", 0),
        "peak_requested": s.get("requested_bytes.all.peak", 0),
        "num_alloc_retries": s.get("num_alloc_retries", 0),
        # device calls over the whole run: a step-time gap with few of these is not the driver's
        "num_device_alloc": s.get("num_device_alloc", 0),
        "num_device_free": s.get("num_device_free", 0),
        "num_sync_all_streams": s.get("num_sync_all_streams", 0),
    }


def compare_step_times(runs: list[dict], ours: str) -> dict:
    """Per other allocator: allocwatch's mean step time over its, paired by round (mean of the
    rounds' ratios, and its standard error)."""
    by_round: dict[int, dict[str, float]] = {}
    for run in runs:
        if run.get("mean_step_s"):
            by_round.setdefault(run["round"], {})[run["allocator"]] = run["mean_step_s"]
    out = {}
    others = {a for r in by_round.values() for a in r if a != ours}
    for other in sorted(others):
        ratios = [r[ours] / r[other] for r in by_round.values() if ours in r and other in r]
        if ratios:
            mean, se = mean_and_stderr(ratios)
            out[other] = {"mean_ratio": mean, "stderr": se or 0.0, "pairs": len(ratios)}
    return out


def run_child(kind: str, allocator: str, extra: list[str]) -> dict:
    env = dict(os.environ, **ALLOCATORS[allocator])
    cmd = [sys.executable, "-m", __spec__.name, "--child", kind, *extra]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        return {"error": (out.stderr or out.stdout)[-600:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", nargs="?", choices=["hotpath", "train"])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--model", choices=TRAINED, default="transformer",
                   help="the training workload (train mode)")
    p.add_argument("--fraction-of-peak", type=float, default=0.0)
    p.add_argument("--allocators", default="pytorch,expandable,cudaMallocAsync,allocwatch")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args, _ = p.parse_known_args()
    if args.child:
        kind = args.child[0]
        if kind == "hotpath-server":
            child_hotpath_server()
        else:
            steps, fraction, peak = int(args.child[1]), float(args.child[2]), int(args.child[3])
            model = args.child[4] if len(args.child) > 4 else "transformer"
            print(json.dumps(child_train(steps, fraction, peak, model)))
        return 0

    allocators = args.allocators.split(",")
    results: dict = {"mode": args.mode, "model": args.model, "command": " ".join(sys.argv),
                     "runs": []}
    if args.mode == "hotpath":
        results.update(hotpath_lockstep(["pytorch", "allocwatch", "allocwatch-pluggable"],
                                        args.rounds))
        for a, per in results["median_ns"].items():
            listed = ", ".join(f"{p} {v:.1f}" for p, v in per.items())
            print(f"{a}: median ns a pair: {listed}", flush=True)
        for a, per in results["ratio_to_pytorch"].items():
            listed = ", ".join(f"{p} {v:.3f}" for p, v in per.items())
            print(f"{a} / pytorch, median of {args.rounds} rounds: {listed}; geometric mean "
                  f"over the C++ patterns {results['geomean_ratio'].get(a, float('nan')):.3f}",
                  flush=True)
    else:
        peak = 0
        if args.fraction_of_peak:
            ref = run_child("train", "pytorch", [str(args.steps), "0", "0", args.model])
            peak = int(ref.get("peak_requested", 0))
            results["reference_peak_requested"] = peak
        for r in range(args.rounds):
            # Each round starts with the next allocator, so drift over time spreads evenly.
            for a in allocators[r % len(allocators):] + allocators[:r % len(allocators)]:
                extra = [str(args.steps), str(args.fraction_of_peak), str(peak), args.model]
                res = run_child("train", a, extra)
                results["runs"].append({"allocator": a, "round": r, **res})
                shown = {k: v for k, v in results["runs"][-1].items() if k != "step_times_s"}
                print(json.dumps(shown), flush=True)
        results["compared"] = compare_step_times(results["runs"], "allocwatch")
        for other, c in results["compared"].items():
            print(f"allocwatch vs {other}: mean step time {100 * c['mean_ratio'] - 100:+.2f} % "
                  f"± {100 * c['stderr']:.2f} % over {c['pairs']} rounds", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
