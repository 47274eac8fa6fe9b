"""Step time of allocwatch's allocator against others, training processes in lockstep, on
shapes none has seen.

    python -m bench.gpu.step_lockstep [--model WORKLOAD] [--against expandable [pytorch ...]]
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
The parent runs on the other cores, and so do the processes while they warm up (a compiling
workload's inductor uses every core it may): each moves to the one core once ready.

With several allocators after --against, one process each, all in lockstep: step i of every
process runs before any step i + 1, in an order that goes through every rotation of the
processes and its reverse, so that each pair of processes meets in both orders equally often.
Every ratio is --ours over one of the others, step by step.

Each process first warms up untimed: two steps at the workload's largest shapes (the second with
the optimizer's state in place), then --steps steps of the warm-up sequence (cuBLAS/cuDNN plans,
the allocators' first growth). Then come --rounds timed rounds, each --steps steps of shapes
drawn afresh from a seed of its own, the same seed in both processes and never the warm-up's:
what a training run with random shapes sees, where a step's exact shapes rarely come back. With
--fraction-of-peak F (and in the suite's second half) every process then caps itself with
set_per_process_memory_fraction at F x the most bytes any of them has requested at once so far
(their warm-ups, which met the largest shapes, and in the suite the uncapped rounds, whose shapes
the capped rounds draw again), empties its cache, warms up again under the cap, and times the
rounds; running out of memory is reported. One cap for all: where the program's peak request
follows its timing (a consumer stream lagging its producer holds more of the producer's frees
back), each process capped at its own peak would run under a limit of its own.

Reported per round: allocwatch's total step time over the other's; over all rounds the mean of
those ratios with its standard error and the median of the per-step ratios (the bar: <= 1.00).
Per step, each allocator's device calls (its num_device_alloc / num_device_free /
num_sync_all_streams: for allocwatch its core's counts, maps and unmaps with expandable
segments; for PyTorch torch.cuda.memory_stats()'s) and, for allocwatch, the driver calls behind
them (num_device_calls.*: one a page mapped or unmapped, and the creates, releases and access
grants, events recorded and queried), and the median step ratio over the steps
where allocwatch made device calls against those where it made none: where page moves cost
step time, these say so. Per step also the time until the host had queued the whole step:
its median share of the step shows whether the workload is bound by the host (where the
allocator's own calls count) or by the device, and the median of ours over the other's
queuing time whether our host side is slower; per step and side also what the process took
from the host (getrusage: CPU time in user space and in the kernel, page faults, context
switches), whose medians say where a slower process loses its time. Also each allocator's
peak reserved / peak requested, over the timed rounds and over the whole phase (the warm-up,
which met the largest shapes, included), and its allocation retries and out-of-memory errors
since its process started (those its code caught and went on from count too: cuDNN then tries a
smaller workspace or another plan, at a cost on the host); per step, allocwatch's host waits
(num_host_waits.device / .stream / .event / .unmap_thread: the allocator's thread waiting for
the device, or for its own unmapping thread) and its device-side stream waits
(num_stream_waits), which PyTorch's allocators do not count.
Under a cap, a process of another allocator that runs out of memory is reported and leaves;
the others go on, and where none is left the judged allocator's process goes on alone, for
its memory and retries under the cap (no step ratio).

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
from allocator_ext.protocol.metrics import DEVICE_CALLS, WAIT_SCOPES
from allocator_ext.workloads import NAMES
from bench.gpu.lockstep_pool import Round, median_interval
from bench.lib import source_tree
from bench.lib.allocators import ALLOCATORS, Counters, setup_in_child
from bench.lib.stats import mean_and_stderr

TRAINED = ("transformer", "moe", "convnet")  # the suite's workloads (--suite)
SUITE_FRACTION = 1.03
WARMUP_SEED = 1
ROUND_SEED = 1000  # round r draws from seed ROUND_SEED + r: never the warm-up's
CALLS = ("num_device_alloc", "num_device_free", "num_sync_all_streams")
# The allocator's own waits, where it counts them (allocwatch's core; PyTorch's do not): its
# thread waiting for the whole device, a stream, an event or (releasing the whole cache) the
# allocator's unmapping thread, and a stream made to wait for another on the device (no host
# wait).
WAITS = (*(f"num_host_waits.{scope}" for scope in WAIT_SCOPES), "num_stream_waits")
# The driver calls behind those device calls, where the allocator counts them (allocwatch's
# num_device_calls.*): a mapping makes one a page, so a page move of 16 MiB is some 17 calls;
# with them the events it records and queries (cross-stream orderings), which cost the host too.
DRIVER_CALLS = tuple(f"num_device_calls.{call}"
                     for call in (*DEVICE_CALLS, "event_record", "event_query"))
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
    """Answers one line per command on stdin: 'peak', 'cap F BYTES', 'seed N', 'step',
    'stats'."""
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

    # The phase's peaks, the warm-up's included, kept across the resets of the timed rounds.
    phase = {"reserved": 0, "requested": 0}

    def phase_peaks() -> dict[str, int]:
        s = counters.stats()
        phase["reserved"] = max(phase["reserved"], s.get("reserved_bytes.all.peak", 0))
        phase["requested"] = max(phase["requested"], s.get("requested_bytes.all.peak", 0))
        return phase

    try:
        warm_up()
    except oom as e:
        print(f"{failure(e)} (in the warm-up)", flush=True)
        return
    if cores:  # the timed steps on one core (see the description)
        os.sched_setaffinity(0, {int(c) for c in cores.split(",")})
    answer("ready")
    for line in sys.stdin:
        command, *arg = line.split()
        try:
            if command == "peak":
                answer({"requested": highest_requested()})
            elif command == "cap":  # cap F BYTES: F x the most any process requested
                peak = max(highest_requested(), int(arg[1]))
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    total = torch.cuda.get_device_properties(0).total_memory
                    torch.cuda.set_per_process_memory_fraction(float(arg[0]) * peak / total)
                counters.reset_peak()
                phase.update(reserved=0, requested=0)  # a new phase: its own peaks
                warm_up()
                answer({"capped_at_bytes": int(float(arg[0]) * peak)})
            elif command == "seed":
                work.reseed(int(arg[0]))
                if arg[1:] == ["reset"]:  # the first round of a phase: peaks of the phase
                    highest_requested()
                    phase_peaks()
                    counters.reset_peak()
                answer("ok")
            elif command == "step":
                batch = work.draw()
                before = counters.stats()
                used_before = usage()
                seconds, enqueued = workloads.timed_step_and_enqueue(work, batch)
                used_after = usage()
                after = counters.stats()
                counted = [k for k in WAITS if k in after]
                driver = [k for k in DRIVER_CALLS if k in after]
                answer({"s": seconds, "enqueue_s": enqueued, "shape": workloads.batch_shape(batch),
                        "calls": {k: after.get(k, 0) - before.get(k, 0) for k in CALLS},
                        "waits": {k: after[k] - before.get(k, 0) for k in counted} or None,
                        "driver_calls": {k: after[k] - before.get(k, 0) for k in driver} or None,
                        "usage": {k: round(used_after[k] - used_before[k], 6) for k in USAGE}})
            elif command == "stats":
                s = counters.stats()
                peaks = phase_peaks()
                answer({"peak_reserved": s.get("reserved_bytes.all.peak", 0),
                        "peak_requested": s.get("requested_bytes.all.peak", 0),
                        "phase_peak_reserved": peaks["reserved"],
                        "phase_peak_requested": peaks["requested"],
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
    """A training process ran out of memory, failed, hung or ended (`who`: its name)."""

    def __init__(self, message: str, who: str = "", out_of_memory: bool = False) -> None:
        super().__init__(message)
        self.who = who
        self.out_of_memory = out_of_memory


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
            raise RoundFailed(f"the {self.name} process ended (exit {self.proc.poll()})",
                              self.name) from None

    def read(self, timeout: float = STEP_TIMEOUT_S) -> Any:
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                raise RoundFailed(f"the {self.name} process gave no answer within "
                                  f"{timeout:.0f} s", self.name)
        line = self.proc.stdout.readline().strip()
        if not line:
            raise RoundFailed(f"the {self.name} process ended (exit {self.proc.poll()})",
                              self.name)
        if line.startswith(("oom", "error")):
            raise RoundFailed(f"{self.name}: {line}", self.name, line.startswith("oom"))
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            raise RoundFailed(f"the {self.name} process answered {line[:200]!r}",
                              self.name) from None

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


def gather(trainers: list[Trainer], what: str, timeout: float = STEP_TIMEOUT_S
           ) -> list[Any]:
    """The same command to every process at once (they run it side by side, untimed): each
    one's answer, or the RoundFailed it failed with. Every answer is read, so that none is left
    to be taken for the answer to a later command."""
    answers: list[Any] = []
    for t in trainers:
        try:
            t.send(what)
            answers.append(None)
        except RoundFailed as e:
            answers.append(e)
    for i, t in enumerate(trainers):
        if answers[i] is None:
            try:
                answers[i] = t.read(timeout)
            except RoundFailed as e:
                answers[i] = e
    return answers


def both(trainers: list[Trainer], what: str, timeout: float = STEP_TIMEOUT_S) -> list[Any]:
    """gather's answers, or its first failure raised."""
    answers = gather(trainers, what, timeout)
    for a in answers:
        if isinstance(a, RoundFailed):
            raise a
    return answers


