"""Distributed training under allocwatch: the transformer with random shapes trained under
DistributedDataParallel and under FSDP (fully_shard), one process per GPU, launched by
`allocwatch run -- torchrun` with a sidecar beside it, under PyTorch's default allocator, its
expandable segments and allocwatch's allocator.

    python -m bench.gpu.distributed_train --nproc 8 --json OUT.json               (GPUs, NCCL)
    python -m bench.gpu.distributed_train --nproc 1 --steps 20 --json OUT.json    (one GPU)
    python -m bench.gpu.distributed_train --nproc 2 --backend gloo --device cpu --json OUT.json

For each mode (ddp, fsdp), round (--repeats, the allocators' order rotating from round to
round) and allocator, the driver starts a sidecar and then

    allocwatch run [--keep-pytorch-allocator] --target SIDECAR -- \\
        torchrun --standalone --nproc-per-node N distributed_train.py --worker ...

(torchrun as `python -m torch.distributed.run`, the interpreter running this script), and
after the launch reads back from /metrics each rank's own series (labels rank, local_rank,
cuda_device, gpu_uuid; gpu_uuid joined to the NVML series of the same GPU). In the first
round's allocwatch launch it sends a reclaim by selector to the last rank alone (`allocwatch
ctl --rank N-1 reclaim --all`) and checks that only that rank counted an empty_cache.

Each rank trains allocator_ext.workloads' transformer (the same weights in every rank; shapes
from a generator seeded by its rank, so ranks differ, as their batches do). Each step starts
on a barrier and its time is the slowest rank's (an all-reduce of the ranks' times, each from
a synchronised start to a synchronised end): the step, in lockstep. Per rank: peak reserved ÷
peak requested bytes, device calls, retries and OOMs. Reported per mode: each allocator's
median step, allocwatch's median over expandable segments' and the worst rank's reserved ratio
of each, with median and spread over the rounds.

--nccl-register-hook sets TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1 in every rank
(docs/torch.md, "NCCL buffer registration"); each rank reports the value its process group
read (allocwatch's install() switches it off under paged segments). --allocators
allocwatch-plain adds allocwatch with expandable_segments:False, where the hook stays on.

--backend gloo --device cpu runs the same on the CPU (2 ranks here; torch CPU builds too).
PyTorch's CPU allocator keeps no statistics, so each rank mirrors its tensor storages into
allocwatch's core on the simulated device (bench/lib/storage_mirror.py) under the settings
standing for each allocator (pytorch: `native`, expandable: `native,expandable_segments:True`,
allocwatch: its defaults), and its agent publishes that core: the rank's real requests under
the core's rules. It checks the launch, the per-rank series and the selector, not GPU figures.
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
from typing import Any

from bench.lib.allocators import ALLOCATORS, Counters
from bench.lib.sidecar_process import SidecarProcess, scrape

SIDES = ("pytorch", "expandable", "allocwatch")
# allocwatch without paged segments: where NCCL's registration hook stays on (docs/torch.md).
PLAIN = "allocwatch-plain"
PLAIN_CONFIG = "expandable_segments:False"
MODES = ("ddp", "fsdp")
# On the CPU, the core's settings that stand for each allocator.
SIM_CONFIG = {"pytorch": "native", "expandable": "native,expandable_segments:True",
              "allocwatch": None, PLAIN: PLAIN_CONFIG}
SHAPE_SEED = 1000  # rank r draws its shapes from SHAPE_SEED + r, the same in every launch
STATS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_ooms")
NCCL_REGISTER_HOOK = "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK"


# ------------------------------------------------------------------------------- the worker

def wrapper(mode: str, device: Any, local_rank: int, world_size: int) -> Any:
    """What puts the model under DDP or FSDP (each transformer block sharded, then the rest)."""
    from torch.nn.parallel import DistributedDataParallel

    if mode == "ddp":
        ids = [local_rank] if device.type == "cuda" else None
        return lambda model: DistributedDataParallel(model, device_ids=ids)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world_size,))

    def shard(model: Any) -> Any:
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    return shard


def worker(args: argparse.Namespace) -> int:
    import contextlib

    import torch
    import torch.distributed as dist

    import allocator_ext
    from allocator_ext import workloads

    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    cuda = args.device == "cuda"
    mirror: Any = contextlib.nullcontext()
    core = None
    if cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        # A launch that did not install what it compares would compare the wrong thing.
        assert allocator_ext.installed() == args.allocator.startswith("allocwatch"), \
            f"allocwatch installed: {allocator_ext.installed()}, allocator {args.allocator}"
        dist.init_process_group(args.backend, device_id=device)
    else:
        from allocator_ext.agent import start_agent
        from bench.lib.storage_mirror import StorageMirror

        device = torch.device("cpu")
        core = allocator_ext.Allocator(allocator_ext.SimDevice(), SIM_CONFIG[args.allocator])
        mirror = StorageMirror(core)
        if args.publish:
            start_agent(args.publish, interval=args.interval, source=core, nvml=False)
        dist.init_process_group(args.backend)
    own: list[float] = []
    slowest: list[float] = []
    with mirror:
        work = workloads.build("transformer", device, tiny=not cuda, seed=0)
        work.wrap(wrapper(args.mode, device, local_rank, world_size))
        work.reseed(SHAPE_SEED + rank)
        counters = Counters(torch, local_rank, core)
        for step in range(args.warmup + args.steps):
            batch = work.draw()
            dist.barrier()
            seconds = workloads.timed_step(work, batch)
            times = torch.tensor([seconds], dtype=torch.float64, device=device)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            if step >= args.warmup:
                own.append(seconds)
                slowest.append(float(times.item()))
        stats = counters.stats()
    time.sleep(args.linger)  # the agent keeps publishing: a command or a scrape still reaches it
    dist.barrier()
    dist.destroy_process_group()
    requested = stats.get("requested_bytes.all.peak", 0)
    reserved = stats.get("reserved_bytes.all.peak", 0)
    result = {"rank": rank, "local_rank": local_rank, "world_size": world_size,
              "mode": args.mode, "allocator": args.allocator, "backend": args.backend,
              "device": str(device), "allocwatch_installed": allocator_ext.installed(),
              # As the process group read it: install() may have switched it off.
              "nccl_register_hook": os.environ.get(NCCL_REGISTER_HOOK, ""),
              "own_step_s": own, "step_s": slowest,
              "peak_reserved_bytes": reserved, "peak_requested_bytes": requested,
              "reserved_ratio": reserved / requested if requested else None,
              **{key: stats.get(key, 0) for key in STATS}}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(result))
    return 0


# ------------------------------------------------------------------------------- the driver

def launch_command(*, nproc: int, mode: str, allocator: str, target: str, out: Path,
                   backend: str = "nccl", device: str = "cuda", steps: int = 30,
                   warmup: int = 3, interval: float = 1.0, linger: float = 0.0) -> list[str]:
    """`allocwatch run -- torchrun ... --worker ...` for one launch. On the GPU the agent that
    `allocwatch run` starts in every rank publishes to `target`; on the CPU (no CUDA allocator
    to install or read) each rank publishes its simulated core there itself."""
    run = [sys.executable, "-m", "exporter.cli", "run"]
    worker_args = ["--worker", "--mode", mode, "--allocator", allocator, "--out", str(out),
                   "--backend", backend, "--device", device, "--steps", str(steps),
                   "--warmup", str(warmup), "--interval", str(interval),
                   "--linger", str(linger)]
    if device == "cuda":
        run += ["--target", target]
        if not allocator.startswith("allocwatch"):
            run.append("--keep-pytorch-allocator")
    else:
        worker_args += ["--publish", target]
    return [*run, "--", sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), "-m", __spec__.name, *worker_args]


def launch_environment(allocator: str, job: str, interval: float,
                       nccl_register_hook: bool = False) -> dict[str, str]:
    pytorch_conf = ALLOCATORS["allocwatch" if allocator == PLAIN else allocator]
    env = dict(os.environ, ALLOCWATCH_TRAINING_JOB=job, ALLOCWATCH_INTERVAL=str(interval),
               PYTORCH_CUDA_ALLOC_CONF=pytorch_conf["PYTORCH_CUDA_ALLOC_CONF"])
    env.pop("ALLOCWATCH_TARGET", None)  # the launch's own sidecar only
    env.pop("ALLOCWATCH_ALLOC_CONF", None)
    if allocator == PLAIN:
        env["ALLOCWATCH_ALLOC_CONF"] = PLAIN_CONFIG
    if nccl_register_hook:
        env[NCCL_REGISTER_HOOK] = "1"
    return env


def rank_series(url: str) -> dict[str, dict[str, Any]]:
    """Each rank's own series on /metrics (all pools): {rank: {labels, series, nvml_joined}}."""
    samples = scrape(url) or []
    nvml_uuids = {ls.get("gpu_uuid") for name, ls, _ in samples
                  if name == "allocwatch_gpu_memory_total_bytes"}
    ranks: dict[str, dict[str, Any]] = {}
    for name, labels, value in samples:
        if not name.startswith("torch_cuda_allocator_") or "pool" in labels \
                or not labels.get("rank"):
            continue
        entry = ranks.setdefault(labels["rank"], {"labels": {}, "series": {}})
        if name != "torch_cuda_allocator_info":
            entry["labels"] = {k: labels.get(k, "") for k in
                               ("rank", "local_rank", "cuda_device", "gpu_uuid")}
        entry["series"][name] = value
    for entry in ranks.values():
        uuid = entry["labels"].get("gpu_uuid")
        entry["nvml_joined"] = bool(uuid) and uuid in nvml_uuids
    return ranks


