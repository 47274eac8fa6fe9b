"""allocwatch tune: which allocator settings would have suited a recorded trace best."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from exporter.commands._arguments import HelpFormatter
from exporter.commands._trace_args import (
    add_passes_argument,
    add_plot_argument,
    add_trace_arguments,
    check_plot_target,
    device_memory_arg,
)

HELP = "replay a trace under candidate allocator settings and recommend one"
DESCRIPTION = """\
Replays a PyTorch memory snapshot under a set of candidate settings (PyTorch's defaults,
expandable segments, max_split_size_mb, roundup_power2_divisions, allocwatch's defaults and
variants) on the simulated device, prints a table (peak reserved, reserved/requested, retries,
out-of-memory errors, device calls) and recommends the candidate with the lowest peak reserved
memory among those that never ran out of memory, saying why. Peaks within 1 % of the trace's
peak requested bytes of each other rank as equal: among them, fewer retries, then cheaper
device calls (over every pass), rank first. The recommendation is given as
allocwatch settings and, where PyTorch's own allocator understands it, as
PYTORCH_CUDA_ALLOC_CONF.

On a trace that ended in out-of-memory errors, each replay makes the failed requests too (see
`allocwatch replay --help`), under the cap the trace recorded or its errors imply (or
--memory-fraction and --device-memory): a candidate under which a recorded error recurs is
never recommended, and the settings the trace was recorded under are replayed as a candidate
of their own. Where every candidate runs out of memory, there is no recommendation.

With --passes N each candidate replays the trace N times on one allocator, as a long run repeats
its steps, and is judged by what the passes reached: the peak reserved after the last pass and
the out-of-memory errors of every pass, so that a setting whose cache creeps into the cap late
in a long run is not recommended; a setting that goes on mapping its pages at new addresses
(aliased pages: the driver's mappings grow while reserved memory does not) ranks after those
that settle, and the output names it. The table then shows the later passes' device calls too
(the most of any one pass after the first, and their cost).

  allocwatch tune my_run.pickle.gz
  allocwatch tune my_run.pickle.gz --device-memory 1.03x --plot tune.png
  allocwatch tune my_run.pickle.gz --device-memory 1.03x --passes 20
  allocwatch tune my_run.pickle.gz --json"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("tune", help=HELP, description=DESCRIPTION,
                              formatter_class=HelpFormatter)
    add_trace_arguments(p)
    add_passes_argument(p, "judge each candidate by what its passes reached")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_plot_argument(p, "a bar chart of peak reserved by setting")
    p.set_defaults(func=run)


# Bars beyond this multiple of the peak requested bytes are drawn cut at the axis's end, with
# their value written on them: an outlier (max_split_size_mb on some traces reserves 4×) would
# otherwise squash the differences that matter (9.5 and 10.3 GiB).
CLIP_RATIO = 1.5
TITLE_WIDTH = 95  # characters a title line holds at its font size on the chart's width