def step_orders(trainers: list[Trainer]) -> list[list[Trainer]]:
    """The orders in which the processes take their turns at one step: every rotation and its
    reverse, each once (for two processes: each first in turn)."""
    orders: list[list[Trainer]] = []
    for k in range(len(trainers)):
        rotated = trainers[k:] + trainers[:k]
        for order in (rotated, rotated[::-1]):
            if order not in orders:
                orders.append(order)
    return orders


def timed_round(r: int, trainers: list[Trainer], steps: int, reset_peak: bool) -> dict:
    both(trainers, f"seed {ROUND_SEED + r}" + (" reset" if reset_peak else ""))
    ours, others = trainers[0], trainers[1:]
    orders = step_orders(trainers)
    got: dict[str, list[dict]] = {t.name: [] for t in trainers}
    for i in range(steps):
        for t in orders[(i + r) % len(orders)]:
            got[t.name].append(t.ask("step"))
    mine = got[ours.name]
    for other in others:
        if [s["shape"] for s in mine] != [s["shape"] for s in got[other.name]]:
            raise RoundFailed(f"round {r}: the {ours.name} and {other.name} processes drew "
                              f"different shapes")
    against = {o.name: [a["s"] / b["s"] for a, b in zip(mine, got[o.name], strict=True)]
               for o in others}
    first = others[0].name if others else None  # none: ours alone, every other gone
    return {"round": r, "seed": ROUND_SEED + r,
            "ratio": (sum(s["s"] for s in mine) / sum(s["s"] for s in got[first])
                      if first else None),
            "step_ratios": against[first] if first else [], "step_ratios_against": against,
            "step_times_s": {n: [round(s["s"], 6) for s in v] for n, v in got.items()},
            "enqueue_times_s": {n: [round(s["enqueue_s"], 6) for s in v]
                                for n, v in got.items()},
            "step_device_calls": {n: [s["calls"] for s in v] for n, v in got.items()},
            "step_host_waits": {n: [s.get("waits") for s in v] for n, v in got.items()},
            "step_driver_calls": {n: [s.get("driver_calls") for s in v] for n, v in got.items()},
            "step_usage": {n: [s["usage"] for s in v] for n, v in got.items()},
            "shapes": [s["shape"] for s in mine]}


