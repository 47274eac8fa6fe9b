"""A long training run under allocwatch's allocator with the agent publishing to a real sidecar:
does peak reserved memory stay flat once the run has met its shapes?

    python -m bench.gpu.long_run --out DIR [--minutes 8] [--model transformer]     (on a GPU)
    python -m bench.gpu.long_run --self-check --out DIR              (CPU: the plumbing, ~40 s)
    python -m bench.gpu.long_run --replot DIR/long_run.json --plot FILE.png     (draws it again)

The driver starts a sidecar (`python -m exporter.cli sidecar`) and the training worker through
`python -m exporter.cli run --target SIDECAR -- python long_run.py --worker ...`: the user's
path, with allocwatch's allocator installed and the agent started the moment the worker imports
torch, no code of the worker's own. The worker trains an allocator_ext.workloads model on random
shapes (first two steps at its largest shapes, the second with the optimizer's state in place,
so that the run's peak request is met at once and any later growth of peak reserved is the
allocator's, not a larger step's), for --minutes from
its first step.

Every half second the driver scrapes the sidecar's /metrics, as Prometheus would, for the
worker's reserved, allocated and requested bytes, its peak reserved and allocated bytes and its
device allocation and free counters; it prints one line a minute. The worker writes its own
figures (its core's statistics, steps, median step time) to DIR/worker.log at every minute mark.

The verdict: peak reserved after minute 2 (the process's peak at the end of the run, as the
sidecar shows it) within 0.2 % of the peak at the end of minute 2 (the bar of the replayed
steady state, bench/replay/steady_state.py). Beside it, the workload's own peak (peak
allocated bytes, the same under any allocator) over the same minutes, and the growth of peak
reserved beyond it against the same bar: where a random shape after minute 2 still needs more
than any before, peak reserved grows under any allocator, and only the part beyond the
workload's is the allocator's. The figures are reported whatever they are; the exit
status says only whether the run was measured (1: the worker failed, or the agent never reached
the sidecar).

It finishes within --minutes + 60 s however slowly the worker starts (torch, CUDA, building the
native back end): the worker stops at that deadline less a margin, and a shortened run says so
(`training_seconds`). Everything goes under --out: long_run.json (samples, per-minute figures,
verdict), long_run.png (reserved and allocated over time; --json and --plot put them elsewhere),
worker.log, and the sidecar's folder (its settings, log and socket). Without matplotlib the JSON
is still written, and --replot draws the picture from it later, anywhere.

--self-check runs the same driver, sidecar and `allocwatch run` launch on the CPU for 36 s with
6-second "minutes": the worker trains a tiny transformer and publishes allocwatch's core on the
simulated device, which serves an allocation pattern sized by each step's batch. It checks this
script, not the GPU's figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import REPO
from bench.lib import sidecar_process, source_tree
from bench.lib.sidecar_process import SidecarProcess

BAR = 0.002            # peak reserved after minute SETTLE within this share of minute SETTLE's
SETTLE = 2             # minute marks given to the run to meet its shapes
SCRAPE_S = 0.5         # the agent reports every second: each report is seen
GRACE_S = 60.0         # the whole run ends within --minutes + this
STOP_MARGIN_S = 20.0   # the worker stops training this long before that end, so that it exits,
                       # the last report is scraped and the results written in time
SELF_CHECK = {"minutes": 6.0, "mark_s": 6.0}  # 36 s

# The sidecar's series read from each scrape (the allocator's totals, no pool breakdown).
ALLOC = "torch_cuda_allocator_"
GAUGES = ("reserved_bytes", "allocated_bytes", "requested_bytes", "peak_reserved_bytes",
          "peak_allocated_bytes")
COUNTERS = ("device_mallocs_total", "device_frees_total", "alloc_retries_total", "ooms_total")
CORE_KEYS = {"reserved_bytes": "reserved_bytes.all.current",
             "allocated_bytes": "allocated_bytes.all.current",
             "peak_reserved_bytes": "reserved_bytes.all.peak",
             "peak_allocated_bytes": "allocated_bytes.all.peak",
             "peak_requested_bytes": "requested_bytes.all.peak",
             "num_device_alloc": "num_device_alloc", "num_device_free": "num_device_free",
             "num_alloc_retries": "num_alloc_retries", "num_ooms": "num_ooms"}


# ------------------------------------------------------------------------------- the worker

class SimulatedMemory:
    """For --self-check: allocwatch's core on the simulated device, published by the agent. It
    holds a block for the weights and, while each step runs, blocks sized by the step's batch,
    as a model's activations are (the CPU build of torch runs on PyTorch's own CPU allocator,
    which the agent cannot publish)."""

    def __init__(self, target: str) -> None:
        import allocator_ext
        from allocator_ext.agent import start_agent

        self.core = allocator_ext.Allocator(allocator_ext.SimDevice())
        self.weights = self.core.malloc(8 << 20)
        self.agent = start_agent(target, interval=0.5, source=self.core, nvml=False)

    def hold(self, batch: Any) -> list[int]:
        tokens = batch[0].numel()
        return [self.core.malloc(tokens * k << 14) for k in (1, 2, 3, 4)]

    def release(self, blocks: list[int]) -> None:
        for block in reversed(blocks):
            self.core.free(block)


def core_figures(core: Any) -> dict[str, int]:
    stats = core.stats()
    return {name: int(stats.get(key, 0)) for name, key in CORE_KEYS.items()}


def worker(model: str, seconds: float, stop_at: float, mark_s: float, target: str | None) -> int:
    import torch

    import allocator_ext
    from allocator_ext import workloads

    sim = SimulatedMemory(target) if target else None
    if sim is None and not allocator_ext.installed():
        print("long_run worker: allocwatch's allocator is not installed (run it through "
              "`python -m exporter.cli run`)", flush=True)
        return 1
    device = torch.device("cpu" if sim else "cuda")
    work = workloads.build(model, device, tiny=sim is not None, seed=0)
    core = sim.core if sim else allocator_ext.allocator(0)

    def step(batch: Any) -> float:
        held = sim.hold(batch) if sim else []
        seconds = workloads.timed_step(work, batch)
        if sim:
            sim.release(held)
        return seconds

    def line(event: str, **fields: Any) -> None:
        print(json.dumps({"event": event, **fields, **core_figures(core)}), flush=True)

    started = time.time()
    workloads.meet_the_peak(work, step)  # the run's largest request, met at once
    line("start", wall=started, model=model,
         device="CPU; simulated device" if sim else torch.cuda.get_device_name(0),
         torch=torch.__version__, cuda=torch.version.cuda)
    end = min(started + seconds, stop_at)
    times: list[float] = []
    minute_times: list[float] = []
    next_mark = started + mark_s
    while time.time() < end:
        seconds_taken = step(work.draw())
        times.append(seconds_taken)
        minute_times.append(seconds_taken)
        now = time.time()
        if now >= next_mark:
            line("minute", minute=round((next_mark - started) / mark_s), t=round(now - started, 2),
                 steps=len(times), median_step_s=statistics.median(minute_times))
            minute_times = []
            next_mark += mark_s
    finished = time.time()
    line("end", t=round(finished - started, 2), steps=len(times),
         median_step_s=statistics.median(times) if times else None,
         stopped_by="minutes" if started + seconds <= stop_at else "deadline")
    if sim:
        sim.agent.stop(2.0)
    return 0


# ------------------------------------------------------------------------------- the driver

def scrape(url: str) -> dict[str, Any] | None:
    """The worker's figures from one scrape of the sidecar, or None while it shows none."""
    samples = sidecar_process.scrape(url, timeout=2)
    if samples is None:
        return None
    wanted = {ALLOC + name for name in (*GAUGES, *COUNTERS)}
    got: dict[str, Any] = {}
    series: set[tuple] = set()
    for name, labels, value in samples:
        if name in wanted:
            series.add(tuple(sorted(labels.items())))
            got.setdefault(name.removeprefix(ALLOC), value)
        elif name == ALLOC + "info":
            got.setdefault("backend", labels.get("backend"))
    if any(name not in got for name in (*GAUGES, *COUNTERS)):
        return None
    got["series"] = len(series)  # one worker: one series; more would mean another publisher
    return got


