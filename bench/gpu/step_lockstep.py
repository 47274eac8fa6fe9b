"""Step time of allocwatch's allocator against another, two training processes in lockstep.

    python bench/gpu/step_lockstep.py [--model transformer|convnet] [--against expandable]
                                  [--rounds 3] [--steps 40] [--fraction-of-peak F]
                                  [--json FILE]                                    (on a GPU)

Runs of one allocator in separate processes, one after another, differ by 10-25 % on the H200
hosts (bench/gpu/torch_bench.py train): the host and the GPU drift between runs and a process's
placement matters, far more than the effect sought. Here two processes, one per allocator, train
bench/gpu/torch_bench.py's model on the same sequence of random shapes and take turns step by step
on the same GPU and the same CPU cores: step i of one runs right before or after step i of the
other (who goes first alternates), each alone on the device, so both see the same drift and the
same shape. Both first run the whole sequence once untimed (cuBLAS/cuDNN plan selection and
the allocators' growth are not what is compared). Each round uses fresh processes. With
--fraction-of-peak F, each process then caps itself with set_per_process_memory_fraction at F x
the peak requested bytes of that pass, empties its cache, and runs the sequence once more
untimed under the cap before the timed pass; a process that runs out of memory ends the round
and is reported.

Reported per round: allocwatch's total step time over the other's; over all rounds, the mean of
those ratios with its standard error, and the median of the per-step ratios. Also each
allocator's peak reserved / peak requested.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))  # the checkout, for bench.lib
from bench.lib.allocators import ALLOCATORS, setup_in_child  # noqa: E402
from bench.lib.stats import mean_and_stderr  # noqa: E402

TRAINED = ("transformer", "moe", "convnet")  # allocator_ext.workloads' training workloads


def child(model_name: str, steps: int, cores: str, fraction: float) -> None:
    """Answers each 'step' line on stdin with one timed step's seconds; 'stats' with the
    memory statistics; both processes see the same shapes (seeded alike)."""
    if cores:
        os.sched_setaffinity(0, {int(c) for c in cores.split(",")})
    torch = setup_in_child()
    from allocator_ext import workloads

    work = workloads.build(model_name, torch.device("cuda"), seed=0)
    # allocwatch's pluggable path reports running out of memory as a plain RuntimeError;
    # any other error is reported as one, not mistaken for out of memory.
    oom = (torch.cuda.OutOfMemoryError, RuntimeError)

    def failure(e: BaseException) -> str:
        out_of_memory = (isinstance(e, torch.cuda.OutOfMemoryError)
                         or "out of memory" in str(e).lower())
        return f"{'oom' if out_of_memory else 'error'}: {str(e)[:200]!r}"

    def untimed_pass() -> None:
        work.reseed(1)
        for _ in range(steps):
            workloads.timed_step(work, work.draw())

    untimed_pass()
    if fraction:
        peak = torch.cuda.memory_stats()["requested_bytes.all.peak"]
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(fraction * peak / total)
        torch.cuda.reset_peak_memory_stats()
        try:
            untimed_pass()
        except oom as e:
            print(f"{failure(e)} (in the capped untimed pass)", flush=True)
            return
    work.reseed(1)
    warm = torch.cuda.memory_stats()
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "step":
            try:
                print(workloads.timed_step(work, work.draw()), flush=True)
            except oom as e:
                print(failure(e), flush=True)
                return
        elif line.strip() == "stats":
            s = torch.cuda.memory_stats()
            # device calls during the timed pass only: what the allocator still does once the
            # shapes have all been seen
            timed = {k: s.get(k, 0) - warm.get(k, 0)
                     for k in ("num_device_alloc", "num_device_free", "num_sync_all_streams")}
            print(json.dumps({"peak_reserved": s.get("reserved_bytes.all.peak", 0),
                              "peak_requested": s.get("requested_bytes.all.peak", 0),
                              "num_alloc_retries": s.get("num_alloc_retries", 0),
                              "timed_pass": timed}), flush=True)
            return


def spawn(allocator: str, model: str, steps: int, cores: str, fraction: float) -> subprocess.Popen:
    env = dict(os.environ, **ALLOCATORS[allocator])
    return subprocess.Popen([sys.executable, __file__, "--child", model, str(steps), cores,
                             str(fraction)],
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            bufsize=1)


# Longest wait for one answer: the untimed passes (with model set-up and, for the native shim,
# a build) come first; a step of these models takes well under a second.
READY_TIMEOUT_S = 420.0
STEP_TIMEOUT_S = 120.0


class RoundFailed(Exception):
    """A training process ran out of memory, failed, hung or ended; the round is dropped."""


def read_line(proc: subprocess.Popen, name: str, timeout: float) -> str:
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise RoundFailed(f"the {name} process gave no answer within {timeout:.0f} s")
    line = proc.stdout.readline()
    if not line:
        raise RoundFailed(f"the {name} process ended (exit {proc.poll()})")
    line = line.strip()
    if line.startswith(("oom", "error")):
        raise RoundFailed(f"{name}: {line}")
    return line


def ask(proc: subprocess.Popen, name: str, what: str) -> str:
    assert proc.stdin is not None
    try:
        proc.stdin.write(what + "\n")
        proc.stdin.flush()
    except BrokenPipeError:
        raise RoundFailed(f"the {name} process ended (exit {proc.poll()})") from None
    return read_line(proc, name, STEP_TIMEOUT_S)


def finish(proc: subprocess.Popen) -> None:
    """Lets a child end (its stdin closed), killing it if it does not within 30 s."""
    try:
        if proc.stdin:
            proc.stdin.close()
    except BrokenPipeError:
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def one_round(r: int, model: str, against: str, steps: int, cores: str,
              fraction: float) -> dict:
    procs = {a: spawn(a, model, steps, cores, fraction) for a in ("allocwatch", against)}
    try:
        for a, proc in procs.items():  # both warm up at once; timing starts when both are ready
            line = read_line(proc, a, READY_TIMEOUT_S)
            if line != "ready":
                raise RoundFailed(f"the {a} process answered {line[:200]!r} instead of ready")
        times: dict[str, list[float]] = {a: [] for a in procs}
        for i in range(steps):
            order = ["allocwatch", against] if (i + r) % 2 == 0 else [against, "allocwatch"]
            for a in order:
                times[a].append(float(ask(procs[a], a, "step")))
        stats = {a: json.loads(ask(procs[a], a, "stats")) for a in procs}
    finally:
        for proc in procs.values():
            finish(proc)
    ours, other = times["allocwatch"], times[against]
    return {"round": r, "ratio": sum(ours) / sum(other),
            "step_ratios": [a / b for a, b in zip(ours, other, strict=True)],
            "step_times_s": {a: [round(t, 6) for t in ts] for a, ts in times.items()},
            "reserved_over_requested": {a: s["peak_reserved"] / max(1, s["peak_requested"])
                                        for a, s in stats.items()},
            "num_alloc_retries": {a: s["num_alloc_retries"] for a, s in stats.items()},
            "timed_pass_device_calls": {a: s["timed_pass"] for a, s in stats.items()}}


def summarize(rounds: list[dict]) -> dict:
    mean, se = mean_and_stderr([r["ratio"] for r in rounds])
    steps = [x for r in rounds for x in r["step_ratios"]]
    return {"mean_ratio": mean, "stderr": se,
            "median_step_ratio": statistics.median(steps), "steps_compared": len(steps)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=TRAINED, default="transformer")
    p.add_argument("--against", choices=sorted(set(ALLOCATORS) - {"allocwatch"}),
                   default="expandable", help="the allocator compared with allocwatch's")
    p.add_argument("--rounds", type=int, default=3, help="pairs of fresh processes")
    p.add_argument("--steps", type=int, default=40, help="timed steps per process and round")
    p.add_argument("--cores", default="",
                   help="CPU cores both processes run on, e.g. 2,3,4,5 (default: the first "
                        "four this process may use)")
    p.add_argument("--fraction-of-peak", type=float, default=0.0, metavar="F",
                   help="cap each process at F x its peak requested bytes (e.g. 1.03)")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), args.child[2], float(args.child[3]))
        return 0
    if args.fraction_of_peak and args.fraction_of_peak < 1.0:
        p.error(f"--fraction-of-peak must be at least 1.0 (the workload's own need), got "
                f"{args.fraction_of_peak}")
    if args.rounds < 1 or args.steps < 1:
        p.error("--rounds and --steps must be at least 1")
    if args.fraction_of_peak and args.against == "cudaMallocAsync":
        p.error("--fraction-of-peak needs requested bytes, which cudaMallocAsync does not count")
    cores = args.cores or ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[:4])
    rounds = []
    failures = []
    for r in range(args.rounds):
        try:
            rounds.append(one_round(r, args.model, args.against, args.steps, cores,
                                    args.fraction_of_peak))
        except RoundFailed as e:
            failures.append({"round": r, "failure": str(e)})
            print(f"round {r}: {e}", flush=True)
            write_json(args, cores, rounds, failures)
            continue
        write_json(args, cores, rounds, failures)
        rr = rounds[-1]
        print(f"round {r}: allocwatch / {args.against} total step time {rr['ratio']:.4f}; "
              f"reserved/requested "
              + ", ".join(f"{a} {v:.3f}" for a, v in rr["reserved_over_requested"].items())
              + "; device calls while timed "
              + ", ".join(f"{a} {c}" for a, c in rr["timed_pass_device_calls"].items()),
              flush=True)
    summary = summarize(rounds) if rounds else {}
    if rounds:
        se = summary["stderr"]
        print(f"allocwatch vs {args.against} ({args.model}): step time "
              f"{100 * summary['mean_ratio'] - 100:+.2f} %"
              + (f" ± {100 * se:.2f} % (standard error over {len(rounds)} rounds)" if se else "")
              + f"; median per-step ratio {summary['median_step_ratio']:.4f} over "
                f"{summary['steps_compared']} steps", flush=True)
    write_json(args, cores, rounds, failures)
    return 0 if rounds and not failures else 1


def write_json(args: argparse.Namespace, cores: str, rounds: list[dict],
               failures: list[dict]) -> None:
    """Written after every round, so that a later failure loses nothing measured."""
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"command": " ".join(sys.argv), "model": args.model, "against": args.against,
             "cores": cores, "fraction_of_peak": args.fraction_of_peak,
             **(summarize(rounds) if rounds else {}), "rounds": rounds,
             "failures": failures}, indent=1))

if __name__ == "__main__":
    sys.exit(main())