def per_step(rounds: list[dict], key: str, name: str, fields: tuple[str, ...]
             ) -> dict[str, float] | None:
    """The mean a step of each of `fields` in the rounds' per-step counts `key` of process
    `name`, and their sum as "all"; None where the process counts none of them."""
    steps = [s for r in rounds for s in r.get(key, {}).get(name, [])]
    if not steps or any(s is None for s in steps):
        return None
    means = {f: sum(s.get(f, 0) for s in steps) / len(steps) for f in fields}
    return {**means, "all": sum(means.values())}


def against_summary(rounds: list[dict], ours: str, other: str) -> dict[str, Any] | None:
    """ours over `other`: the median per-step ratio with its 95 % interval over the rounds
    resampled (lockstep_pool's), the mean of the rounds' total ratios, and each side's total
    step time, over the rounds that timed both."""
    timed = [r for r in rounds if other in r.get("step_ratios_against", {})]
    if not timed:
        return None
    ratios = [x for r in timed for x in r["step_ratios_against"][other]]
    totals = [sum(r["step_times_s"][ours]) / sum(r["step_times_s"][other]) for r in timed]
    mean, se = mean_and_stderr(totals)
    low, high = median_interval([Round(r["step_ratios_against"][other], None) for r in timed])
    return {"rounds": len(timed), "steps_compared": len(ratios),
            "median_step_ratio": statistics.median(ratios), "interval_95": [low, high],
            "mean_ratio": mean, "stderr": se,
            "step_time_s": {n: sum(sum(r["step_times_s"][n]) for r in timed)
                            for n in (ours, other)}}


