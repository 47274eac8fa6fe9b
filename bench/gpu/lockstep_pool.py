"""Pools the per-step ratios of several step_lockstep.py runs into one verdict per workload and cap.

    python -m bench.gpu.lockstep_pool FILE [FILE ...] [--judged allocwatch] [--json OUT]

One lockstep run of 8 rounds spreads by about a percent either way, as much as the differences
sought, so the verdict on the step-time bar (median per-step ratio <= 1.00 at two decimals)
is taken over every run of a setting together. Each FILE is a --json output of
step_lockstep.py (a --suite's lockstep_<workload>.json included); its steps are grouped by
workload, memory cap (uncapped, or the fraction of peak requested) and the allocator compared
with, so that runs against different allocators never pool together. A run that timed the
judged allocator as --against (its process first) counts with its ratios inverted, so that
every ratio pooled is judged / other; a run of several processes gives one group for each
allocator its --ours was timed against. A file that did not time the judged allocator, or one
that is not a lockstep result, is refused by name, and nothing is reported.

Reported per group: the runs, the steps, each run's median and the pooled median per-step
ratio, with the verdict against the bar; how far the pooled median can be trusted, as its 95 %
interval over the rounds resampled (a round's steps share a seed and a spell of the host, so
the round, not the step, is the unit drawn; the draws are seeded, so a rerun gives the same
interval), and whether the verdict holds at both ends of it (`settled`). Two processes of one
allocator differ too, by about as much as the rounds of one run (the harness against itself
shows it), so where a setting has several runs there is a second, wider
interval that draws the runs (each a pair of processes) before their rounds, and whether the
verdict holds at both of its ends (`settled_across_processes`); and the median over
the steps whose shape is new to the run against those of a shape it timed before (with
shapes drawn afresh most are new; what a step costs the host then is mostly planning for the
new shape: cuDNN's plans for each convolution, the MoE's routing).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

BAR = 1.00  # the median per-step ratio a setting must not exceed, at two decimals
RESAMPLES = 2000  # draws of the rounds for the interval of the pooled median
INTERVAL_SEED = 0


class PoolError(ValueError):
    """A file that cannot be pooled, named with why."""


class Round:
    """One timed round's ratios (judged / other) and, per step, whether its shape was new to the
    run (None where the run did not record shapes)."""

    def __init__(self, ratios: list[float], new_shape: list[bool] | None) -> None:
        self.ratios = ratios
        self.new_shape = new_shape


def judged_rounds(path: Path, judged: str) -> list[tuple[str, float, str, list[Round]]]:
    """(workload, fraction of peak, the other allocator, rounds judged / other) for each phase
    of the run in `path`."""
    try:
        result = json.loads(path.read_text())
        ours, against, model = result["ours"], result["against"], result["model"]
        phases = result["phases"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise PoolError(f"{path}: not a step_lockstep.py result "
                        f"({type(e).__name__}: {e})") from None
    others = result.get("others", [against])
    if judged not in (ours, *others) or ours in others:
        raise PoolError(f"{path}: times {ours} against {', '.join(others)}, not {judged} "
                        f"against another allocator")
    out: list[tuple[str, float, str, list[Round]]] = []
    for phase in phases:
        fraction = float(phase.get("fraction_of_peak") or 0.0)
        seen: set[str] = set()
        by_other: dict[str, list[Round]] = {}
        for rnd in phase.get("rounds", []):
            # A run of several processes has ours over each other (step_ratios_against: none
            # in a round ours ran alone); an earlier run of two, over its one other
            # (step_ratios).
            against_each = (rnd["step_ratios_against"] if "step_ratios_against" in rnd
                            else {against: rnd["step_ratios"]})
            shapes = rnd.get("shapes")
            new_shape = None
            if shapes is not None:
                keys = [json.dumps(shape) for shape in shapes]
                new_shape = [key not in seen for key in keys]
                seen.update(keys)
            for other, ratios in against_each.items():
                if judged == ours:
                    pair = (other, list(ratios))
                elif judged == other:  # the judged allocator's process was the other one
                    pair = (ours, [1.0 / r for r in ratios])
                else:
                    continue
                fits = new_shape if new_shape and len(new_shape) == len(ratios) else None
                by_other.setdefault(pair[0], []).append(Round(pair[1], fits))
        out.extend((model, fraction, other, rounds) for other, rounds in by_other.items())
    return out


def _interval(resample: Callable[[random.Random], list[float]],
              seed: int = INTERVAL_SEED) -> tuple[float, float]:
    """The 95 % interval of the median of the ratios `resample` draws, over RESAMPLES draws."""
    draw = random.Random(seed)
    medians = sorted(statistics.median(resample(draw)) for _ in range(RESAMPLES))
    return medians[int(0.025 * RESAMPLES)], medians[int(0.975 * RESAMPLES) - 1]


def median_interval(rounds: list[Round]) -> tuple[float, float]:
    """The 95 % interval of the median per-step ratio over `rounds` drawn with replacement."""
    return _interval(lambda draw: [r for rnd in draw.choices(rounds, k=len(rounds))
                                   for r in rnd.ratios])


def median_interval_across_processes(runs: list[list[Round]]) -> tuple[float, float]:
    """The 95 % interval of the median per-step ratio with the runs drawn with replacement,
    then each drawn run's rounds: the spread between pairs of processes counts, as well as
    the spread between rounds."""
    return _interval(lambda draw: [r for run in draw.choices(runs, k=len(runs))
                                   for rnd in draw.choices(run, k=len(run)) for r in rnd.ratios])


def by_shape(rounds: list[Round]) -> dict[str, Any] | None:
    """Median ratio and count of the steps of a shape new to the run, and of the others."""
    if any(rnd.new_shape is None for rnd in rounds):
        return None
    split: dict[bool, list[float]] = {True: [], False: []}
    for rnd in rounds:
        for ratio, new in zip(rnd.ratios, rnd.new_shape or [], strict=True):
            split[new].append(ratio)
    return {"new": {"steps": len(split[True]), "median_step_ratio":
                    statistics.median(split[True]) if split[True] else None},
            "repeated": {"steps": len(split[False]), "median_step_ratio":
                         statistics.median(split[False]) if split[False] else None}}


def meets(median: float) -> bool:
    return round(median, 2) <= BAR


def pool(paths: list[Path], judged: str) -> list[dict[str, Any]]:
    # Runs against different allocators are different comparisons: never pooled together.
    groups: dict[tuple[str, float, str], dict[str, Any]] = {}
    for path in paths:
        for model, fraction, other, rounds in judged_rounds(path, judged):
            ratios = [r for rnd in rounds for r in rnd.ratios]
            if not ratios:
                continue
            group = groups.setdefault((model, fraction, other), {
                "workload": model, "fraction_of_peak": fraction, "against": other, "runs": [],
                "rounds_by_run": []})
            group["runs"].append({"file": str(path), "steps": len(ratios),
                                  "median_step_ratio": statistics.median(ratios)})
            group["rounds_by_run"].append([rnd for rnd in rounds if rnd.ratios])
    rows = []
    for key in sorted(groups):
        group = dict(groups[key])
        by_run = group.pop("rounds_by_run")
        rounds = [rnd for run in by_run for rnd in run]
        ratios = [r for rnd in rounds for r in rnd.ratios]
        median = statistics.median(ratios)
        low, high = median_interval(rounds)
        across = median_interval_across_processes(by_run) if len(by_run) > 1 else None
        rows.append({**group, "rounds": len(rounds), "steps": len(ratios),
                     "median_step_ratio": median, "meets_bar": meets(median),
                     "interval_95": [low, high], "settled": meets(low) == meets(high),
                     "interval_95_across_processes": list(across) if across else None,
                     "settled_across_processes":
                         meets(across[0]) == meets(across[1]) if across else None,
                     "by_shape": by_shape(rounds)})
    return rows


def _median_of(part: dict[str, Any]) -> str:
    median = part["median_step_ratio"]
    return f"{part['steps']} steps" + (f", median {median:.3f}" if median is not None else "")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", type=Path, help="step_lockstep.py --json outputs")
    p.add_argument("--judged", default="allocwatch",
                   help="the allocator whose steps are the numerator (default allocwatch)")
    p.add_argument("--json", metavar="OUT", help="write the pooled groups here as JSON")
    args = p.parse_args()
    try:
        rows = pool(args.files, args.judged)
    except PoolError as e:
        print(f"lockstep_pool: {e}", file=sys.stderr)
        return 2
    for row in rows:
        cap = f"at {row['fraction_of_peak']:g} x" if row["fraction_of_peak"] else "uncapped"
        verdict = "meets" if row["meets_bar"] else "misses"
        low, high = row["interval_95"]
        print(f"{row['workload']}, {cap}, against {row['against']}: median per-step ratio "
              f"{row['median_step_ratio']:.3f} "
              f"over {row['steps']} steps of {len(row['runs'])} runs ({verdict} the bar of "
              f"{BAR:.2f})")
        print(f"    95 % interval over the {row['rounds']} rounds resampled: {low:.3f}-{high:.3f}"
              + ("" if row["settled"] else " (the verdict differs at its ends: not settled)"))
        if row["interval_95_across_processes"]:
            low, high = row["interval_95_across_processes"]
            print(f"    with the {len(row['runs'])} runs' processes resampled too: "
                  f"{low:.3f}-{high:.3f}" + ("" if row["settled_across_processes"]
                                             else " (not settled)"))
        if row["by_shape"]:
            new, repeated = row["by_shape"]["new"], row["by_shape"]["repeated"]
            print("    steps of a shape new to the run: " + _median_of(new)
                  + "; of a shape timed before: " + _median_of(repeated))
        for run in row["runs"]:
            print(f"    {run['median_step_ratio']:.3f}  {run['steps']:4d} steps  {run['file']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"judged": args.judged, "bar": BAR,
                                               "groups": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