class WorkerLog:
    """The worker's lines in DIR/worker.log: its start (where the run's clock begins), its
    minute marks and its end; anything else (warnings) is kept in the file, not parsed."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def events(self) -> list[dict[str, Any]]:
        found = []
        if self.path.exists():
            for text in self.path.read_text(errors="replace").splitlines():
                if text.startswith('{"event"'):
                    try:
                        found.append(json.loads(text))
                    except json.JSONDecodeError:
                        pass  # a line still being written
        return found

    def start(self) -> dict[str, Any] | None:
        return next((e for e in self.events() if e["event"] == "start"), None)

    def tail(self, lines: int = 30) -> str:
        text = self.path.read_text(errors="replace") if self.path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def per_minute(samples: list[dict[str, Any]], mark_s: float) -> list[dict[str, Any]]:
    """Each minute's figures from the scrapes: the process's peak reserved at the minute's end,
    the highest reserved and allocated seen, and the device calls made within it."""
    if not samples:
        return []
    minutes = []
    previous = {"device_mallocs_total": 0.0, "device_frees_total": 0.0}
    for m in range(1, math.ceil(samples[-1]["t"] / mark_s + 1e-9) + 1):
        inside = [s for s in samples if (m - 1) * mark_s <= s["t"] < m * mark_s]
        if not inside:
            continue
        last = inside[-1]
        minutes.append({
            "minute": m, "samples": len(inside),
            "complete": samples[-1]["t"] >= m * mark_s,
            "peak_reserved_bytes": max(s["peak_reserved_bytes"] for s in inside),
            "peak_allocated_bytes": max(s["peak_allocated_bytes"] for s in inside),
            "max_reserved_bytes": max(s["reserved_bytes"] for s in inside),
            "max_allocated_bytes": max(s["allocated_bytes"] for s in inside),
            "device_mallocs": int(last["device_mallocs_total"] - previous["device_mallocs_total"]),
            "device_frees": int(last["device_frees_total"] - previous["device_frees_total"]),
        })
        previous = last
    return minutes


def verdict(samples: list[dict[str, Any]], mark_s: float, settle: int = SETTLE,
            bar: float = BAR) -> dict[str, Any]:
    """Peak reserved after minute `settle` against its value at minute `settle`'s end."""
    before = [s for s in samples if s["t"] < settle * mark_s]
    after = [s for s in samples if s["t"] >= settle * mark_s]
    result: dict[str, Any] = {"settle_minutes": settle, "bar": bar,
                              "rule": f"peak reserved after minute {settle} within "
                                      f"{bar:.1%} of its value at minute {settle}'s end"}
    if not before or not after:
        return {**result, "flat": None, "why": f"no scrape after minute {settle}" if before
                else f"no scrape within the first {settle} minutes"}
    base = max(s["peak_reserved_bytes"] for s in before)
    last = max(s["peak_reserved_bytes"] for s in after)
    growth = last / base - 1 if base else math.inf
    # The workload's own peak (peak allocated: its requests rounded to 512 bytes, the same under
    # any allocator). Where it grew after the mark, so may any allocator's peak reserved; what
    # the allocator adds is the peak reserved beyond it, judged against the same bar.
    base_allocated = max(s["peak_allocated_bytes"] for s in before)
    last_allocated = max(s["peak_allocated_bytes"] for s in after)
    beyond_growth = ((last - last_allocated) - (base - base_allocated)) / base if base else math.inf
    calls = {k: int(after[-1][k] - before[-1][k])
             for k in ("device_mallocs_total", "device_frees_total")}
    return {**result, "peak_reserved_at_settle_bytes": int(base),
            "peak_reserved_at_end_bytes": int(last), "growth": growth, "flat": growth <= bar,
            "peak_allocated_at_settle_bytes": int(base_allocated),
            "peak_allocated_at_end_bytes": int(last_allocated),
            "workload_peak_growth": last_allocated / base_allocated - 1 if base_allocated else 0.0,
            "reserved_beyond_allocated_growth": beyond_growth,
            "allocator_flat": beyond_growth <= bar,
            "device_mallocs_after_settle": calls["device_mallocs_total"],
            "device_frees_after_settle": calls["device_frees_total"],
            "minutes_observed": round(after[-1]["t"] / mark_s, 2)}


