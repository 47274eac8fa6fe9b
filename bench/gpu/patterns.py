"""Every pattern of the workload library on the GPU, side by side under PyTorch's default
allocator, its expandable segments and allocwatch's, uncapped and under a memory fraction of
1.03 x each process's peak requested bytes, in one table.

    python -m bench.gpu.patterns run DIR [--only NAME ...] [--quick] [--rounds 8]
                                         [--steps N] [--ours NAME] [--also NAME ...]  (on a GPU)
    python -m bench.gpu.patterns table DIR [DIR ...] [--markdown FILE] [--json FILE]
    python -m bench.gpu.patterns names           # the patterns, one a line (for shell loops)

`run` times each pattern with bench.gpu.step_lockstep: three processes, one per allocator, in
lockstep on one GPU and one CPU core, after an untimed warm-up; --rounds timed rounds (8, the
bar's least) of each pattern's steps per round on shapes drawn afresh, uncapped and then
capped, every pair of processes meeting in both orders. It writes DIR/lockstep_<pattern>.json
(after every round) and then the table of every file in DIR. A pattern whose library does
not import is skipped, saying why; a compiling pattern (reduce_overhead) is compiled once
first in a process of its own, so that the three timed processes find inductor's caches
filled. --quick runs fewer steps a round (each pattern's QUICK), --steps sets one count for
all. --ours picks the allocator judged (an entry of bench.lib.allocators, default allocwatch's)
and --also adds processes of other allocators to the same lockstep: a setting judged against
allocwatch's defaults, step by step, beside PyTorch's two (`--ours
allocwatch-unmap-off-thread --also allocwatch`); the step ratio is then against the fastest of
all the others, and the table gives each.

`table` reads the lockstep files of one or more such folders (the calls of a GPU session that
split the patterns among them) and writes one row per pattern and cap:
- peak reserved ÷ peak requested of each allocator over the phase (its warm-up, which meets
  the pattern's largest shapes, included);
- the floor: the least any allocator under the core's rules could reserve
  (allocator_ext.replay.floor), from the pattern's trace recorded under PyTorch's defaults in
  tests/data/traces: its recording of this very program where there is one
  (`record_traces --lockstep`), else its plain recording (— where none is recorded); the
  fragmentation bar is 1.01, or the floor + 0.01 where it is above 1.00;
- allocwatch's step time over the faster of the other two (the one of less total step time
  in those rounds): the median per-step ratio, with its 95 % interval over the rounds
  resampled (bench.gpu.lockstep_pool's), the bar being <= 1.00;
- allocwatch's host waits a step (num_host_waits.device / .stream / .event / .unmap_thread,
  and its device-side stream waits), n/a for PyTorch's allocators, which count none;
- device calls a step (num_device_alloc + num_device_free + num_sync_all_streams: mappings,
  not calls) of each allocator, and allocwatch's driver calls a step behind them
  (num_device_calls.*: one a page mapped or unmapped, creates, releases, access grants, events
  recorded and queried), and
  allocation retries of each allocator; an allocator whose process ran out of memory under the
  cap is marked OOM, and the faster of the others is the one compared (none where both ran
  out: then allocwatch's memory and retries stand alone).
Printed as markdown (and written with --markdown), and as JSON with --json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from allocator_ext.protocol.metrics import WAIT_SCOPES
from bench import REPO
from bench.lib.allocators import ALLOCATORS

OURS = "allocwatch"
BASELINES = ("pytorch", "expandable")
LABELS = {"pytorch": "default", "expandable": "expandable", "allocwatch": "allocwatch"}
FRACTION = 1.03
TRACES = REPO / "tests/data/traces"


@dataclass(frozen=True)
class Pattern:
    trace: str     # its recording under PyTorch's defaults: TRACES/<trace>__default.pickle.gz
    steps: int     # steps a round (and in the warm-up)
    quick: int     # the same with --quick
    compiles: bool = False


# Steps a round from each step's time on an H100: about a second of steps a round and process
# in full, a third of that quick.
PATTERNS = {
    "transformer": Pattern("gpt_varlen", 12, 4),
    "moe": Pattern("moe", 12, 4),
    "convnet": Pattern("convnet", 12, 4),
    "kv_generate": Pattern("kv_generate", 6, 2),
    "detection": Pattern("detection", 6, 2),
    "graph": Pattern("graph", 24, 8),
    "trainer": Pattern("trainer", 12, 4),
    "fsdp2": Pattern("fsdp2", 12, 4),
    "stream_pipeline": Pattern("stream_pipeline", 36, 12),
    "reduce_overhead": Pattern("reduce_overhead", 24, 8, compiles=True),
}


# ---------------------------------------------------------------------------------- running

def prewarm(name: str, steps: int, seed: int, self_check: bool) -> float:
    """Compiles pattern `name` once in a process of its own (PyTorch's allocator, every core):
    the lockstep warm-up's shapes (`steps` of `seed`'s), so that inductor's caches on disk hold
    its graphs. Seconds taken."""
    started = time.perf_counter()
    code = ("import sys, torch\n"
            "from allocator_ext import workloads\n"
            "device = torch.device(sys.argv[2])\n"
            "work = workloads.build(sys.argv[1], device, tiny=device.type == 'cpu', seed=0)\n"
            "workloads.warm_up(work, int(sys.argv[3]), int(sys.argv[4]))\n")
    subprocess.run([sys.executable, "-c", code, name, "cpu" if self_check else "cuda",
                    str(steps), str(seed)], check=True,
                   env=dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=""))
    return time.perf_counter() - started


def run(out_dir: Path, names: list[str], rounds: int, steps: int | None, quick: bool,
        self_check: bool, ours: str = OURS, also: tuple[str, ...] = ()) -> int:
    from allocator_ext import workloads
    from bench.gpu import step_lockstep

    out_dir.mkdir(parents=True, exist_ok=True)
    against = [a for a in dict.fromkeys([*BASELINES, *also]) if a != ours]
    if self_check:  # no allocwatch on the CPU: PyTorch's allocator judged, against itself too
        ours, against = "pytorch", ["expandable", "pytorch"]
    cores = step_lockstep.pin_parent("")
    failed = []
    for name in names:
        out = out_dir / f"lockstep_{name}.json"
        why = workloads.unavailable(name)
        if why:  # a row that says so, not a missing one
            print(f"{name}: skipped: {why}", flush=True)
            out.write_text(json.dumps({"model": name, "ours": ours, "phases": [],
                                       "failures": [f"skipped: {why}"]}))
            failed.append(name)
            continue
        pattern = PATTERNS[name]
        count = steps or (pattern.quick if quick else pattern.steps)
        started = time.perf_counter()
        if pattern.compiles:
            seconds = prewarm(name, count, step_lockstep.WARMUP_SEED, self_check)
            print(f"{name}: compiled once first, {seconds:.0f} s", flush=True)
        result = step_lockstep.run_workload(
            name, ours, against, [0.0, FRACTION], rounds, count, cores, self_check, out)
        print(f"{name}: {time.perf_counter() - started:.0f} s", flush=True)
        if not step_lockstep.succeeded(result):
            failed.append(name)
    rows = table_rows([out_dir])
    print(markdown(rows, [out_dir]))
    if failed:
        print(f"not timed in full: {', '.join(failed)}")
    return 1 if failed else 0


# ---------------------------------------------------------------------------------- the table

def floor_of(name: str, cache: dict[str, float | None]) -> float | None:
    """The floor ratio of the pattern's trace, None where it is not recorded: the recording of
    the lockstep program itself where there is one (the row's own program: its warm-up at the
    largest shapes changes which frees wait where), else the pattern's plain recording."""
    if name not in cache:
        from allocator_ext.replay import load_trace
        from allocator_ext.replay.floor import reserved_floor

        trace = PATTERNS[name].trace if name in PATTERNS else name
        paths = [TRACES / f"{trace}__default_lockstep.pickle.gz",
                 TRACES / f"{trace}__default.pickle.gz"]
        path = next((p for p in paths if p.exists()), None)
        cache[name] = reserved_floor(load_trace(path)).ratio if path else None
    return cache[name]


