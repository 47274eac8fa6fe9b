"""allocwatch tune: which allocator settings would have suited a recorded trace best."""

from __future__ import annotations

import argparse
import json
import sys

from exporter.commands._trace_args import add_trace_arguments, device_memory_arg, progress_bar

HELP = "replay a trace under candidate allocator settings and recommend one"
DESCRIPTION = """\
Replays a PyTorch memory snapshot under a set of candidate settings (PyTorch's defaults,
expandable segments, max_split_size_mb, roundup_power2_divisions, allocwatch's defaults and
variants) on the simulated device, prints a table (peak reserved, reserved/requested, retries,
out-of-memory errors, device calls) and recommends the candidate with the lowest peak reserved
memory among those that never ran out of memory, saying why. The recommendation is given as
allocwatch settings and, where PyTorch's own allocator understands it, as
PYTORCH_CUDA_ALLOC_CONF.

On a trace that ended in out-of-memory errors, each replay makes the failed requests too (see
`allocwatch replay --help`), under the cap the trace recorded (or --memory-fraction and
--device-memory): a candidate under which a recorded error recurs is never recommended, and the
settings the trace was recorded under are replayed as a candidate of their own. Where every
candidate runs out of memory, there is no recommendation.

  allocwatch tune my_run.pickle.gz
  allocwatch tune my_run.pickle.gz --device-memory 1.03x --plot tune.png
  allocwatch tune my_run.pickle.gz --json"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("tune", help=HELP, description=DESCRIPTION,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_trace_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", metavar="FILE.png", help="a bar chart of peak reserved by setting")
    p.set_defaults(func=run)


def _plot(ranked, path: str, peak_requested: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gib = float(1 << 30)
    names = [c.name for c in ranked][::-1]
    values = [c.report["peak_reserved_bytes"] / gib for c in ranked][::-1]
    colors = ["tab:red" if c.report["num_ooms"] else "tab:blue" for c in ranked][::-1]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(names) + 1.2), dpi=110)
    ax.barh(names, values, color=colors)
    ax.axvline(peak_requested / gib, color="tab:green", ls="--", label="peak requested")
    ax.set_xlabel("peak reserved (GiB); red: ran out of memory")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from allocator_ext.replay import TraceError, load_trace
    from allocator_ext.replay.cap import resolve_cap
    from allocator_ext.replay.sizes import format_size
    from allocator_ext.replay.trace import peak_requested_bytes
    from allocator_ext.replay.tune import candidates_for, explain, recommended, tune

    try:
        trace = load_trace(args.trace)
        peak = peak_requested_bytes(trace)
        cap = resolve_cap(trace, device_memory_arg(args.device_memory, peak), args.memory_fraction)
    except (TraceError, ValueError, OSError) as e:
        print(f"allocwatch tune: {e}", file=sys.stderr)
        return 2
    candidates = candidates_for(trace)
    try:
        with progress_bar(len(trace.events) * len(candidates), "tune", args.json) as progress:
            ranked = tune(trace, cap.device_memory, cap.memory_fraction, candidates, progress)
    except (TraceError, ValueError) as e:
        print(f"allocwatch tune: {e}", file=sys.stderr)
        return 2
    best = recommended(ranked)
    why = explain(ranked[0], ranked)
    recorded_ooms = len(ranked[0].report["recorded_ooms"])
    if args.plot:
        _plot(ranked, args.plot, peak)
    if args.json:
        print(json.dumps({
            "trace": args.trace, "device_memory": cap.device_memory,
            "memory_fraction": cap.memory_fraction, "cap": cap.describe(),
            "cap_from": cap.sources(), "peak_requested_bytes": peak,
            "recorded_ooms": recorded_ooms,
            "recommended": None if best is None else {
                "name": best.name, "allocwatch_settings": best.settings,
                "pytorch_cuda_alloc_conf": best.pytorch_conf, "why": why},
            "why": why,
            "candidates": [{"name": c.name, "settings": c.settings,
                            "pytorch_cuda_alloc_conf": c.pytorch_conf, **{
                                k: c.report[k] for k in (
                                    "peak_reserved_bytes", "reserved_ratio", "num_alloc_retries",
                                    "num_ooms", "recorded_ooms_recurred", "num_device_alloc",
                                    "num_device_free", "device_call_seconds_estimate",
                                    "device_call_share")}}
                           for c in ranked],
        }, indent=2))
        return 0
    print(f"trace {args.trace}: peak requested {format_size(peak)}, cap: {cap.describe()}"
          + (f", {recorded_ooms} recorded out-of-memory error(s)" if recorded_ooms else ""))
    print(f"{'setting':40s} {'peak reserved':>14s} {'ratio':>7s} {'retries':>8s} {'OOMs':>5s} "
          + (f"{'recurred':>9s} " if recorded_ooms else "")
          + f"{'dev calls':>10s} {'cost %':>7s}")
    for c in ranked:
        r = c.report
        print(f"{c.name:40s} {format_size(r['peak_reserved_bytes']):>14s} "
              f"{r['reserved_ratio']:7.3f} {r['num_alloc_retries']:8d} {r['num_ooms']:5d} "
              + (f"{r['recorded_ooms_recurred']:>4d} of {recorded_ooms:<2d} "
                 if recorded_ooms else "")
              + f"{r['num_device_alloc'] + r['num_device_free']:10d} "
              f"{100 * r['device_call_share']:7.2f}")
    print()
    if best is None:
        print("recommended: none")
    else:
        print(f"recommended: {best.name}")
        print(f"  allocwatch settings:      ALLOCWATCH_ALLOC_CONF={best.settings}")
        if best.pytorch_conf is not None:
            print(f"  PyTorch's own allocator:  PYTORCH_CUDA_ALLOC_CONF={best.pytorch_conf}")
    print(f"  why: {why}")
    if args.plot:
        print(f"plot: {args.plot}")
    return 0
