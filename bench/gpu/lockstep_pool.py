"""Pools the per-step ratios of several step_lockstep.py runs into one verdict per workload and cap.

    python bench/gpu/lockstep_pool.py FILE [FILE ...] [--judged allocwatch] [--json OUT]

One lockstep run of 8 rounds spreads by about a percent either way, as much as the differences
sought, so the verdict on the step-time bar (median per-step ratio <= 1.00 at two decimals)
is taken over every run of a setting together. Each FILE is a --json output of
step_lockstep.py (a --suite's lockstep_<workload>.json included); its steps are grouped by
workload and memory cap (uncapped, or the fraction of peak requested). A run that timed the
judged allocator as --against (its process first) counts with its ratios inverted, so that
every ratio pooled is judged / other. A file that did not time the judged allocator, or one
that is not a lockstep result, is refused by name, and nothing is reported.

Reported per group: the runs, the steps, each run's median and the pooled median per-step
ratio, with the verdict against the bar.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

BAR = 1.00  # the median per-step ratio a setting must not exceed, at two decimals


class PoolError(ValueError):
    """A file that cannot be pooled, named with why."""


def judged_ratios(path: Path, judged: str) -> list[tuple[str, float, list[float]]]:
    """(workload, fraction of peak, ratios judged / other) for each phase of the run in `path`."""
    try:
        result = json.loads(path.read_text())
        ours, against, model = result["ours"], result["against"], result["model"]
        phases = result["phases"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise PoolError(f"{path}: not a step_lockstep.py result "
                        f"({type(e).__name__}: {e})") from None
    if judged not in (ours, against) or ours == against:
        raise PoolError(f"{path}: times {ours} against {against}, not {judged} against another "
                        f"allocator")
    out = []
    for phase in phases:
        ratios = [r for rnd in phase.get("rounds", []) for r in rnd["step_ratios"]]
        if judged == against:
            ratios = [1.0 / r for r in ratios]
        out.append((model, float(phase.get("fraction_of_peak") or 0.0), ratios))
    return out


def pool(paths: list[Path], judged: str) -> list[dict[str, Any]]:
    groups: dict[tuple[str, float], dict[str, Any]] = {}
    for path in paths:
        for model, fraction, ratios in judged_ratios(path, judged):
            if not ratios:
                continue
            group = groups.setdefault((model, fraction), {"workload": model, "fraction_of_peak":
                                                          fraction, "runs": [], "ratios": []})
            group["runs"].append({"file": str(path), "steps": len(ratios),
                                  "median_step_ratio": statistics.median(ratios)})
            group["ratios"].extend(ratios)
    rows = []
    for key in sorted(groups):
        group = dict(groups[key])
        ratios = group.pop("ratios")
        median = statistics.median(ratios)
        rows.append({**group, "steps": len(ratios), "median_step_ratio": median,
                     "meets_bar": round(median, 2) <= BAR})
    return rows


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
        print(f"{row['workload']}, {cap}: median per-step ratio {row['median_step_ratio']:.3f} "
              f"over {row['steps']} steps of {len(row['runs'])} runs ({verdict} the bar of "
              f"{BAR:.2f})")
        for run in row["runs"]:
            print(f"    {run['median_step_ratio']:.3f}  {run['steps']:4d} steps  {run['file']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"judged": args.judged, "bar": BAR,
                                               "groups": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