def phase_row(result: dict[str, Any], phase: dict[str, Any], floor: float | None
              ) -> dict[str, Any]:
    ours = result["ours"]
    names = list(phase.get("phase_reserved_over_requested") or {})
    left = phase.get("left", {})
    # The processes in the order the run started them (the table's heading), those that left
    # under the cap in their place: a phase lists only the processes still running.
    started = [n for n in result.get("others") or [] if n != ours]
    others = started + [n for n in dict.fromkeys([*names, *left]) if n != ours
                        and n not in started]
    timed = {n: vs for n, vs in (phase.get("against") or {}).items()
             if vs is not None and n not in left}
    faster = max(timed, key=lambda n: timed[n]["step_time_s"][ours] / timed[n]["step_time_s"][n],
                 default=None)
    vs = timed.get(faster) if faster else None
    return {
        "pattern": result["model"], "fraction_of_peak": phase["fraction_of_peak"],
        "ours": ours, "others": others,
        "reserved_over_requested": phase.get("phase_reserved_over_requested", {}),
        "floor": floor,
        "faster_other": faster,
        "step_ratio": vs["median_step_ratio"] if vs else None,
        "step_ratio_interval_95": vs["interval_95"] if vs else None,
        "rounds": vs["rounds"] if vs else 0,
        "steps_compared": vs["steps_compared"] if vs else 0,
        "step_ratio_against": {n: v["median_step_ratio"] for n, v in timed.items()},
        "host_waits_per_step": (phase.get("host_waits_per_step") or {}).get(ours),
        "device_calls_per_step": {n: (c or {}).get("all") for n, c in
                                  (phase.get("device_calls_per_step") or {}).items()},
        "driver_calls_per_step": ((phase.get("driver_calls_per_step") or {}).get(ours)
                                  or {}).get("all"),
        "num_alloc_retries": phase.get("num_alloc_retries", {}),
        "num_ooms": phase.get("num_ooms", {}),
        "left": left, "failures": phase.get("failures", []),
        "source": result.get("source"), "device": result.get("device"),
    }


