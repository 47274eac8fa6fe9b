"""Where a training step's host time goes under two allocators, operator by operator.

    python -m bench.gpu.host_profile [--model convnet] [--ours allocwatch]
                                     [--against allocwatch-pluggable] [--reps 2] [--steps 12]
                                     [--cores 2] [--fresh] [--json FILE]          (on a GPU)
    python -m bench.gpu.host_profile --self-check [--fresh] [--json FILE]         (on the CPU)

step_lockstep.py says whether one allocator's steps are slower; this says where the host spends
the difference. Each allocator runs in fresh processes, --reps of each, alternating (ours,
theirs, ours, ...), each on the same CPU core (--cores). A process warms up as the lockstep
harness does (the workload's largest shapes, then --steps steps of a fixed seed), times
--steps steps, and then profiles --steps steps with torch.profiler (CPU activity only: the
host's own time, which is what these host-bound steps wait on), and --steps more with its
device activity alone: the kernels' and copies' own time, which the host's pace does not move.
The steps of each phase are the warm-up's again (cuDNN's plans and the allocator's layout
already made), or with --fresh shapes drawn afresh, a seed of its own per phase, the same in
every process: what step_lockstep.py times, where cuDNN plans every new shape on the host.

Reported: per allocator the median step time, the allocations a step makes (the allocator's
allocation.all.allocated count), the device's time a step and what one cudaMemGetInfo costs
with the allocator's memory in place; per operator the self CPU time summed over the profiled
steps, averaged over the reps, with the ops whose time differs most between the two; per
kernel its device time, largest difference first (a kernel under one allocator only is an
algorithm chosen there). Profiled runs are slower than plain ones and runs in separate
processes differ by several percent, so read the differences beside those of --ours and
--against the same allocator.

--self-check runs the protocol on the CPU with a tiny workload under PyTorch's allocator on both
sides: it checks the plumbing, not the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from bench.lib.allocators import ALLOCATORS, Counters, setup_in_child

WARMUP_SEED = 1
FRESH_SEED = 1000  # --fresh: the phases' seeds, never the warm-up's
SHOWN_OPS = 12  # the ops shown at each end of the ordering by difference


def child(model: str, steps: int, cores: str, self_check: bool, fresh: bool) -> dict[str, Any]:
    if cores:
        os.sched_setaffinity(0, {int(c) for c in cores.split(",")})
    torch = setup_in_child()
    from torch.profiler import ProfilerActivity, profile

    from allocator_ext import workloads

    device = torch.device("cpu" if self_check else "cuda")
    work = workloads.build(model, device, tiny=self_check, seed=0)
    warmup_shapes = workloads.warm_up(work, steps, WARMUP_SEED)
    # The seed of each phase: the warm-up's own again, or with --fresh one of its own per
    # phase, never the warm-up's (the same in every process).
    seeds = ([FRESH_SEED, FRESH_SEED + 1, FRESH_SEED + 2] if fresh else [WARMUP_SEED] * 3)

    counters = Counters(torch)
    before = counters.stats()
    work.reseed(seeds[0])
    plain, shapes = [], []
    for _ in range(steps):
        batch = work.draw()
        shapes.append(workloads.batch_shape(batch))
        plain.append(workloads.timed_step_and_enqueue(work, batch))
    after = counters.stats()

    work.reseed(seeds[1])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            workloads.timed_step(work, work.draw())
    ops = {e.key: {"count": e.count, "self_cpu_us": e.self_cpu_time_total}
           for e in prof.key_averages()}
    allocated = after.get("allocation.all.allocated", 0) - before.get("allocation.all.allocated", 0)
    kernels = device_time(work, steps, seeds[2])
    return {"step_s": [s for s, _ in plain], "enqueue_s": [q for _, q in plain],
            "allocations_per_step": allocated / steps, "ops": ops, "kernels": kernels,
            "kernel_us_per_step": sum(k["device_us"] for k in kernels.values()) / steps,
            "mem_get_info_us": mem_get_info_us(torch, device),
            "warmup_shapes": warmup_shapes, "timed_shapes": shapes}


def mem_get_info_us(torch: Any, device: Any) -> float:
    """The median time of one cudaMemGetInfo in this process, in us, with the allocator's
    memory in place: PyTorch's cuDNN convolutions ask for it (through the allocator's
    cacheInfo) for every shape they plan, so a driver whose call grows with the process's
    mappings would show here. 0 on the CPU."""
    if device.type != "cuda":
        return 0.0
    times = []
    for _ in range(200):
        started = time.perf_counter()
        torch.cuda.mem_get_info(device)
        times.append(time.perf_counter() - started)
    return 1e6 * statistics.median(times)


def device_time(work: Any, steps: int, seed: int) -> dict[str, dict[str, float]]:
    """The device's own time over `steps` steps of `seed`'s shapes, per kernel or copy (its
    count and its duration in us, as the profiler's device activity records it). Unlike a
    step's wall time it does not move with the host's pace, so an allocator whose memory
    layout made kernels slower (their pages, their addresses) shows in the durations, and one
    that made cuDNN choose other algorithms (through the workspace it could get) in the
    names. Empty on the CPU."""
    from torch.profiler import ProfilerActivity, profile

    from allocator_ext import workloads

    if work.device.type != "cuda":
        return {}
    work.reseed(seed)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            workloads.timed_step(work, work.draw())
    kernels = {}
    for e in prof.key_averages():
        us = float(getattr(e, "self_device_time_total", 0.0))
        if us > 0:
            kernels[e.key] = {"count": e.count, "device_us": us}
    return kernels


def run_child(allocator: str, args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ, **ALLOCATORS[allocator])
    command = [sys.executable, "-m", __spec__.name, "--child", "--model", args.model, "--steps",
               str(args.steps), "--cores", args.cores]
    if args.self_check:
        command.append("--self-check")
    if args.fresh:
        command.append("--fresh")
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise SystemExit(f"host_profile: the {allocator} process failed:\n"
                         f"{(out.stderr or out.stdout)[-1500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def mean_over_reps(runs: list[dict[str, Any]], table: str, key: str, field: str) -> float:
    """The mean over one allocator's processes of `field` of `key` in their `table` ("ops" or
    "kernels"); 0 in a process where `key` did not occur."""
    return statistics.mean(r[table].get(key, {}).get(field, 0.0) for r in runs)


def compare(runs: dict[str, list[dict[str, Any]]], ours: str, against: str) -> dict[str, Any]:
    """Per op the mean over reps of its self CPU time under each allocator; their totals."""
    def mean_us(name: str, op: str) -> float:
        return mean_over_reps(runs[name], "ops", op, "self_cpu_us")

    names = sorted({op for r in runs[ours] + runs[against] for op in r["ops"]})
    rows = [{"op": op, "ours_us": mean_us(ours, op), "against_us": mean_us(against, op),
             "count": runs[ours][0]["ops"].get(op, {}).get("count", 0)} for op in names]
    for row in rows:
        row["difference_us"] = row["ours_us"] - row["against_us"]
    rows.sort(key=lambda row: row["difference_us"])
    ours_total = sum(row["ours_us"] for row in rows)
    against_total = sum(row["against_us"] for row in rows)
    return {"ops": rows, "self_cpu_us_total": {ours: ours_total, against: against_total},
            "self_cpu_ratio": ours_total / against_total if against_total else float("nan")}


def compare_kernels(runs: dict[str, list[dict[str, Any]]], ours: str,
                    against: str) -> list[dict[str, Any]]:
    """Per kernel the mean over reps of its device time under each allocator, largest
    difference first: a kernel run under one allocator only is an algorithm chosen there."""
    def mean(name: str, kernel: str, field: str) -> float:
        return mean_over_reps(runs[name], "kernels", kernel, field)

    names = {k for r in runs[ours] + runs[against] for k in r["kernels"]}
    rows = [{"kernel": k, "ours_us": mean(ours, k, "device_us"),
             "against_us": mean(against, k, "device_us"), "ours_count": mean(ours, k, "count"),
             "against_count": mean(against, k, "count")} for k in names]
    for row in rows:
        row["difference_us"] = row["ours_us"] - row["against_us"]
    rows.sort(key=lambda row: -abs(row["difference_us"]))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("transformer", "moe", "convnet"), default="convnet")
    p.add_argument("--ours", choices=sorted(ALLOCATORS), default="allocwatch")
    p.add_argument("--against", choices=sorted(ALLOCATORS), default="allocwatch-pluggable")
    p.add_argument("--reps", type=int, default=2, help="processes per allocator (default 2)")
    p.add_argument("--steps", type=int, default=12, help="steps warmed, timed and profiled")
    p.add_argument("--cores", default="2", help="the CPU core(s) every process runs on")
    p.add_argument("--fresh", action="store_true",
                   help="time and profile shapes drawn afresh, not the warm-up's again (as "
                        "step_lockstep.py times them: cuDNN plans each new shape)")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--self-check", action="store_true")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.reps < 1 or args.steps < 1:
        p.error("--reps and --steps must be at least 1")
    if args.self_check:
        args.ours = args.against = "pytorch"
        args.cores = ""
    if args.child:
        print(json.dumps(child(args.model, args.steps, args.cores, args.self_check,
                               args.fresh)))
        return 0

    labels = [args.ours, args.against if args.against != args.ours else f"{args.against} (second)"]
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in labels}
    for rep in range(args.reps):
        for label, allocator in zip(labels, (args.ours, args.against), strict=True):
            result = run_child(allocator, args)
            runs[label].append(result)
            print(f"{label}, process {rep + 1}: median step "
                  f"{1e3 * statistics.median(result['step_s']):.2f} ms, "
                  f"{result['allocations_per_step']:.0f} allocations a step", flush=True)
    compared = compare(runs, *labels)
    kernel = {label: statistics.mean(r["kernel_us_per_step"] for r in runs[label])
              for label in labels}
    compared["kernel_us_per_step"] = kernel
    compared["kernels"] = compare_kernels(runs, *labels)
    calls = {label: statistics.mean(r["mem_get_info_us"] for r in runs[label]) for label in labels}
    compared["mem_get_info_us"] = calls
    print(f"self CPU time over {args.steps} profiled steps, {labels[0]} / {labels[1]}: "
          f"{compared['self_cpu_ratio']:.3f}")
    if kernel[labels[1]]:  # on a GPU
        print(f"one cudaMemGetInfo: {calls[labels[0]]:.1f} us against {calls[labels[1]]:.1f} us")
        print(f"device time a step (kernels and copies), {labels[0]} / {labels[1]}: "
              f"{kernel[labels[0]] / kernel[labels[1]]:.4f} ({kernel[labels[0]]:.0f} against "
              f"{kernel[labels[1]]:.0f} us)")
        for row in compared["kernels"][:SHOWN_OPS]:
            print(f"  {row['difference_us']:+9.0f} us  {row['kernel'][:60]:60s} "
                  f"x{row['ours_count']:.0f}/{row['against_count']:.0f}  "
                  f"({row['ours_us']:.0f} against {row['against_us']:.0f})")
    ops = compared["ops"]
    shown = ops if len(ops) <= 2 * SHOWN_OPS else ops[:SHOWN_OPS] + ops[-SHOWN_OPS:]
    for row in shown:
        print(f"  {row['difference_us']:+9.0f} us  {row['op'][:60]:60s} x{row['count']}  "
              f"({row['ours_us']:.0f} against {row['against_us']:.0f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "model": args.model, "labels": labels,
                       "runs": runs, **compared}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
