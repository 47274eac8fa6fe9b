"""allocwatch replay: how an allocator setting would have behaved on a recorded trace."""

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

SHOWN_OOMS = 5  # recorded out-of-memory errors listed one by one in the table

HELP = "replay a recorded PyTorch memory trace through allocwatch's allocator (no GPU needed)"
DESCRIPTION = """\
Replays a PyTorch memory snapshot (torch.cuda.memory._dump_snapshot, .pickle or .pickle.gz,
recorded with torch.cuda.memory._record_memory_history from the start of the process) through
allocwatch's allocator on a simulated device, and reports what the allocator would have reserved,
how often it would have retried or run out of memory, and what its device calls would have cost
(priced with a table measured on an H200).

  allocwatch replay trace.pickle.gz                      allocwatch's default settings
  allocwatch replay trace.pickle.gz --config native      PyTorch's defaults (reproduces the run)
  allocwatch replay trace.pickle.gz --config native,expandable_segments:True
  allocwatch replay trace.pickle.gz --device-memory 1.03x --json
  allocwatch replay trace.pickle.gz --plot replay.png
  allocwatch replay trace.pickle.gz --passes 50          what a long run of it reserves

Beside reserved/requested stand the trace's floor (what any allocator under the core's rules
must reserve: memory waiting for other streams' events, whole pages for each stream's pool) and
where the reserved memory lay at its peak: blocks in use, blocks waiting for other streams' work,
free bytes in pages that blocks in use share, free whole pages still mapped, and free bytes of
cudaMalloc segments and of CUDA graphs' and MemPools' private pools.

One replay answers for the run that was recorded. A long run repeats its steps for hours, and a
cache that keeps changing its layout can keep growing: --passes N runs the trace's program N
times on the one allocator (each pass freeing what it still holds at its end, as a step does)
and adds what the passes reached: the peak reserved after the last pass beside the first's,
what each pass's device calls cost once the cache is warm, and the retries and out-of-memory
errors of the later passes (under a cap, a run that creeps grows into it). The figures above
that stay the first pass's.

Allocations the recorded run made into a private pool (CUDA graphs, torch.compile's graph
trees, torch.cuda.MemPool) replay into a private pool of their own, laid out in plain segments
as PyTorch and allocwatch's native back end lay such pools out: the snapshot's segments say
which pool each segment belonged to (a segment freed before the snapshot counts as the
default pool's).

A trace that ended in an out-of-memory error holds the request that failed (an `oom` event):
the replay makes that request too, at its place and on its stream; where the allocator serves
it, it is freed at the first free after it, where the recorded run began unwinding from the
error. The report says of each recorded out-of-memory error whether it recurred. The memory
fraction and device total the run was capped with are read from the trace where it kept them
(bench/replay/record_traces.py does); --memory-fraction and --device-memory override them.
A trace that keeps no cap (PyTorch's own snapshot) replays on the device its errors imply
(what the run had reserved plus the device's free memory at each error), so that they can
recur; --device-memory none replays it uncapped. Where the device still had room at an error,
a memory fraction was in force: the trace replays uncapped and the cap line asks for it.

Times are the trace's active time, as trace_seconds counts it (each gap between events counted
up to 100 ms, so that data loading and pauses do not count). --plot draws memory on that clock:
what the program requested, what the replay allocated and reserved beside what the recorded
run reserved, the cap, and where the allocator retried or ran out of memory and where each
recorded out-of-memory error was (red: recurred; green: served).

Exit status: 0 when the replay ran (even with out-of-memory errors: see num_ooms), 2 for a bad
argument or an unreadable, corrupt or mid-run trace."""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("replay", help=HELP, description=DESCRIPTION,
                              formatter_class=HelpFormatter)
    add_trace_arguments(p)
    p.add_argument("--config", metavar="STR",
                   help="allocator settings in PYTORCH_CUDA_ALLOC_CONF syntax; 'native' is "
                        "PyTorch's defaults (default: allocwatch's defaults)")
    p.add_argument("--device", type=int,
                   help="which device's trace (default: the first with events)")
    add_passes_argument(p, "report what the last pass reached")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    add_plot_argument(p, "write a plot of memory over the trace (every pass, one after another)")
    p.add_argument("--costs", metavar="FILE", help="device-call cost table (default: the H200 one)")
    p.set_defaults(func=run)