def plot(result: dict[str, Any], path: Path) -> None:
    """Reserved, allocated, peak reserved and peak allocated over time, minute marks, the
    settle mark and the bar above the peak at it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mark_s = result["mark_s"]
    samples = result["samples"]
    x = [s["t"] / mark_s for s in samples]
    gib = 2.0 ** 30
    fig, ax = plt.subplots(figsize=(11, 5.5), dpi=120)
    ax.plot(x, [s["peak_reserved_bytes"] / gib for s in samples], color="tab:red", lw=1.6,
            label="peak reserved (process)")
    ax.plot(x, [s["peak_allocated_bytes"] / gib for s in samples], color="tab:purple", lw=1.0,
            ls="--", label="peak allocated (the workload's own peak)")
    ax.plot(x, [s["reserved_bytes"] / gib for s in samples], color="tab:orange", lw=0.9,
            label="reserved (at each report)")
    ax.plot(x, [s["allocated_bytes"] / gib for s in samples], color="tab:blue", lw=0.7,
            label="allocated (at each report)")
    v = result["verdict"]
    if v.get("flat") is not None:
        ax.axhline(v["peak_reserved_at_settle_bytes"] * (1 + v["bar"]) / gib, color="tab:red",
                   ls=":", lw=1, label=f"bar: peak at minute {v['settle_minutes']} "
                                       f"+ {v['bar']:.1%}")
    ax.axvspan(0, v["settle_minutes"], color="0.95", zorder=0)  # the minutes to settle
    for m in range(1, math.ceil(max(x, default=0)) + 1):
        ax.axvline(m, color="0.8", lw=0.8, zorder=0)
    unit = "minutes" if mark_s == 60 else f"marks of {mark_s:g} s"
    ax.set_xlabel(f"time since the first step ({unit})")
    ax.set_ylabel("GiB")
    ax.set_ylim(bottom=0)
    ax.set_xlim(0, max(x, default=1))
    figure = ("no figure" if v.get("flat") is None else
              f"{v['growth']:+.3%} after minute {v['settle_minutes']} "
              f"({'flat' if v['flat'] else 'grew'}; bar {v['bar']:.1%}); the workload's own "
              f"peak {v['workload_peak_growth']:+.3%}, reserved beyond it "
              f"{v['reserved_beyond_allocated_growth']:+.3%}")
    ax.set_title(f"{result['model']} ({result['device']}) under allocwatch, agent publishing: "
                 f"peak reserved {figure}", loc="left", fontsize=10, wrap=True)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_plot(result: dict[str, Any], path: Path) -> str | None:
    """Draws the plot; the reason where it cannot be drawn (the JSON stands without it)."""
    try:
        plot(result, path)
    except ImportError as e:
        return (f"no plot ({e}): `python -m bench.gpu.long_run --replot JSON --plot {path.name}` "
                "draws it where matplotlib is installed")
    return None


def progress(minute: int, samples: list[dict[str, Any]], mark_s: float) -> str:
    now = samples[-1]
    settled = [s for s in samples if s["t"] < SETTLE * mark_s]
    growth = (f"{now['peak_reserved_bytes'] / settled[-1]['peak_reserved_bytes'] - 1:+.3%} "
              f"over minute {SETTLE}" if minute > SETTLE and settled else "settling")
    gib = 2.0 ** 30
    return (f"minute {minute}: peak reserved {now['peak_reserved_bytes'] / gib:.3f} GiB "
            f"({growth}), reserved {now['reserved_bytes'] / gib:.3f} GiB, allocated "
            f"{now['allocated_bytes'] / gib:.3f} GiB, device mallocs "
            f"{int(now['device_mallocs_total'])} frees {int(now['device_frees_total'])}")


def worker_command(args: argparse.Namespace, target: str, stop_at: float) -> list[str]:
    """The worker through `allocwatch run` (installed at torch's import, the agent publishing
    to `target`); in the self-check without --target: the worker publishes the simulated
    device's core itself."""
    run = [sys.executable, "-m", "exporter.cli", "run"]
    if not args.self_check:
        run += ["--target", target]
    inner = [sys.executable, "-u", "-m", __spec__.name, "--worker", "--model",
             args.model, "--minutes", repr(args.minutes), "--mark-s", repr(args.mark_s),
             "--stop-at", repr(stop_at)]
    if args.self_check:
        inner += ["--publish-to", target]
    return [*run, "--", *inner]


