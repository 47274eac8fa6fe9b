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
    from allocator_ext.replay.sizes import format_size
    from allocator_ext.replay.trace import peak_requested_bytes
    from allocator_ext.replay.tune import CANDIDATES, explain, tune

    try:
        trace = load_trace(args.trace)
        peak = peak_requested_bytes(trace)
        device_memory = device_memory_arg(args.device_memory, peak)
    except (TraceError, ValueError, OSError) as e:
        print(f"allocwatch tune: {e}", file=sys.stderr)
        return 2
    try:
        with progress_bar(len(trace.events) * len(CANDIDATES), "tune", args.json) as progress:
            ranked = tune(trace, device_memory, args.memory_fraction, progress=progress)
    except (TraceError, ValueError) as e:
        print(f"allocwatch tune: {e}", file=sys.stderr)
        return 2
    best = ranked[0]
    why = explain(best, ranked)
    if args.plot:
        _plot(ranked, args.plot, peak)
    if args.json:
        print(json.dumps({
            "trace": args.trace, "device_memory": device_memory, "peak_requested_bytes": peak,
            "recommended": {"name": best.name, "allocwatch_settings": best.settings,
                            "pytorch_cuda_alloc_conf": best.pytorch_conf, "why": why},
            "candidates": [{"name": c.name, "settings": c.settings,
                            "pytorch_cuda_alloc_conf": c.pytorch_conf, **{
                                k: c.report[k] for k in (
                                    "peak_reserved_bytes", "reserved_ratio", "num_alloc_retries",
                                    "num_ooms", "num_device_alloc", "num_device_free",
                                    "device_call_seconds_estimate", "device_call_share")}}
                           for c in ranked],
        }, indent=2))
        return 0
    print(f"trace {args.trace}: peak requested {format_size(peak)}"
          + (f", device capped at {format_size(device_memory)}" if device_memory else ""))
    print(f"{'setting':30s} {'peak reserved':>14s} {'ratio':>7s} {'retries':>8s} {'OOMs':>5s} "
          f"{'dev calls':>10s} {'cost %':>7s}")
    for c in ranked:
        r = c.report
        print(f"{c.name:30s} {format_size(r['peak_reserved_bytes']):>14s} "
              f"{r['reserved_ratio']:7.3f} {r['num_alloc_retries']:8d} {r['num_ooms']:5d} "
              f"{r['num_device_alloc'] + r['num_device_free']:10d} "
              f"{100 * r['device_call_share']:7.2f}")
    print()
    print(f"recommended: {best.name}")
    print(f"  allocwatch settings:      ALLOCWATCH_ALLOC_CONF={best.settings}")
    if best.pytorch_conf is not None:
        print(f"  PyTorch's own allocator:  PYTORCH_CUDA_ALLOC_CONF={best.pytorch_conf}")
    print(f"  why: {why}")
    if args.plot:
        print(f"plot: {args.plot}")
    return 0