def human_report(r: dict) -> str:
    from allocator_ext.replay.sizes import format_size

    rec = r["recorded"]
    lines = [
        f"trace              {r['trace']} ({r['events_replayed']} events, "
        f"{r['trace_seconds']:.2f} s active)",
        f"settings           {r['config']}",
        f"peak requested     {format_size(r['peak_requested_bytes'])}",
        f"peak allocated     {format_size(r['peak_allocated_bytes'])}",
        f"peak reserved      {format_size(r['peak_reserved_bytes'])}   "
        f"(recorded run: {format_size(rec['peak_reserved_bytes'])})",
        f"reserved/requested {r['reserved_ratio']:.4f}",
        *_floor_lines(r.get("floor")),
        *_peak_lines(r.get("peak_anatomy")),
        f"cap                {r.get('cap', 'none')}",
        f"retries / OOMs     {r['num_alloc_retries']} / {r['num_ooms']}",
        f"device allocs      {r['num_device_alloc']}   (recorded run: {rec['num_segment_alloc']})",
        f"device frees       {r['num_device_free']}",
        f"device call cost   {r['device_call_seconds_estimate'] * 1e3:.2f} ms "
        f"= {100 * r['device_call_share']:.2f} % of the trace's active time",
    ]
    if r["recorded_ooms"]:
        lines.append(f"recorded OOMs      {len(r['recorded_ooms'])}: "
                     f"{r['recorded_ooms_recurred']} recurred, "
                     f"{r['recorded_ooms_survived']} survived")
        for oom in r["recorded_ooms"][:SHOWN_OOMS]:
            outcome = "recurred" if oom["recurred"] else "survived"
            lines.append(f"  event {oom['event_index']:<9d} {format_size(oom['size'])} on "
                         f"stream {oom['stream']} at {_active_time(oom['time_s'])}: "
                         f"{outcome}")
        if len(r["recorded_ooms"]) > SHOWN_OOMS:
            lines.append(f"  … and {len(r['recorded_ooms']) - SHOWN_OOMS} more (see --json)")
    if r["unknown_actions"]:
        lines.append(f"unknown actions    {r['unknown_actions']} (counted, not replayed)")
    if "long_run" in r:
        lines += _long_run_lines(r["long_run"])
    return "\n".join(lines)


def _floor_lines(f: dict | None) -> list[str]:
    """The trace's floor (allocator_ext/replay/floor.py) and the fragmentation bar it sets."""
    if not f:
        return []
    return [f"floor              {f['floor_ratio']:.4f}  the least any allocator under the "
            f"core's rules could reserve here (bar {f['bar']:.4f})"]


def _peak_lines(a: dict | None) -> list[str]:
    """Where the peak's reserved memory lay (allocator_ext/replay/peak.py)."""
    if not a:
        return []
    from allocator_ext.replay.sizes import format_size

    rows = [
        ("in use", a["in_use"], "blocks handed out"),
        ("waiting", a["waiting"], "freed, waiting for other streams' work (record_stream)"),
        ("free, partial", a["free_partial_pages"],
         f"in {a['free_partial_pieces']} pieces, in pages that blocks in use share"),
        ("free, whole", a["free_whole_pages"],
         "whole free pages still mapped (kept by the page rules, or inside chunks in use)"),
        ("free, plain", a["free_plain_segments"], "in cudaMalloc segments"),
        ("private pools", a["private_pools"], "free in CUDA graphs' and MemPools' pools"),
    ]
    lines = [f"at the peak        {format_size(a['reserved'])} reserved in "
             f"{a['mapped_ranges']} segments or mapped ranges:"]
    lines += [f"  {name:17s}{format_size(n):>11s}  {why}" for name, n, why in rows if n]
    return lines


