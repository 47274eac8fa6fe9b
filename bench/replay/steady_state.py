"""Reserved memory and device calls once a workload repeats: each trace's program replayed in
passes on one allocator, as the steps of a long training run repeat.

    python -m bench.replay.steady_state [--passes 200] [--long-passes 2000] [--config STR]
                                        [--cap F] [--traces GLOB ...] [--jobs N] [--json FILE]

Every trace (the shipped example, the shared traces beside the checkout, tests/data/traces) is
replayed --passes times with the defaults (or --config), and the shipped example once more
--long-passes times (by default only when --traces is not given). Each pass is the whole trace,
replayed as `allocwatch replay --passes` does (the same frees, the same waits for other streams),
and frees what it still holds at its end, so the next pass repeats the same requests on a warm
cache; its first pass is exactly what `allocwatch replay` reports.

Per run: peak reserved after pass 2 and after the last pass, and their ratio (a cache that keeps
growing on a repeating workload grows a long run into its cap), and the device calls of each
pass after pass 2 priced with the cost table measured on the H200
(allocator_ext/data/device_costs.json) as a share of the trace's active time, the measure the
replay's 2 % bar uses: what the setting costs every step once it has settled; and the address
space mapped beyond reserved memory at the end of pass 2 and of the last (aliased pages,
alias_pages, map one page at several addresses: a setting whose step keeps mapping its pages at
new addresses grows the driver's mappings without bound while reserved memory stays flat). The
bar: the last pass within 0.2 % of pass 2's peak reserved, its addresses beyond reserved grown
by at most 0.2 % of that peak, and every pass after pass 2 at most 0.1 %.
Counts from the simulated device: the same on any machine. --jobs replays runs side by side.

--cap F replays every pass on a device capped at F x the trace's peak requested bytes (1.03:
the pressure measure's cap), and counts each pass's allocation retries and out-of-memory
errors: a cache that creeps runs into the cap in a later pass where the first fitted.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import multiprocessing
import queue
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from allocator_ext.replay import load_trace, replay
from allocator_ext.replay.engine import STEADY_GROWTH_MARGIN, mapped_beyond_reserved
from allocator_ext.replay.progress import progress_bar
from allocator_ext.replay.trace import peak_requested_bytes
from bench import REPO

EXAMPLE = REPO / "allocator_ext/data/example_trace.pickle.gz"
DEFAULT_TRACES = [str(EXAMPLE), str(REPO.parent / "shared/traces/*.pickle.gz"),
                  str(REPO / "tests/data/traces/*.pickle.gz")]
SHOWN = ("create", "map_only", "unmap", "release", "synchronize")
SETTLED_AFTER = 2        # passes that only grow the cache
RESERVED_GROWTH_BAR = STEADY_GROWTH_MARGIN
CALL_SHARE_BAR = 0.001


@dataclass(frozen=True)
class Run:
    path: str
    passes: int
    long: bool = False  # the long run of the example, named apart from its ordinary run
    cap: float = 0.0    # the device capped at this multiple of the peak requested (0: none)

    @property
    def name(self) -> str:
        return Path(self.path).name + (f" x{self.passes}" if self.long else "")


def replay_passes(run: Run, config: str | None, done: Any = None) -> list[dict[str, float]]:
    """Per pass: peak reserved so far, reserved at its end, the calls of each shown kind, and
    `call_share` (all its calls priced / the trace's active time), from `allocwatch replay
    --passes`'s figures. `done(events)` with the events replayed since the last call."""
    trace = load_trace(run.path)
    reported = [0]

    def progress(events: int) -> None:
        if done is not None and events > reported[0]:
            done(events - reported[0])
            reported[0] = events

    device_memory = int(run.cap * peak_requested_bytes(trace)) if run.cap else 0
    passes = replay(trace, config, device_memory=device_memory, progress=progress,
                    passes=run.passes).report["passes"]
    return [{**{k: p["device_calls"].get(k, {}).get("count", 0) for k in SHOWN},
             "call_share": p["device_call_share"],
             "peak_reserved_bytes": p["peak_reserved_bytes"],
             "reserved_bytes": p["reserved_bytes_at_end"],
             "mapped_beyond_reserved_bytes": mapped_beyond_reserved(p),
             "num_alloc_retries": p["num_alloc_retries"], "num_ooms": p["num_ooms"]}
            for p in passes]


def summarize(rows: list[dict[str, float]]) -> dict[str, Any]:
    settled = rows[SETTLED_AFTER - 1]["peak_reserved_bytes"]
    last = rows[-1]["peak_reserved_bytes"]
    later = [r["call_share"] for r in rows[SETTLED_AFTER:]]
    growth = last / settled if settled else 1.0
    beyond = [r["mapped_beyond_reserved_bytes"] for r in (rows[SETTLED_AFTER - 1], rows[-1])]
    summary: dict[str, Any] = {
        "passes": len(rows),
        "peak_reserved_after_pass_2": settled,
        "peak_reserved_after_last_pass": last,
        "peak_reserved_last_over_pass_2": growth,
        "mapped_beyond_reserved_after_pass_2": beyond[0],
        "mapped_beyond_reserved_after_last_pass": beyond[1],
        "call_share_after_pass_2_mean": sum(later) / len(later) if later else 0.0,
        "call_share_after_pass_2_max": max(later, default=0.0),
        "first_pass_call_share": rows[0]["call_share"],
        "first_pass_ooms": rows[0]["num_ooms"],
        "ooms_after_pass_1": sum(r["num_ooms"] for r in rows[1:]),
        "retries_after_pass_1": sum(r["num_alloc_retries"] for r in rows[1:]),
    }
    summary["meets_bar"] = (growth <= 1 + RESERVED_GROWTH_BAR
                            and beyond[1] - beyond[0] <= RESERVED_GROWTH_BAR * settled
                            and summary["call_share_after_pass_2_max"] <= CALL_SHARE_BAR)
    return summary


# Worker processes report events done through a queue the parent draws the bar from.
_progress: Any = None


def _init_worker(progress: Any) -> None:
    global _progress
    _progress = progress


def _replay_in_worker(run: Run, config: str | None) -> list[dict[str, float]]:
    return replay_passes(run, config, _progress.put)


def replay_all(runs: list[Run], config: str | None, jobs: int
               ) -> Iterator[tuple[str, list[dict[str, float]]]]:
    """Each run's name and rows, in the order of `runs` as each is done, with a progress bar
    over all their events on a terminal."""
    total = sum(len(load_trace(r.path).events) * r.passes for r in runs)
    done = [0]
    with progress_bar(total, "passes", quiet=False) as bar:
        def advance(events: int) -> None:
            done[0] += events
            if bar is not None:
                bar(done[0])

        if jobs <= 1:
            for r in runs:
                yield r.name, replay_passes(r, config, advance)
            return
        ctx = multiprocessing.get_context("spawn")
        events: Any = ctx.Queue()
        with ctx.Pool(jobs, _init_worker, (events,)) as pool:
            pending = [(r.name, pool.apply_async(_replay_in_worker, (r, config))) for r in runs]
            for name, result in pending:
                while not result.ready():
                    try:
                        advance(events.get(timeout=0.5))
                    except queue.Empty:
                        pass
                yield name, result.get()


def _runs(args: argparse.Namespace) -> list[Run]:
    paths = sorted({f for g in (args.traces or DEFAULT_TRACES) for f in glob.glob(g)},
                   key=lambda p: (Path(p) != EXAMPLE, Path(p).parent.name, Path(p).name))
    runs = [Run(p, args.passes, cap=args.cap) for p in paths]
    long_passes = args.long_passes if args.long_passes is not None else (
        0 if args.traces else 2000)
    if long_passes:
        runs.append(Run(str(EXAMPLE), long_passes, long=True, cap=args.cap))
    return runs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="allocator settings (default: allocwatch's)")
    p.add_argument("--passes", type=int, default=200)
    p.add_argument("--cap", type=float, default=0.0, metavar="F",
                   help="cap the device at F x each trace's peak requested bytes (e.g. 1.03) "
                        "and count each pass's retries and out-of-memory errors")
    p.add_argument("--long-passes", type=int, metavar="N",
                   help="passes of the shipped example trace, a run of its own (default: 2000 "
                        "with the default traces, 0 with --traces)")
    p.add_argument("--traces", action="append", metavar="GLOB")
    p.add_argument("--jobs", type=int, default=1, help="runs replayed side by side")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    if args.passes < SETTLED_AFTER + 1:
        p.error(f"--passes must be at least {SETTLED_AFTER + 1} (the first {SETTLED_AFTER} "
                "only grow the cache)")
    if args.long_passes is not None and 0 < args.long_passes < SETTLED_AFTER + 1:
        p.error(f"--long-passes must be 0 or at least {SETTLED_AFTER + 1}")
    if args.jobs < 1:
        p.error("--jobs must be at least 1")
    if args.cap and args.cap < 1.0:
        p.error(f"--cap must be at least 1.0 (the trace's own peak), not {args.cap}")
    runs = _runs(args)
    if not runs:
        p.error("no trace matched")

    print(f"{'run':36s} {'passes':>6s} {'peak reserved pass 2':>21s} {'last/pass 2':>11s} "
          f"{'calls after pass 2, mean / max':>31s} {'mapped beyond, pass 2 / last':>29s}  bar",
          flush=True)
    rows: dict[str, list[dict[str, float]]] = {}
    summaries: dict[str, dict[str, Any]] = {}
    for name, run_rows in replay_all(runs, args.config, args.jobs):
        rows[name] = run_rows
        s = summaries[name] = summarize(run_rows)
        share = (f"{s['call_share_after_pass_2_mean']:.3%} / "
                 f"{s['call_share_after_pass_2_max']:.3%}")
        print(f"{name[:36]:36s} {s['passes']:6d} "
              f"{s['peak_reserved_after_pass_2'] / 2**30:17.3f} GiB "
              f"{s['peak_reserved_last_over_pass_2']:11.4f} {share:>31s} "
              f"{s['mapped_beyond_reserved_after_pass_2'] / 2**30:13.3f} / "
              f"{s['mapped_beyond_reserved_after_last_pass'] / 2**30:7.3f} GiB  "
              f"{'ok' if s['meets_bar'] else 'MISS'}"
              + (f"  OOMs pass 1 / later {s['first_pass_ooms']} / {s['ooms_after_pass_1']}, "
                 f"retries later {s['retries_after_pass_1']}" if args.cap else ""), flush=True)
    met = sum(s["meets_bar"] for s in summaries.values())
    print(f"{met} of {len(summaries)} runs meet the bar (last pass within "
          f"{RESERVED_GROWTH_BAR:.1%} of pass 2's peak reserved, and so the address space mapped "
          f"beyond reserved, every pass after pass 2 at most {CALL_SHARE_BAR:.1%} of the "
          f"trace's active time)")
    if args.cap:
        late = [n for n, s in summaries.items() if s["ooms_after_pass_1"] and not
                s["first_pass_ooms"]]
        print(f"under {args.cap:g} x: {len(late)} runs ran out of memory only after their "
              f"first pass{': ' + ', '.join(late) if late else ''}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": " ".join(sys.argv), "config": args.config, "cap": args.cap,
            "date": datetime.date.today().isoformat(),
            "bar": {"peak_reserved_last_over_pass_2": 1 + RESERVED_GROWTH_BAR,
                    "mapped_beyond_reserved_growth_over_peak": RESERVED_GROWTH_BAR,
                    "call_share_after_pass_2_max": CALL_SHARE_BAR},
            "summary": summaries, "passes": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