def wait_for_ranks(url: str, nproc: int, timeout: float,
                   alive: Any = lambda: True) -> dict[str, dict[str, Any]]:
    """The ranks' series once all `nproc` ranks publish allocations (or what there is when
    `timeout` passes or the launch ends)."""
    deadline = time.monotonic() + timeout
    found: dict[str, dict[str, Any]] = {}
    while time.monotonic() < deadline and alive():
        found = rank_series(url)
        if len(found) == nproc and all(
                r["series"].get("torch_cuda_allocator_allocations_total", 0) > 0
                for r in found.values()):
            break
        time.sleep(0.3)
    return found


def reclaim_one_rank(sidecar: SidecarProcess, rank: int) -> dict[str, Any]:
    """`allocwatch ctl --rank R reclaim --all` through the sidecar's admin socket."""
    admin = f"unix://{sidecar.socket.parent / 'admin.sock'}"
    out = subprocess.run([sys.executable, "-m", "exporter.cli", "ctl", "--admin", admin,
                          "--rank", str(rank), "--json", "reclaim", "--all"],
                         capture_output=True, text=True, timeout=60)
    return {"rank": rank, "exit": out.returncode, "answer": out.stdout.strip()[-2000:]}


def launch(args: argparse.Namespace, mode: str, allocator: str, round_no: int,
           probe_selector: bool) -> dict[str, Any]:
    folder = Path(args.out_dir) / f"{mode}-{allocator}-{round_no}"
    sidecar = SidecarProcess("allocwatch-dist-", agents_yaml="  expiry_seconds: 600\n").start()
    probe: dict[str, Any] | None = None
    try:
        cmd = launch_command(nproc=args.nproc, mode=mode, allocator=allocator,
                             target=sidecar.target, out=folder, backend=args.backend,
                             device=args.device, steps=args.steps, warmup=args.warmup,
                             interval=args.interval, linger=2.5 * args.interval)
        env = launch_environment(allocator, f"{mode}-{allocator}", args.interval,
                                 args.nccl_register_hook)
        started = time.monotonic()
        child = subprocess.Popen(cmd, env=env)
        if probe_selector:
            wait_for_ranks(sidecar.metrics_url, args.nproc, args.timeout,
                           alive=lambda: child.poll() is None)
            probe = reclaim_one_rank(sidecar, args.nproc - 1)
        try:
            exit_code = child.wait(args.timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            exit_code = child.wait()
        seconds = time.monotonic() - started
        time.sleep(1.5 * args.interval)  # the ranks' last reports
        series = rank_series(sidecar.metrics_url)
    finally:
        sidecar.stop()
    ranks = [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))]
    result: dict[str, Any] = {
        "mode": mode, "allocator": allocator, "round": round_no, "exit": exit_code,
        "launch_seconds": round(seconds, 1), "command": cmd, "ranks": ranks, "series": series,
        "every_rank_completed": exit_code == 0 and len(ranks) == args.nproc,
        "every_rank_on_metrics": sorted(series) == sorted(str(r) for r in range(args.nproc))}
    if ranks:
        result["step_median_s"] = statistics.median(ranks[0]["step_s"])
        result["worst_reserved_ratio"] = max(r["reserved_ratio"] or 0.0 for r in ranks)
    if probe is not None:
        calls = {rank: entry["series"].get("torch_cuda_allocator_empty_cache_calls_total", 0)
                 for rank, entry in series.items()}
        probe["empty_cache_calls_by_rank"] = calls
        probe["reached_that_rank_only"] = (probe["exit"] == 0 and calls.get(
            str(probe["rank"]), 0) >= 1 and all(v == 0 for r, v in calls.items()
                                              if r != str(probe["rank"])))
        result["selector_probe"] = probe
    return result


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(runs: list[dict[str, Any]], modes: list[str], sides: list[str]
              ) -> dict[str, Any]:
    """Per mode: each allocator's median step and worst rank's reserved ratio over the rounds,
    and allocwatch's over expandable segments' round by round."""
    summary: dict[str, Any] = {}
    for mode in modes:
        per: dict[str, Any] = {}
        for side in sides:
            done = [r for r in runs if r["mode"] == mode and r["allocator"] == side
                    and r["every_rank_completed"]]
            if done:
                per[side] = {"step_median_s": spread([r["step_median_s"] for r in done]),
                             "worst_reserved_ratio": spread([r["worst_reserved_ratio"]
                                                             for r in done])}
        ratios = []
        for ours in (r for r in runs if r["mode"] == mode and r["allocator"] == "allocwatch"):
            peer = [r for r in runs if r["mode"] == mode and r["allocator"] == "expandable"
                    and r["round"] == ours["round"]]
            if peer and ours["every_rank_completed"] and peer[0]["every_rank_completed"]:
                ratios.append(ours["step_median_s"] / peer[0]["step_median_s"])
        if ratios:
            per["allocwatch_over_expandable_step"] = spread(ratios)
        summary[mode] = per
    return summary


