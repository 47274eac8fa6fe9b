"""Step time of allocwatch's allocator against another, two training processes in lockstep, on
shapes neither has seen.

    python -m bench.gpu.step_lockstep [--model transformer|moe|convnet] [--against expandable]
                                      [--ours allocwatch] [--fixed-shapes]
                                      [--rounds 8] [--steps 12] [--fraction-of-peak F]
                                      [--json FILE]                               (on a GPU)
    python -m bench.gpu.step_lockstep --suite DIR [--rounds 8] [--steps 12]       (on a GPU)
        every workload (transformer, moe, convnet), uncapped and then under a 1.03 x memory
        fraction, against expandable segments: DIR/lockstep_<workload>.json each

Runs of one allocator in separate processes, one after another, differ by far more than the
effect sought: the host and the GPU drift between runs. Here two
processes, one per allocator, train the same allocator_ext.workloads workload and take turns
step by step on the same GPU and the same CPU core: step i of one runs right before or after
step i of the other (who goes first alternates), each alone on the device, so both see the
same drift and the same shapes. One core, not several: these steps are bound by the host
(cuDNN's plans for each new shape, the MoE's routing), and on several shared cores the
scheduler places each process on cores of different speed for seconds at a time, which moves
the same allocator against itself (--ours and --against alike) far more than one core does.
The parent runs on the other cores.

Each process first warms up untimed: two steps at the workload's largest shapes (the second with
the optimizer's state in place), then --steps steps of the warm-up sequence (cuBLAS/cuDNN plans,
the allocators' first growth). Then come --rounds timed rounds, each --steps steps of shapes
drawn afresh from a seed of its own, the same seed in both processes and never the warm-up's:
what a training run with random shapes sees, where a step's exact shapes rarely come back. With
--fraction-of-peak F (and in the suite's second half) each process then caps itself with
set_per_process_memory_fraction at F x the most bytes it has requested at once so far (its
warm-up, which met the largest shapes, and in the suite the uncapped rounds, whose shapes the capped
rounds draw again), empties its cache, warms up again under the cap, and times the rounds;
running out of memory is reported.

Reported per round: allocwatch's total step time over the other's; over all rounds the mean of
those ratios with its standard error and the median of the per-step ratios (the bar: <= 1.00).
Per step, each allocator's device calls (its num_device_alloc / num_device_free /
num_sync_all_streams: for allocwatch its core's counts, maps and unmaps with expandable
segments; for PyTorch torch.cuda.memory_stats()'s), and the median step ratio over the steps
where allocwatch made device calls against those where it made none: where page moves cost
step time, these say so. Per step also the time until the host had queued the whole step:
its median share of the step shows whether the workload is bound by the host (where the
allocator's own calls count) or by the device, and the median of ours over the other's
queuing time whether our host side is slower; per step and side also what the process took
from the host (getrusage: CPU time in user space and in the kernel, page faults, context
switches), whose medians say where a slower process loses its time. Also each allocator's
peak reserved / peak requested, and its allocation retries and out-of-memory errors since its
process started (those its code caught and went on from count too: cuDNN then tries a smaller
workspace or another plan, at a cost on the host).

--ours picks the allocator judged (default allocwatch's); --ours and --against the same
allocator check the harness itself, whose ratio should then be 1.00 within the spread.

--fixed-shapes runs every step, warm-up and rounds alike, at the workload's largest shapes, as
a job with a fixed batch and sequence length or image size trains: its steps repeat exactly
(the MoE's routing aside), and an allocator whose layout moves pages in every repetition pays
for it in every step.

--self-check runs the same protocol on the CPU with tiny workloads (two processes under
PyTorch's allocator, no GPU): it checks the plumbing and that the timed shapes are fresh and
the same in both processes, not the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import selectors
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from allocator_ext.protocol.files import write_whole
from bench.lib import source_tree
from bench.lib.allocators import ALLOCATORS, Counters, setup_in_child
from bench.lib.stats import mean_and_stderr

TRAINED = ("transformer", "moe", "convnet")  # allocator_ext.workloads' training workloads
SUITE_FRACTION = 1.03
WARMUP_SEED = 1
ROUND_SEED = 1000  # round r draws from seed ROUND_SEED + r: never the warm-up's
CALLS = ("num_device_alloc", "num_device_free", "num_sync_all_streams")
# What the process's threads took from the host during a step (getrusage, all threads): CPU
# time in user space and in the kernel (the driver's ioctls, page faults), page faults, and
# how often a thread was switched out, of its own accord or preempted. Their sum of CPU time is
# exact; Linux splits it between user and kernel by sampling at the timer tick, so the split
# of one step is coarse.
USAGE = ("user_s", "system_s", "minor_faults", "voluntary_switches", "involuntary_switches")


def usage() -> dict[str, float]:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return dict(zip(USAGE, (u.ru_utime, u.ru_stime, u.ru_minflt, u.ru_nvcsw, u.ru_nivcsw),
                    strict=True))


# ------------------------------------------------------------------------------- the child

def child(model_name: str, steps: int, cores: str, self_check: bool,
          fixed_shapes: bool = False) -> None:
    """Answers one line per command on stdin: 'cap F', 'seed N', 'step', 'stats'."""
    if cores:
        os.sched_setaffinity(0, {int(c) for c in cores.split(",")})
    torch = setup_in_child()
    from allocator_ext import workloads

    device = torch.device("cpu" if self_check else "cuda")
    work = workloads.build(model_name, device, tiny=self_check, seed=0,
                           fixed_shapes=fixed_shapes)
    counters = Counters(torch)
    warmup_shapes: list = []
    # allocwatch's pluggable path reports running out of memory as a plain RuntimeError;
    # any other error is reported as one, not mistaken for out of memory.
    oom = (torch.cuda.OutOfMemoryError, RuntimeError)

    def failure(e: BaseException) -> str:
        out_of_memory = (isinstance(e, torch.cuda.OutOfMemoryError)
                         or "out of memory" in str(e).lower())
        return f"{'oom' if out_of_memory else 'error'}: {str(e)[:200]!r}"

    def warm_up() -> None:
        warmup_shapes[:] = workloads.warm_up(work, steps, WARMUP_SEED)

    def answer(value: Any) -> None:
        print(json.dumps(value), flush=True)

    # The cap's base: the most requested at once by anything run so far, the warm-up's largest
    # shapes and every timed round (peaks are reset per phase, so the highest is kept here).
    highest = 0

    def highest_requested() -> int:
        nonlocal highest
        highest = max(highest, counters.stats().get("requested_bytes.all.peak", 0))
        return highest

    try:
        warm_up()
    except oom as e:
        print(f"{failure(e)} (in the warm-up)", flush=True)
        return
    answer("ready")
    for line in sys.stdin:
        command, *arg = line.split()
        try:
            if command == "cap":
                peak = highest_requested()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    total = torch.cuda.get_device_properties(0).total_memory
                    torch.cuda.set_per_process_memory_fraction(float(arg[0]) * peak / total)
                counters.reset_peak()
                warm_up()
                answer({"capped_at_bytes": int(float(arg[0]) * peak)})
            elif command == "seed":
                work.reseed(int(arg[0]))
                if arg[1:] == ["reset"]:  # the first round of a phase: peaks of the phase
                    highest_requested()
                    counters.reset_peak()
                answer("ok")
            elif command == "step":
                batch = work.draw()
                before = counters.stats()
                used_before = usage()
                seconds, enqueued = workloads.timed_step_and_enqueue(work, batch)
                used_after = usage()
                after = counters.stats()
                answer({"s": seconds, "enqueue_s": enqueued, "shape": workloads.batch_shape(batch),
                        "calls": {k: after.get(k, 0) - before.get(k, 0) for k in CALLS},
                        "usage": {k: round(used_after[k] - used_before[k], 6) for k in USAGE}})
            elif command == "stats":
                s = counters.stats()
                answer({"peak_reserved": s.get("reserved_bytes.all.peak", 0),
                        "peak_requested": s.get("requested_bytes.all.peak", 0),
                        "num_alloc_retries": s.get("num_alloc_retries", 0),
                        "num_ooms": s.get("num_ooms", 0), "warmup_shapes": warmup_shapes})
        except oom as e:
            print(failure(e), flush=True)
            return


# ------------------------------------------------------------------------------ the parent

# Longest wait for one answer: the warm-up comes first (model set-up and, for the native back
# end, its first build); a step of these models takes well under a second.
READY_TIMEOUT_S = 420.0
STEP_TIMEOUT_S = 120.0


class RoundFailed(Exception):
    """A training process ran out of memory, failed, hung or ended."""


class Trainer:
    """One training process under one allocator, answering one line per command."""

    def __init__(self, allocator: str, model: str, steps: int, cores: str,
                 self_check: bool, name: str = "", fixed_shapes: bool = False) -> None:
        self.name = name or allocator
        env = dict(os.environ, **ALLOCATORS[allocator])
        argv = [sys.executable, "-m", __spec__.name, "--child", model, str(steps), cores,
                "1" if self_check else "0", "1" if fixed_shapes else "0"]
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)

    def send(self, what: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(what + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise RoundFailed(f"the {self.name} process ended (exit {self.proc.poll()})") from None

    def read(self, timeout: float = STEP_TIMEOUT_S) -> Any:
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                raise RoundFailed(f"the {self.name} process gave no answer within {timeout:.0f} s")
        line = self.proc.stdout.readline().strip()
        if not line:
            raise RoundFailed(f"the {self.name} process ended (exit {self.proc.poll()})")
        if line.startswith(("oom", "error")):
            raise RoundFailed(f"{self.name}: {line}")
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            raise RoundFailed(f"the {self.name} process answered {line[:200]!r}") from None

    def ask(self, what: str, timeout: float = STEP_TIMEOUT_S) -> Any:
        self.send(what)
        return self.read(timeout)

    def finish(self) -> None:
        """Lets the process end (its stdin closed), killing it if it does not within 30 s."""
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
        except BrokenPipeError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def both(trainers: list[Trainer], what: str, timeout: float = STEP_TIMEOUT_S) -> list[Any]:
    """The same command to both processes at once (they run it side by side, untimed)."""
    for t in trainers:
        t.send(what)
    return [t.read(timeout) for t in trainers]


def timed_round(r: int, trainers: list[Trainer], steps: int, reset_peak: bool) -> dict:
    both(trainers, f"seed {ROUND_SEED + r}" + (" reset" if reset_peak else ""))
    ours, other = trainers
    got: dict[str, list[dict]] = {t.name: [] for t in trainers}
    for i in range(steps):
        for t in (trainers if (i + r) % 2 == 0 else trainers[::-1]):
            got[t.name].append(t.ask("step"))
    mine, theirs = got[ours.name], got[other.name]
    if [s["shape"] for s in mine] != [s["shape"] for s in theirs]:
        raise RoundFailed(f"round {r}: the two processes drew different shapes")
    return {"round": r, "seed": ROUND_SEED + r,
            "ratio": sum(s["s"] for s in mine) / sum(s["s"] for s in theirs),
            "step_ratios": [a["s"] / b["s"] for a, b in zip(mine, theirs, strict=True)],
            "step_times_s": {n: [round(s["s"], 6) for s in v] for n, v in got.items()},
            "enqueue_times_s": {n: [round(s["enqueue_s"], 6) for s in v]
                                for n, v in got.items()},
            "step_device_calls": {n: [s["calls"] for s in v] for n, v in got.items()},
            "step_usage": {n: [s["usage"] for s in v] for n, v in got.items()},
            "shapes": [s["shape"] for s in mine]}


def summarize(rounds: list[dict], ours: str) -> dict:
    if not rounds:
        return {}
    mean, se = mean_and_stderr([r["ratio"] for r in rounds])
    ratios = [x for r in rounds for x in r["step_ratios"]]
    moved = [x for r in rounds for x, c in zip(r["step_ratios"], r["step_device_calls"][ours],
                                               strict=True) if any(c.values())]
    still = [x for r in rounds for x, c in zip(r["step_ratios"], r["step_device_calls"][ours],
                                               strict=True) if not any(c.values())]
    calls = {n: {k: sum(c[k] for r in rounds for c in r["step_device_calls"][n]) for k in CALLS}
             for n in rounds[0]["step_device_calls"]}
    names = list(rounds[0]["step_times_s"])
    # How much of each step the host spent queuing it, and ours over the other's queuing time:
    # a host-bound step that queues slower is slower for the host's work, the allocator's
    # calls among it.
    enqueue_share = {n: statistics.median(e / max(t, 1e-9) for r in rounds for e, t in
                                          zip(r["enqueue_times_s"][n], r["step_times_s"][n],
                                              strict=True)) for n in names}
    enqueue_ratios = [a / max(b, 1e-9) for r in rounds for a, b in
                      zip(*(r["enqueue_times_s"][n] for n in names), strict=True)]
    # Each side's median host usage a step: more CPU time for the same step, or more of it in
    # the kernel, or more faults or preemptions, says where a slower process loses its time.
    step_usage = {n: {k: statistics.median(u[k] for r in rounds for u in r["step_usage"][n])
                      for k in USAGE} for n in names}
    return {"mean_ratio": mean, "stderr": se, "median_step_ratio": statistics.median(ratios),
            "median_enqueue_share": enqueue_share, "median_step_usage": step_usage,
            "median_enqueue_ratio": statistics.median(enqueue_ratios),
            "steps_compared": len(ratios), "device_calls_while_timed": calls,
            "steps_with_device_calls": len(moved),
            "median_step_ratio_with_device_calls": statistics.median(moved) if moved else None,
            "median_step_ratio_without_device_calls": statistics.median(still) if still else None}


def run_phase(trainers: list[Trainer], fraction: float, rounds: int, steps: int,
              save: Callable[[dict], None] = lambda phase: None) -> dict:
    """Timed rounds uncapped (fraction 0) or, after a capped warm-up, under the cap; `save` gets
    the phase so far after every round."""
    phase: dict[str, Any] = {"fraction_of_peak": fraction, "rounds": [], "failures": []}
    try:
        if fraction:
            caps = both(trainers, f"cap {fraction}", READY_TIMEOUT_S)
            phase["capped_at_bytes"] = {t.name: c["capped_at_bytes"]
                                        for t, c in zip(trainers, caps, strict=True)}
        for r in range(rounds):
            phase["rounds"].append(timed_round(r, trainers, steps, reset_peak=r == 0))
            save(phase)
            rr = phase["rounds"][-1]
            calls = {n: sum(sum(c.values()) for c in v) for n, v in rr["step_device_calls"].items()}
            print(f"  round {r}: {trainers[0].name} / {trainers[1].name} total step time "
                  f"{rr['ratio']:.4f}; device calls while timed {calls}", flush=True)
        stats = both(trainers, "stats")
        phase["reserved_over_requested"] = {
            t.name: s["peak_reserved"] / max(1, s["peak_requested"])
            for t, s in zip(trainers, stats, strict=True)}
        phase["num_alloc_retries"] = {t.name: s["num_alloc_retries"]
                                      for t, s in zip(trainers, stats, strict=True)}
        # Since the process started: out-of-memory errors its code caught and went on from
        # count here too (cuDNN tries a smaller workspace, or another plan).
        phase["num_ooms"] = {t.name: s["num_ooms"] for t, s in zip(trainers, stats, strict=True)}
        warm = stats[0]["warmup_shapes"]
        phase["timed_shapes_fresh"] = all(r["shapes"] != warm for r in phase["rounds"])
    except RoundFailed as e:
        phase["failures"].append(str(e))
        print(f"  failed: {e}", flush=True)
    phase.update(summarize(phase["rounds"], trainers[0].name))
    return phase


def run_workload(model: str, ours: str, against: str, fractions: list[float], rounds: int,
                 steps: int, cores: str, self_check: bool, out: Path | None,
                 fixed_shapes: bool = False) -> dict:
    result: dict[str, Any] = {"command": " ".join(sys.argv), "model": model, "ours": ours,
                              "against": against, "cores": cores, "steps_per_round": steps,
                              "fixed_shapes": fixed_shapes, "source": source_tree.label(),
                              "phases": []}
    # The same allocator on both sides (--ours): the second is named apart, the harness's own
    # check (its ratio should be 1.00 within the spread).
    names = (ours, against) if ours != against else (ours, f"{against} (second process)")
    trainers = [Trainer(a, model, steps, cores, self_check, n, fixed_shapes)
                for a, n in zip((ours, against), names, strict=True)]
    try:
        try:  # both warm up at once; timing starts when both are ready
            for t in trainers:
                if t.read(READY_TIMEOUT_S) != "ready":
                    raise RoundFailed(f"the {t.name} process did not say it was ready")
        except RoundFailed as e:
            result["failures"] = [str(e)]
            print(f"{model}: {e}", flush=True)
            return result
        for fraction in fractions:
            print(f"{model}, " + (f"capped at {fraction} x peak requested" if fraction
                                  else "uncapped") + ":", flush=True)
            # Saved after every round and again with the phase's summary, so that a run stopped
            # or failing later (a device call's time limit) loses no round it timed.
            # (whole or not at all: a run killed while writing leaves the previous version).
            def save(phase: dict) -> None:
                if out:
                    write_whole(out, json.dumps({**result, "phases": [*result["phases"], phase]},
                                                indent=1).encode())

            phase = run_phase(trainers, fraction, rounds, steps, save)
            result["phases"].append(phase)
            if out:
                write_whole(out, json.dumps(result, indent=1).encode())
            if phase.get("mean_ratio") is not None:
                print(f"{model} {'capped' if fraction else 'uncapped'}: {ours} vs {against} "
                      f"step time {100 * phase['mean_ratio'] - 100:+.2f} %; median per-step "
                      f"ratio {phase['median_step_ratio']:.3f} over {phase['steps_compared']} "
                      f"steps ({phase['steps_with_device_calls']} with device calls by {ours}: "
                      f"median {phase['median_step_ratio_with_device_calls']}); reserved/"
                      f"requested " + ", ".join(f"{a} {v:.3f}" for a, v in
                                               phase["reserved_over_requested"].items()),
                      flush=True)
                for name, used in phase["median_step_usage"].items():
                    print(f"  {name}, median a step: user {1e3 * used['user_s']:.2f} ms, system "
                          f"{1e3 * used['system_s']:.2f} ms, {used['minor_faults']:g} page "
                          f"faults, {used['involuntary_switches']:g} preemptions", flush=True)
            if phase["failures"]:
                break
    finally:
        for t in trainers:
            t.finish()
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=TRAINED, default="transformer")
    p.add_argument("--against", choices=sorted(ALLOCATORS), default="expandable",
                   help="the allocator compared with allocwatch's (or with --ours)")
    p.add_argument("--ours", choices=sorted(ALLOCATORS), default="allocwatch",
                   help="the allocator judged (default allocwatch's; the same as --against "
                        "checks the harness itself: its ratio should be 1.00 within the spread)")
    p.add_argument("--rounds", type=int, default=8, help="timed rounds of fresh shapes")
    p.add_argument("--steps", type=int, default=12, help="steps per round (and warm-up)")
    p.add_argument("--cores", default="",
                   help="CPU cores both processes run on, e.g. 2 or 2,3 (default: the first "
                        "this process may use, the parent then on the others)")
    p.add_argument("--fraction-of-peak", type=float, default=0.0, metavar="F",
                   help="cap each process at F x the peak requested bytes it has met (e.g. 1.03)")
    p.add_argument("--fixed-shapes", action="store_true",
                   help="every step at the workload's largest shapes (the steps repeat)")
    p.add_argument("--json", metavar="FILE",
                   help="the result, written after every round (a run stopped midway keeps "
                        "the rounds it timed)")
    p.add_argument("--suite", metavar="DIR",
                   help="every workload, uncapped then at 1.03 x: DIR/lockstep_<workload>.json")
    p.add_argument("--self-check", action="store_true",
                   help="the protocol on the CPU with tiny workloads (no GPU)")
    p.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), args.child[2], args.child[3] == "1",
              args.child[4] == "1")
        return 0
    if args.fraction_of_peak and args.fraction_of_peak < 1.0:
        p.error(f"--fraction-of-peak must be at least 1.0 (the workload's own need), got "
                f"{args.fraction_of_peak}")
    if args.rounds < 1 or args.steps < 1:
        p.error("--rounds and --steps must be at least 1")
    if args.fraction_of_peak and args.against == "cudaMallocAsync":
        p.error("--fraction-of-peak needs requested bytes, which cudaMallocAsync does not count")
    allowed = sorted(os.sched_getaffinity(0))
    cores = args.cores or str(allowed[0])
    rest = set(allowed) - {int(c) for c in cores.split(",")}
    if rest:  # the parent's own work (reading answers) off the trainers' core
        os.sched_setaffinity(0, rest)
    ours, against = args.ours, args.against
    if args.self_check and any(a.startswith("allocwatch") for a in (ours, against)):
        # On the CPU neither side can install allocwatch: the check compares PyTorch with itself.
        ours, against = "pytorch", "expandable"
    if args.suite:
        out_dir = Path(args.suite)
        out_dir.mkdir(parents=True, exist_ok=True)
        results = [run_workload(m, ours, against, [0.0, SUITE_FRACTION], args.rounds,
                                args.steps, cores, args.self_check,
                                out_dir / f"lockstep_{m}.json", args.fixed_shapes)
                   for m in TRAINED]
    else:
        fractions = [args.fraction_of_peak]
        results = [run_workload(args.model, ours, against, fractions, args.rounds, args.steps,
                                cores, args.self_check, Path(args.json) if args.json else None,
                                args.fixed_shapes)]
    ok = all(not r.get("failures") and r["phases"] and not any(ph["failures"]
                                                              for ph in r["phases"])
             for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