def summarize(rounds: list[dict], ours: str) -> dict:
    """The phase's figures. Those not under "against" compare ours with the first other
    process (the only one, in a run of two), over the rounds it was in."""
    if not rounds:
        return {}
    names = list(dict.fromkeys(n for r in rounds for n in r["step_times_s"]))
    first = names[1] if len(names) > 1 else None
    paired = [r for r in rounds if first in r["step_ratios_against"]]
    mean, se = (mean_and_stderr([sum(r["step_times_s"][ours]) / sum(r["step_times_s"][first])
                                 for r in paired]) if paired else (None, None))
    ratios = [x for r in paired for x in r["step_ratios_against"][first]]
    moved = [x for r in paired for x, c in zip(r["step_ratios_against"][first],
                                               r["step_device_calls"][ours], strict=True)
             if any(c.values())]
    still = [x for r in paired for x, c in zip(r["step_ratios_against"][first],
                                               r["step_device_calls"][ours], strict=True)
             if not any(c.values())]
    calls = {n: {k: sum(c[k] for r in rounds for c in r["step_device_calls"].get(n, []))
                 for k in CALLS} for n in names}
    # How much of each step the host spent queuing it, and ours over the other's queuing time:
    # a host-bound step that queues slower is slower for the host's work, the allocator's
    # calls among it.
    enqueue_share = {n: statistics.median(e / max(t, 1e-9) for r in rounds for e, t in
                                          zip(r["enqueue_times_s"].get(n, []),
                                              r["step_times_s"].get(n, []), strict=True))
                     for n in names}
    enqueue_ratios = [a / max(b, 1e-9) for r in paired
                      for a, b in zip(r["enqueue_times_s"][ours], r["enqueue_times_s"][first],
                                      strict=True)]
    # Each side's median host usage a step: more CPU time for the same step, or more of it in
    # the kernel, or more faults or preemptions, says where a slower process loses its time.
    step_usage = {n: {k: statistics.median(u[k] for r in rounds for u in r["step_usage"].get(n, []))
                      for k in USAGE} for n in names}
    return {"mean_ratio": mean, "stderr": se,
            "median_step_ratio": statistics.median(ratios) if ratios else None,
            "median_enqueue_share": enqueue_share, "median_step_usage": step_usage,
            "median_enqueue_ratio": statistics.median(enqueue_ratios) if enqueue_ratios else None,
            "steps_compared": len(ratios), "device_calls_while_timed": calls,
            "device_calls_per_step": {n: per_step(rounds, "step_device_calls", n, CALLS)
                                      for n in names},
            "host_waits_per_step": {n: per_step(rounds, "step_host_waits", n, WAITS)
                                    for n in names},
            "driver_calls_per_step": {n: per_step(rounds, "step_driver_calls", n, DRIVER_CALLS)
                                      for n in names},
            "against": {n: against_summary(rounds, ours, n) for n in names if n != ours},
            "steps_with_device_calls": len(moved),
            "median_step_ratio_with_device_calls": statistics.median(moved) if moved else None,
            "median_step_ratio_without_device_calls": statistics.median(still) if still else None}