def _long_run_lines(run: dict) -> list[str]:
    from allocator_ext.replay.sizes import format_size

    growth = run["growth_over_first_pass"] - 1
    return [
        f"{'after ' + str(run['passes']) + ' passes':19s}peak reserved "
        f"{format_size(run['peak_reserved_bytes'])}"
        f" (reserved/requested {run['reserved_ratio']:.4f}), {100 * growth:+.2f} % over the "
        "first pass",
        f"                   device calls {100 * run['device_call_share_last_pass']:.3f} % of "
        f"the active time in the last pass (at most "
        f"{100 * run['device_call_share_worst_later_pass']:.3f} % after the first)",
        f"                   retries / OOMs after the first pass: "
        f"{run['num_alloc_retries_later_passes']} / {run['num_ooms_later_passes']}",
    ] + _aliases_line(run)


def _aliases_line(run: dict) -> list[str]:
    """Aliased pages' address space beyond reserved memory, where there is any: it keeps
    growing where a step maps its pages at new addresses pass after pass."""
    from allocator_ext.replay.sizes import format_size

    first = run["mapped_beyond_reserved_first_pass"]
    last = run["mapped_beyond_reserved_last_pass"]
    if not first and not last:
        return []
    return [f"                   address space mapped beyond reserved (aliased pages): "
            f"{format_size(first)} after the first pass, {format_size(last)} after the last"]


def _active_time(seconds: float) -> str:
    """A moment on the trace's active clock, as the plot's axis shows it."""
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.2f} ms"


def load_costs(path: str) -> Any:
    """The --costs table; ValueError naming the file and what is wrong with it."""
    from allocator_ext.replay import load_cost_table

    try:
        return load_cost_table(path)
    except OSError as err:
        raise ValueError(f"--costs {path}: cannot read it: {err.strerror or err}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        what = f"no field {err}" if isinstance(err, KeyError) else str(err)
        raise ValueError(f"--costs {path}: not a device-call cost table ({what}); "
                         "allocator_ext/data/device_costs.json shows the layout") from None


def run(args: argparse.Namespace) -> int:
    from allocator_ext.replay import TraceError, load_trace, replay
    from allocator_ext.replay.cap import resolve_cap
    from allocator_ext.replay.floor import reserved_floor
    from allocator_ext.replay.progress import progress_bar
    from allocator_ext.replay.trace import peak_requested_bytes

    try:
        check_plot_target(args.plot)
        costs = load_costs(args.costs) if args.costs else None
        trace = load_trace(args.trace, args.device)
        cap = resolve_cap(trace, device_memory_arg(args.device_memory, peak_requested_bytes(trace)),
                          args.memory_fraction)
    except (TraceError, ValueError) as e:
        print(f"allocwatch replay: {e}", file=sys.stderr)
        return 2

    try:
        with progress_bar(len(trace.events) * args.passes, "replay", args.json) as progress:
            result = replay(trace, config=args.config, device_memory=cap.device_memory,
                            memory_fraction=cap.memory_fraction, costs=costs,
                            progress=progress, timeline=bool(args.plot), passes=args.passes,
                            explain_peak=True)
    except (TraceError, ValueError) as e:
        print(f"allocwatch replay: {e}", file=sys.stderr)
        return 2
    result.report["cap"] = cap.describe()
    result.report["cap_from"] = cap.sources()
    result.report["floor"] = reserved_floor(trace).as_dict()

    # The figures first: a plot that cannot be written loses nothing else.
    if args.json:
        print(json.dumps(result.report, indent=2, sort_keys=True), flush=True)
    else:
        print(human_report(result.report), flush=True)
    if args.plot:
        from allocator_ext.replay.plot import plot_timeline

        try:
            plot_timeline(result.timeline, args.plot,
                          f"{args.trace} — {result.report['config']}",
                          result.report["recorded_ooms"])
        except OSError as err:
            print(f"allocwatch replay: --plot {args.plot}: cannot write it: "
                  f"{err.strerror or err}", file=sys.stderr)
            return 1
        if not args.json:
            print(f"plot               {args.plot}")
    return 0