def table_rows(folders: list[Path]) -> list[dict[str, Any]]:
    """One row per pattern and cap from the lockstep files in `folders` (a pattern timed in
    several folders: the last folder's)."""
    files: dict[str, Path] = {}
    for folder in folders:
        found = sorted(folder.glob("lockstep_*.json"))
        if not found:
            raise ValueError(f"{folder}: no lockstep_<pattern>.json in it")
        for path in found:
            files[path.stem.removeprefix("lockstep_")] = path
    order = {n: i for i, n in enumerate(PATTERNS)}
    floors: dict[str, float | None] = {}
    rows = []
    for name in sorted(files, key=lambda n: (order.get(n, len(order)), n)):
        try:
            result = json.loads(files[name].read_text())
            phases = result["phases"]
            missing = {"model", "ours"} - set(result)
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{files[name]}: not a step_lockstep result "
                             f"({type(e).__name__}: {e})") from None
        if missing:
            raise ValueError(f"{files[name]}: not a step_lockstep result (no "
                             f"{', '.join(sorted(missing))})")
        if not phases:
            rows.append({"pattern": result["model"], "fraction_of_peak": None,
                         "failures": result.get("failures", ["no phase ran"])})
            continue
        for phase in phases:
            rows.append(phase_row(result, phase, floor_of(name, floors)))
    return rows


def _ratio(v: float | None) -> str:
    return "—" if v is None else f"{v:.3f}"


def _count(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}".rstrip("0").rstrip(".")


def _each(row: dict[str, Any], values: dict[str, Any], show: Any) -> str:
    """The others' values then ours, as "a / b / c" (OOM for one that left)."""
    names = [*row["others"], row["ours"]]
    return " / ".join("OOM" if n in row["left"] else show(values.get(n)) for n in names)