def run_phase(trainers: list[Trainer], fraction: float, rounds: int, steps: int,
              save: Callable[[dict], None] = lambda phase: None) -> dict:
    """Timed rounds uncapped (fraction 0) or, after a capped warm-up, under the cap; `save` gets
    the phase so far after every round. A process of another allocator that runs out of memory
    leaves `trainers` (the others go on without it, its failure in the phase); where every
    other has left, ours goes on alone, for its memory and retries under the cap (no step
    ratio). Where ours fails, or another fails otherwise (a wrong result, a hang), the phase
    ends."""
    phase: dict[str, Any] = {"fraction_of_peak": fraction, "rounds": [], "failures": [],
                             "left": {}}

    def leave(e: RoundFailed) -> bool:
        """Takes the failed process out where the phase can go on without it."""
        gone = [t for t in trainers[1:] if t.name == e.who]
        if not gone or not e.out_of_memory:
            return False
        trainers.remove(gone[0])
        gone[0].finish()
        phase["left"][e.who] = str(e)
        print(f"  {e.who} leaves: {e}", flush=True)
        return True

    def all_of(what: str, timeout: float = STEP_TIMEOUT_S) -> list[Any]:
        """The answers of the processes still in (one that fails leaves, if it may)."""
        answers = gather(trainers, what, timeout)
        for a in answers:
            if isinstance(a, RoundFailed) and not leave(a):
                raise a
        return [a for a in answers if not isinstance(a, RoundFailed)]

    try:
        if fraction:
            peak = max(a["requested"] for a in all_of("peak"))
            phase["capped_for_requested_bytes"] = peak
            caps = all_of(f"cap {fraction} {peak}", READY_TIMEOUT_S)
            phase["capped_at_bytes"] = {t.name: c["capped_at_bytes"]
                                        for t, c in zip(trainers, caps, strict=True)}
        r = 0
        while r < rounds:
            try:
                phase["rounds"].append(timed_round(r, trainers, steps,
                                                   reset_peak=not phase["rounds"]))
            except RoundFailed as e:
                if not leave(e):
                    raise
                continue  # the round again, without it
            save(phase)
            rr = phase["rounds"][-1]
            calls = {n: sum(sum(c.values()) for c in v) for n, v in rr["step_device_calls"].items()}
            versus = (f"{trainers[0].name} / {trainers[1].name} total step time "
                      f"{rr['ratio']:.4f}" if rr["ratio"] is not None
                      else f"{trainers[0].name} alone")
            print(f"  round {r}: {versus}; device calls while timed {calls}", flush=True)
            r += 1
        stats = all_of("stats")
        phase["reserved_over_requested"] = {
            t.name: s["peak_reserved"] / max(1, s["peak_requested"])
            for t, s in zip(trainers, stats, strict=True)}
        # Over the whole phase, the warm-up's largest shapes included: what the allocator
        # reserved for what the workload asked at its peak.
        phase["phase_peaks"] = {t.name: {"reserved": s["phase_peak_reserved"],
                                         "requested": s["phase_peak_requested"]}
                                for t, s in zip(trainers, stats, strict=True)}
        phase["phase_reserved_over_requested"] = {
            t.name: s["phase_peak_reserved"] / max(1, s["phase_peak_requested"])
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


def run_workload(model: str, ours: str, against: str | list[str], fractions: list[float],
                 rounds: int, steps: int, cores: str, self_check: bool, out: Path | None,
                 fixed_shapes: bool = False) -> dict:
    others = [against] if isinstance(against, str) else list(against)
    result: dict[str, Any] = {"command": " ".join(sys.argv), "model": model, "ours": ours,
                              "against": others[0], "others": others, "cores": cores,
                              "steps_per_round": steps, "fixed_shapes": fixed_shapes,
                              "source": source_tree.label(),
                              "device": "cpu" if self_check else gpu_name(), "phases": []}
    # An allocator on both sides (--ours among --against): the second is named apart, the
    # harness's own check (its ratio should be 1.00 within the spread).
    names = [ours] + [f"{a} (second process)" if a == ours else a for a in others]
    trainers = [Trainer(a, model, steps, cores, self_check, n, fixed_shapes)
                for a, n in zip([ours, *others], names, strict=True)]
    try:
        try:  # all warm up at once; timing starts when all are ready
            for t in trainers:
                if t.read(READY_TIMEOUT_S) != "ready":
                    raise RoundFailed(f"the {t.name} process did not say it was ready", t.name)
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
            # A phase that failed after timing some rounds has their times, not its peaks;
            # one that ours finished alone has its peaks and no step ratio.
            if "phase_reserved_over_requested" in phase:
                print(f"{model} {'capped' if fraction else 'uncapped'}: reserved/requested "
                      f"over the phase " + ", ".join(
                          f"{a} {v:.3f}"
                          for a, v in phase["phase_reserved_over_requested"].items())
                      + f"; allocation retries {phase['num_alloc_retries']}", flush=True)
            if phase.get("mean_ratio") is not None:
                for other, vs in phase["against"].items():
                    if vs is None:
                        continue
                    low, high = vs["interval_95"]
                    print(f"  {ours} vs {other}: median per-step ratio "
                          f"{vs['median_step_ratio']:.3f} ({low:.3f}-{high:.3f}) over "
                          f"{vs['steps_compared']} steps; total step time "
                          f"{100 * vs['mean_ratio'] - 100:+.2f} %", flush=True)
                print(f"  {phase['steps_with_device_calls']} steps with device calls by {ours}: "
                      f"median ratio {phase['median_step_ratio_with_device_calls']}; host waits "
                      f"a step {phase['host_waits_per_step'].get(ours)}; device calls a step "
                      + ", ".join(f"{n} {c['all']:.2f}" for n, c in
                                  phase["device_calls_per_step"].items() if c)
                      + "; driver calls a step "
                      + ", ".join(f"{n} {c['all']:.2f}" for n, c in
                                  phase["driver_calls_per_step"].items() if c), flush=True)
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
    p.add_argument("--model", choices=NAMES, default="transformer",
                   help="the allocator_ext.workloads workload trained")
    p.add_argument("--against", choices=sorted(ALLOCATORS), nargs="+", default=["expandable"],
                   help="the allocator(s) compared with allocwatch's (or with --ours), one "
                        "process each")
    p.add_argument("--ours", choices=sorted(ALLOCATORS), default="allocwatch",
                   help="the allocator judged (default allocwatch's; the same as --against "
                        "checks the harness itself: its ratio should be 1.00 within the spread)")
    p.add_argument("--rounds", type=int, default=8, help="timed rounds of fresh shapes")
    p.add_argument("--steps", type=int, default=12, help="steps per round (and warm-up)")
    p.add_argument("--cores", default="",
                   help="CPU cores the processes' timed steps run on, e.g. 2 or 2,3 (default: "
                        "the first this process may use, the parent then on the others)")
    p.add_argument("--fraction-of-peak", type=float, default=0.0, metavar="F",
                   help="cap every process at F x the most bytes any of them has requested at "
                        "once (e.g. 1.03)")
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
    if args.fraction_of_peak and "cudaMallocAsync" in args.against:
        p.error("--fraction-of-peak needs requested bytes, which cudaMallocAsync does not count")
    cores = pin_parent(args.cores)
    ours, against = args.ours, args.against
    if args.self_check and any(a.startswith("allocwatch") for a in (ours, *against)):
        # On the CPU no side can install allocwatch: the check compares PyTorch with itself.
        ours, against = "pytorch", ["expandable"]
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
    return 0 if all(succeeded(r) for r in results) else 1


def gpu_name() -> str | None:
    """The first GPU's name, from nvidia-smi (the parent makes no CUDA context of its own)."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    names = done.stdout.strip().splitlines()
    return names[0].strip() if done.returncode == 0 and names else None


def pin_parent(cores: str) -> str:
    """The cores the timed steps run on (default: the first this process may use), the parent
    moved off them onto the others."""
    allowed = sorted(os.sched_getaffinity(0))
    cores = cores or str(allowed[0])
    rest = set(allowed) - {int(c) for c in cores.split(",")}
    if rest:  # the parent's own work (reading answers) off the trainers' core
        os.sched_setaffinity(0, rest)
    return cores


def succeeded(result: dict) -> bool:
    """Every phase ran; a process of another allocator that left under a cap is a result (it
    ran out of memory where ours did not), not a failure of the run."""
    return not result.get("failures") and bool(result["phases"]) and not any(
        ph["failures"] for ph in result["phases"])


if __name__ == "__main__":
    sys.exit(main())