def drive(args: argparse.Namespace) -> int:
    began = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = Path(args.json) if args.json else out / "long_run.json"
    plot_path = Path(args.plot) if args.plot else out / "long_run.png"
    finish_by = began + args.minutes * args.mark_s + GRACE_S
    stop_at = finish_by - STOP_MARGIN_S

    sidecar = SidecarProcess("sidecar-", agents_yaml="  expiry_seconds: 300\n",
                             extra_yaml="admin:\n  enabled: false\n", parent=out).start()
    log = WorkerLog(out / "worker.log")
    # allocwatch's defaults (or --config) and this agent only: the caller's settings are left
    # out, except where the native back end is cached.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("ALLOCWATCH_") or k == "ALLOCWATCH_NATIVE_DIR"}
    if args.config:
        env["ALLOCWATCH_ALLOC_CONF"] = args.config
    launched = time.time()
    with log.path.open("wb") as log_file:
        work = subprocess.Popen(worker_command(args, sidecar.target, stop_at), cwd=REPO,
                                env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                start_new_session=True)
    print(f"long run: {args.model} for {args.minutes:g} x {args.mark_s:g} s, worker pid "
          f"{work.pid}, metrics {sidecar.metrics_url}, output in {out}", flush=True)
    start: dict[str, Any] | None = None
    samples: list[dict[str, Any]] = []
    printed = 0
    killed = False
    try:
        while True:
            exited = work.poll() is not None
            if start is None:
                start = log.start()
            got = scrape(sidecar.metrics_url)
            if got is not None and start is not None:
                got["t"] = round(time.time() - start["wall"], 3)
                samples.append(got)
                minute = int(got["t"] // args.mark_s)
                if minute > printed:
                    printed = minute
                    print(progress(minute, samples, args.mark_s), flush=True)
            if exited:
                break  # after the scrape of its last report
            if time.time() > finish_by - 8:  # past its own deadline: hung
                killed = True
                break
            time.sleep(SCRAPE_S)
    finally:
        if work.poll() is None:
            os.killpg(work.pid, signal.SIGKILL)
        work.wait()
        sidecar.stop()

    events = log.events()
    end = next((e for e in events if e["event"] == "end"), None)
    result: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(began)),
        "host": socket.gethostname(), "source": source_tree.label(),
        "model": args.model, "config": args.config or "defaults",
        "device": (start or {}).get("device", "?"),
        "torch": (start or {}).get("torch"), "cuda": (start or {}).get("cuda"),
        "minutes": args.minutes, "mark_s": args.mark_s,
        "agent_interval_s": 0.5 if args.self_check else 1.0, "scrape_interval_s": SCRAPE_S,
        "worker_exit": work.returncode, "worker_killed_at_deadline": killed,
        "worker_startup_s": round(start["wall"] - launched, 2) if start else None,
        "training_seconds": (end or {}).get("t"), "steps": (end or {}).get("steps"),
        "median_step_s": (end or {}).get("median_step_s"),
        "stopped_by": (end or {}).get("stopped_by"),
        "backend_published": samples[-1].get("backend") if samples else None,
        "series_seen": max((s["series"] for s in samples), default=0),
        "verdict": verdict(samples, args.mark_s),
        # The workload's own peak request, from the worker's core: flat from the first step
        # (its largest), so that growth of peak reserved is not the workload's.
        "peak_requested_bytes_at_marks": [e["peak_requested_bytes"] for e in events
                                          if e["event"] in ("start", "minute", "end")],
        "per_minute": per_minute(samples, args.mark_s),
        "worker_minutes": [e for e in events if e["event"] in ("start", "minute", "end")],
        "samples": samples,
    }
    problems = []
    if work.returncode != 0 or end is None:
        problems.append(f"the worker failed (exit {work.returncode}); worker.log ends:\n"
                        + log.tail())
    if not samples:
        problems.append("the agent's figures never appeared in the sidecar's /metrics")
    result["problems"] = problems
    result["plot"] = None
    if samples:
        result["plot_error"] = write_plot(result, plot_path)
        result["plot"] = None if result["plot_error"] else str(plot_path)
    json_path.write_text(json.dumps(result, indent=1))
    report(result, json_path)
    return 1 if problems else 0