def chart(ranked: list[Any], best: Any, peak_requested: int, title: str) -> Any:
    """Peak reserved by candidate, as bars starting from the peak requested bytes (what every
    candidate that runs to the end must hold), so their lengths are each setting's overhead;
    each bar labelled with its value. A candidate that ran out of memory may have reserved
    less (its failed requests were never served): the axis then starts lower."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from allocator_ext.replay.plot import memory_unit, wrap

    rows = ranked[::-1]  # best at the top
    unit_name, unit = memory_unit(max(peak_requested,
                                      *(c.figures["peak_reserved_bytes"] for c in rows)))
    base = peak_requested / unit
    values = [c.figures["peak_reserved_bytes"] / unit for c in rows]
    inside = [v for v in values if v <= CLIP_RATIO * base] or values
    left = min(base, *values)
    right = left + 1.25 * max(max(inside) - left, 0.01 * base)
    colors = ["tab:red" if c.figures["num_ooms"] else
              "tab:green" if c is best else "tab:blue" for c in rows]
    fig, ax = plt.subplots(figsize=(10, 0.42 * len(rows) + 1.6), dpi=110)
    shown = [min(v, right) - left for v in values]
    bars = ax.barh([c.name for c in rows], shown, left=left, color=colors)
    pad = 0.005 * (right - left)
    for bar, value, candidate in zip(bars, values, rows, strict=True):
        r = candidate.figures
        label = (f"{value:.2f} {unit_name}, {r['num_ooms']} OOMs" if r["num_ooms"]
                 else f"{value:.2f} {unit_name}  ({r['reserved_ratio']:.3f}×)")
        middle = bar.get_y() + bar.get_height() / 2
        if value > right:  # cut at the axis: say so, and write the value inside the bar
            ax.text(right - pad, middle, f"{label} ▶", va="center", ha="right", fontsize=8,
                    color="white")
        else:
            ax.text(value + pad, middle, label, va="center", ha="left", fontsize=8)
    if left < base:
        ax.axvline(base, color="0.3", ls="--", lw=1)
    ax.set_xlim(left, right)
    ax.set_xlabel(f"peak reserved ({unit_name}), from the trace's peak requested "
                  f"({base:.2f} {unit_name}"
                  f"{', dashed' if left < base else ''})\ngreen: recommended · red: ran out "
                  "of memory · ▶: beyond the axis", fontsize=9)
    ax.set_title(wrap(title, TITLE_WIDTH), fontsize=10, loc="left")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


def _table(ranked: list[Any], recorded_ooms: int = 0) -> list[str]:
    """The text table, its first column as wide as the longest setting's name; with a column of
    the recorded out-of-memory errors that recurred where the trace holds some, and, after
    several passes, the device calls of the later passes (the most of any one, and its cost)."""
    from allocator_ext.replay.sizes import format_size
    from allocator_ext.replay.tune import later_passes

    width = max(len("setting"), *(len(c.name) for c in ranked))
    recurred = f"  {'recurred':>8s}" if recorded_ooms else ""
    passes = later_passes(ranked[0]) is not None
    later = f"  {'later calls':>11s}  {'later %':>7s}" if passes else ""
    first = "1st pass " if passes else ""
    lines = [f"{'setting':{width}s}  {'peak reserved':>13s}  {'ratio':>6s}  {'retries':>7s}  "
             f"{'OOMs':>4s}{recurred}  {first + 'dev calls':>9s}  {'cost %':>6s}{later}"]
    for c in ranked:
        r = c.figures
        recurred = (f"  {r['recorded_ooms_recurred']:>3d} of {recorded_ooms:<2d}"
                    if recorded_ooms else "")
        more = later_passes(c)
        later = (f"  {more['device_calls']:11d}  {100 * more['device_call_share']:7.2f}"
                 if more is not None else "")
        lines.append(
            f"{c.name:{width}s}  {format_size(r['peak_reserved_bytes']):>13s}  "
            f"{r['reserved_ratio']:6.3f}  {r['num_alloc_retries']:7d}  {r['num_ooms']:4d}"
            f"{recurred}  {r['num_device_alloc'] + r['num_device_free']:{len(first) + 9}d}  "
            f"{100 * r['device_call_share']:6.2f}{later}")
    return lines


def run(args: argparse.Namespace) -> int:
    from allocator_ext.replay import TraceError, load_trace
    from allocator_ext.replay.cap import resolve_cap
    from allocator_ext.replay.progress import progress_bar
    from allocator_ext.replay.sizes import format_size
    from allocator_ext.replay.trace import peak_requested_bytes
    from allocator_ext.replay.tune import (
        TIE_MARGIN,
        candidates_for,
        device_call_seconds,
        explain,
        keeps_mapping_new_addresses,
        later_passes,
        recommended,
        tune,
    )

    try:
        check_plot_target(args.plot)
        trace = load_trace(args.trace)
        peak = peak_requested_bytes(trace)
        cap = resolve_cap(trace, device_memory_arg(args.device_memory, peak), args.memory_fraction)
    except (TraceError, ValueError) as e:
        print(f"allocwatch tune: {e}", file=sys.stderr)
        return 2
    candidates = candidates_for(trace)
    try:
        with progress_bar(len(trace.events) * len(candidates) * args.passes, "tune",
                          args.json) as progress:
            ranked = tune(trace, cap.device_memory, cap.memory_fraction, candidates, progress,
                          passes=args.passes)
    except (TraceError, ValueError) as e:
        print(f"allocwatch tune: {e}", file=sys.stderr)
        return 2
    best = recommended(ranked)
    why = explain(ranked[0], ranked)
    recorded_ooms = len(ranked[0].report["recorded_ooms"])
    status = _write_plot(args, ranked, best, peak, cap.describe()) if args.plot else 0
    if args.json:
        print(json.dumps({
            "trace": args.trace, "device_memory": cap.device_memory,
            "memory_fraction": cap.memory_fraction, "cap": cap.describe(),
            "cap_from": cap.sources(), "peak_requested_bytes": peak,
            "recorded_ooms": recorded_ooms, "passes": args.passes,
            "tie_margin_bytes": int(TIE_MARGIN * peak),
            "recommended": None if best is None else {
                "name": best.name, "allocwatch_settings": best.settings,
                "pytorch_cuda_alloc_conf": best.pytorch_conf, "why": why},
            "why": why,
            "candidates": [{"name": c.name, "settings": c.settings,
                            "pytorch_cuda_alloc_conf": c.pytorch_conf, **{
                                k: c.figures[k] for k in (
                                    "peak_reserved_bytes", "reserved_ratio", "num_alloc_retries",
                                    "num_ooms", "recorded_ooms_recurred", "num_device_alloc",
                                    "num_device_free", "device_call_seconds_estimate",
                                    "device_call_share")},
                            "device_call_seconds_all_passes": device_call_seconds(c),
                            **({"long_run": c.report["long_run"],
                                "later_passes": later_passes(c)}
                               if "long_run" in c.report else {})}
                           for c in ranked],
        }, indent=2))
        return status
    print(f"trace {args.trace}: peak requested {format_size(peak)}, cap: {cap.describe()}"
          + (f", {recorded_ooms} recorded out-of-memory error(s)" if recorded_ooms else "")
          + (f"; peak reserved after {args.passes} passes, retries and OOMs of all of them"
             if args.passes > 1 else ""))
    print(f"ranked by peak reserved; peaks within {format_size(TIE_MARGIN * peak)} "
          f"({100 * TIE_MARGIN:.0f} % of the peak requested) of each other rank as equal, and "
          "then fewer retries, then cheaper device calls"
          + (" over every pass" if args.passes > 1 else "") + ", rank first")
    print("\n".join(_table(ranked, recorded_ooms)))
    if args.passes > 1:
        print("later calls, later %: the busiest pass after the first, its device calls of every "
              "kind (page maps, unmaps and creates too) and their cost")
        for c in ranked:
            if not keeps_mapping_new_addresses(c):
                continue
            run = c.report["long_run"]
            first, last = (run["mapped_beyond_reserved_first_pass"],
                           run["mapped_beyond_reserved_last_pass"])
            print(f"{c.name}: maps its pages at ever more addresses, {format_size(first)} "
                  f"beyond reserved memory after the first pass, {format_size(last)} after "
                  "the last (the driver's mappings grow while reserved memory does not)")
    print()
    if best is None:
        print("recommended: none")
    else:
        print(f"recommended: {best.name}")
        print(f"  allocwatch settings:      ALLOCWATCH_ALLOC_CONF={best.settings}")
        if best.pytorch_conf is not None:
            print(f"  PyTorch's own allocator:  PYTORCH_CUDA_ALLOC_CONF={best.pytorch_conf}")
    print(f"  why: {why}")
    if args.plot and status == 0:
        print(f"plot: {args.plot}")
    return status


def _write_plot(args: argparse.Namespace, ranked: list[Any], best: Any, peak: int,
                cap: str) -> int:
    from allocator_ext.replay.sizes import format_size

    title = (f"allocwatch tune: peak reserved by setting\n{args.trace} (peak requested "
             f"{format_size(peak)}, cap: {cap})")
    fig = chart(ranked, best, peak, title)  # chooses matplotlib's file-only backend first
    import matplotlib.pyplot as plt

    try:
        fig.savefig(args.plot, bbox_inches="tight")
    except OSError as err:
        print(f"allocwatch tune: --plot {args.plot}: cannot write it: {err.strerror or err}",
              file=sys.stderr)
        return 1
    finally:
        plt.close(fig)
    return 0