def markdown(rows: list[dict[str, Any]], folders: list[Path]) -> str:
    if not rows:
        return "(no lockstep results)"
    # The heading names the processes of the first row that ran (a table of failures only:
    # allocwatch's and PyTorch's two).
    first = next((r for r in rows if r.get("fraction_of_peak") is not None),
                 {"others": list(BASELINES), "ours": OURS})
    order = " / ".join(LABELS.get(n, n) for n in [*first["others"], first["ours"]])
    lines = [
        f"| pattern | cap | peak reserved ÷ peak requested ({order}) | floor | step time, "
        f"{first['ours']} ÷ the faster other (95 % interval) | host waits a step, "
        f"{first['ours']} (device / stream / event / unmap thread; stream waits) | device "
        f"calls a step ({order}; {first['ours']}'s driver calls) | allocation retries "
        f"({order}) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        if row.get("fraction_of_peak") is None:
            lines.append(f"| {row['pattern']} | — | failed: {'; '.join(row['failures'])[:200]} "
                         f"| | | | | |")
            continue
        cap = f"{row['fraction_of_peak']:g} ×" if row["fraction_of_peak"] else "uncapped"
        if row["step_ratio"] is None:
            step = "failed: " + "; ".join(row["failures"])[:160] if row["failures"] else "—"
        else:
            low, high = row["step_ratio_interval_95"]
            step = (f"**{row['step_ratio']:.3f}** ({low:.3f}–{high:.3f}) vs "
                    f"{LABELS.get(row['faster_other'], row['faster_other'])}, "
                    f"{row['rounds']} round{'s' if row['rounds'] != 1 else ''}")
        waits = row["host_waits_per_step"]
        shown = "n/a" if waits is None else (
            " / ".join(_count(waits.get(f"num_host_waits.{scope}")) for scope in WAIT_SCOPES)
            + f"; {_count(waits.get('num_stream_waits'))}")
        lines.append(f"| {row['pattern']} | {cap} | "
                     f"{_each(row, row['reserved_over_requested'], _ratio)} | "
                     f"{_ratio(row['floor'])} | {step} | {shown} | "
                     f"{_each(row, row['device_calls_per_step'], _count)}; "
                     f"{_count(row.get('driver_calls_per_step'))} | "
                     f"{_each(row, row['num_alloc_retries'], _count)} |")
    sources = sorted({str(r["source"]) for r in rows if r.get("source")})
    devices = sorted({str(r["device"]) for r in rows if r.get("device")})
    lines += ["", f"Lockstep files: {', '.join(str(f) for f in folders)}; source "
                  f"{', '.join(sources) or 'unknown'}; device {', '.join(devices) or 'unknown'}."]
    return "\n".join(lines)


def table(folders: list[Path], markdown_out: Path | None, json_out: Path | None) -> int:
    try:
        rows = table_rows(folders)
    except ValueError as e:
        print(f"patterns: {e}", file=sys.stderr)
        return 2
    text = markdown(rows, folders)
    print(text)
    if markdown_out:
        markdown_out.write_text(text + "\n")
    if json_out:
        json_out.write_text(json.dumps({
            "command": " ".join([Path(sys.executable).name, "-m", __spec__.name, *sys.argv[1:]]),
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "folders": [str(f) for f in folders], "rows": rows}, indent=1))
    return 0


# ---------------------------------------------------------------------------------- commands

def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="time every pattern on the GPU, then print the table")
    r.add_argument("out", type=Path, help="folder for lockstep_<pattern>.json")
    r.add_argument("--only", nargs="+", metavar="NAME", help="these patterns only")
    r.add_argument("--rounds", type=int, default=8, help="timed rounds per cap (default 8)")
    r.add_argument("--steps", type=int, help="steps a round for every pattern")
    r.add_argument("--quick", action="store_true", help="each pattern's quick steps a round")
    r.add_argument("--ours", choices=sorted(ALLOCATORS), default=OURS,
                   help="the allocator judged (default allocwatch's defaults)")
    r.add_argument("--also", choices=sorted(ALLOCATORS), nargs="+", default=[], metavar="NAME",
                   help="more allocators in the same lockstep, beside PyTorch's default and "
                        "expandable segments (e.g. allocwatch, with --ours a setting's entry)")
    r.add_argument("--self-check", action="store_true",
                   help="the same on the CPU with tiny workloads (PyTorch's allocator judged)")
    t = sub.add_parser("table", help="the table of lockstep files already written")
    t.add_argument("folders", type=Path, nargs="+")
    t.add_argument("--markdown", type=Path, metavar="FILE", help="write the table here too")
    t.add_argument("--json", type=Path, metavar="FILE", help="write the rows here as JSON")
    sub.add_parser("names", help="the patterns, one a line")
    args = p.parse_args()
    if args.command == "names":
        print("\n".join(PATTERNS))
        return 0
    if args.command == "table":
        return table(args.folders, args.markdown, args.json)
    unknown = sorted(set(args.only or []) - set(PATTERNS))
    if unknown:
        p.error(f"unknown pattern(s) {', '.join(unknown)}; known: {', '.join(PATTERNS)}")
    if args.rounds < 1 or (args.steps is not None and args.steps < 1):
        p.error("--rounds and --steps must be at least 1")
    return run(args.out, args.only or list(PATTERNS), args.rounds, args.steps, args.quick,
               args.self_check, args.ours, tuple(args.also))


if __name__ == "__main__":
    sys.exit(main())