def report(result: dict[str, Any], json_path: Path) -> None:
    report_verdict(result["verdict"])
    print(f"trained {result['training_seconds']} s ({result['steps']} steps, median "
          f"{result['median_step_s']} s, stopped by {result['stopped_by']}), worker start-up "
          f"{result['worker_startup_s']} s; published backend {result['backend_published']}")
    for problem in result["problems"]:
        print(f"problem: {problem}")
    if result.get("plot_error"):
        print(result["plot_error"])
    print(f"results: {json_path}" + (f", {result['plot']}" if result.get("plot") else ""),
          flush=True)


def report_verdict(v: dict[str, Any]) -> None:
    if v.get("flat") is None:
        print(f"verdict: none ({v['why']})")
    else:
        print(f"verdict: peak reserved {v['peak_reserved_at_settle_bytes']:,} B at minute "
              f"{v['settle_minutes']}, {v['peak_reserved_at_end_bytes']:,} B at the end: "
              f"{v['growth']:+.4%} ({'flat' if v['flat'] else 'NOT flat'}: bar {v['bar']:.1%}); "
              f"device mallocs after minute {v['settle_minutes']}: "
              f"{v['device_mallocs_after_settle']}, frees {v['device_frees_after_settle']}")
        print(f"  the workload's own peak (peak allocated) {v['workload_peak_growth']:+.4%} after "
              f"minute {v['settle_minutes']}; peak reserved beyond it "
              f"{v['reserved_beyond_allocated_growth']:+.4%} of the peak at minute "
              f"{v['settle_minutes']} ({'flat' if v['allocator_flat'] else 'NOT flat'})",
              flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", metavar="DIR", help="folder for everything the run leaves")
    p.add_argument("--minutes", type=float, default=8.0,
                   help="training time from the first step (default 8)")
    p.add_argument("--model", default="transformer", help="an allocator_ext.workloads training "
                   "workload: transformer (default), moe, convnet")
    p.add_argument("--config", metavar="STR", default="",
                   help="allocwatch settings for the worker (ALLOCWATCH_ALLOC_CONF), e.g. "
                        "settle_page_moves:False; default: allocwatch's defaults")
    p.add_argument("--json", metavar="FILE", help="default DIR/long_run.json")
    p.add_argument("--plot", metavar="FILE", help="default DIR/long_run.png")
    p.add_argument("--self-check", action="store_true", help="CPU: the plumbing (see above)")
    p.add_argument("--replot", metavar="JSON", help="draw --plot from a run's JSON and exit")
    # Internal: the worker, and the length of a "minute" (the self-check's are short).
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mark-s", type=float, default=60.0, help=argparse.SUPPRESS)
    p.add_argument("--stop-at", type=float, help=argparse.SUPPRESS)
    p.add_argument("--publish-to", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args.model, args.minutes * args.mark_s, args.stop_at or math.inf,
                      args.mark_s, args.publish_to)
    if args.replot:
        if not args.plot:
            p.error("--replot needs --plot FILE")
        result = json.loads(Path(args.replot).read_text())
        # Judged again from the samples, by this version's rule.
        result["verdict"] = verdict(result["samples"], result.get("mark_s", 60.0))
        why = write_plot(result, Path(args.plot))
        report_verdict(result["verdict"])
        print(why or f"drew {args.plot}")
        return 1 if why else 0
    if args.model not in ("transformer", "moe", "convnet"):
        p.error(f"--model {args.model!r}: one of transformer, moe, convnet")
    if args.minutes <= 0:
        p.error("--minutes must be above 0")
    if args.self_check:
        args.minutes, args.mark_s = SELF_CHECK["minutes"], SELF_CHECK["mark_s"]
    if not args.out:
        p.error("--out DIR is required")
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