def driver(args: argparse.Namespace) -> int:
    modes = args.modes.split(",")
    sides = args.allocators.split(",")
    for name, given, known in (("mode", modes, MODES), ("allocator", sides, (*SIDES, PLAIN))):
        unknown = [g for g in given if g not in known]
        if unknown:
            print(f"distributed_train: unknown {name} {', '.join(unknown)} "
                  f"(known: {', '.join(known)})", file=sys.stderr)
            return 2
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    runs = []
    for round_no in range(args.repeats):
        order = sides[round_no % len(sides):] + sides[:round_no % len(sides)]
        for mode in modes:
            for side in order:
                probe = round_no == 0 and side == "allocwatch"
                runs.append(launch(args, mode, side, round_no, probe))
                brief = {k: v for k, v in runs[-1].items()
                         if k not in ("ranks", "series", "command")}
                print(json.dumps(brief), flush=True)
    result = {"command": " ".join(sys.argv), "nproc": args.nproc, "backend": args.backend,
              "device": args.device, "steps": args.steps, "warmup": args.warmup,
              "nccl_register_hook": args.nccl_register_hook,
              "summary": summarize(runs, modes, sides), "runs": runs}
    print(json.dumps(result["summary"], indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    ok = all(r["every_rank_completed"] and r["every_rank_on_metrics"]
             and r.get("selector_probe", {}).get("reached_that_rank_only", True) for r in runs)
    return 0 if ok else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="ranks (GPUs) per launch (default 2)")
    p.add_argument("--modes", default=",".join(MODES), help="ddp,fsdp (default: both)")
    p.add_argument("--allocators", default=",".join(SIDES),
                   help="pytorch,expandable,allocwatch (default: these three); "
                        f"{PLAIN}: allocwatch with {PLAIN_CONFIG}")
    p.add_argument("--steps", type=int, default=30, help="timed steps per launch")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--repeats", type=int, default=1, help="rounds of every launch")
    p.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--interval", type=float, default=1.0, help="agent report interval (s)")
    p.add_argument("--timeout", type=float, default=480.0, help="seconds per launch at most")
    p.add_argument("--nccl-register-hook", action="store_true",
                   help="TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1 in every rank")
    p.add_argument("--out-dir", default="distributed_train_out",
                   help="where the ranks write their figures")
    p.add_argument("--json", metavar="FILE")
    worker_only = p.add_argument_group("one rank (started by torchrun)")
    worker_only.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    worker_only.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    worker_only.add_argument("--allocator", choices=(*SIDES, PLAIN), help=argparse.SUPPRESS)
    worker_only.add_argument("--out", help=argparse.SUPPRESS)
    worker_only.add_argument("--publish", help=argparse.SUPPRESS)
    worker_only.add_argument("--linger", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.backend == "nccl" and args.device == "cpu":
        p.error("NCCL needs --device cuda; on the CPU use --backend gloo")
    if args.nproc < 1 or args.steps < 1 or args.repeats < 1:
        p.error("--nproc, --steps and --repeats must be at least 1")
    return worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    sys.exit(main())
