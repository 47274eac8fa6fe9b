"""Where reserved memory grows in one replay of a trace, under each of several settings.

    python bench/replay/growth_timeline.py TRACE [--config SETTINGS ...] [--near 0.99]
                                           [--json FILE]

Replays TRACE once per --config (default: allocwatch's defaults and settle_page_moves:False) and
prints every event where one of them changes reserved memory while it is within --near of its
peak: the event's index in the trace, the request, the bytes requested then and each setting's
reserved bytes, both over the trace's peak requested bytes: so two settings' peaks can be
traced to the requests that make them differ.

Also printed: the sum over the trace's streams of each stream's own peak of bytes requested,
over the trace's peak requested. Without moving pages between streams an allocator holds at
least that much (a block serves only its own stream), so a figure of 1.0000 says the streams
themselves force no extra memory.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[2]))  # the checkout
from allocator_ext.replay.replayer import Replayer  # noqa: E402
from allocator_ext.replay.trace import Trace, TraceError, load_trace  # noqa: E402

DEFAULT_CONFIGS = ("", "settle_page_moves:False")


def per_stream_peak_sum(trace: Trace) -> int:
    """The sum over streams of the most bytes each stream's requests held at once."""
    live: dict[int, tuple[int, int]] = {}
    current: dict[int, int] = {}
    peak: dict[int, int] = {}
    for e in trace.events:
        if e.action == "alloc":
            live[e.addr] = (e.size, e.stream)
            current[e.stream] = current.get(e.stream, 0) + e.size
            peak[e.stream] = max(peak.get(e.stream, 0), current[e.stream])
        elif e.action == "free_completed" and e.addr in live:
            size, stream = live.pop(e.addr)
            current[stream] -= size
    return sum(peak.values())


def reserved_by_event(trace: Trace, config: str) -> tuple[list[int], list[int], list[int]]:
    """Reserved bytes after each replayed event, the bytes requested then, and the event's
    index in the trace (a free whose completion follows at once replays as one step)."""
    replayer = Replayer(trace, config or None)
    reserved: list[int] = []
    requested: list[int] = []
    index: list[int] = []
    while not replayer.at_end:
        index.append(replayer.position)
        replayer.step()
        reserved.append(replayer.allocator.stats()["reserved_bytes.all.current"])
        requested.append(replayer.requested)
    return reserved, requested, index


def timeline(trace: Trace, configs: list[str], near: float) -> dict[str, Any]:
    runs = [reserved_by_event(trace, c) for c in configs]
    _, requested, index = runs[0]
    reserved = [r for r, _, _ in runs]
    peak_requested = max(requested) or 1
    peaks = [max(r) for r in reserved]
    rows = []
    for i in range(len(requested)):
        changed = any(i == 0 or r[i] != r[i - 1] for r in reserved)
        close = any(r[i] >= near * p for r, p in zip(reserved, peaks, strict=True))
        if changed and close:
            e = trace.events[index[i]]
            rows.append({"event": index[i], "action": e.action, "size": e.size,
                         "stream": e.stream, "requested": requested[i] / peak_requested,
                         "reserved": [r[i] / peak_requested for r in reserved]})
    return {"trace": trace.path, "configs": configs, "peak_requested_bytes": peak_requested,
            "peak_reserved_over_requested": [p / peak_requested for p in peaks],
            "per_stream_peak_sum_over_requested": per_stream_peak_sum(trace) / peak_requested,
            "rows": rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--config", action="append", metavar="SETTINGS",
                   help="an allocwatch settings string; repeat for several ('' = defaults)")
    p.add_argument("--near", type=float, default=0.99,
                   help="show changes within this fraction of a setting's peak (default 0.99)")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    if not 0 < args.near <= 1:
        p.error(f"--near must be in (0, 1], not {args.near}")
    try:
        trace = load_trace(args.trace)
        result = timeline(trace, list(args.config or DEFAULT_CONFIGS), args.near)
    except (TraceError, ValueError, OSError) as e:
        print(f"growth_timeline: {e}", file=sys.stderr)
        return 2
    names = [c or "defaults" for c in result["configs"]]
    print(f"{trace.path}: sum of per-stream peaks / peak requested = "
          f"{result['per_stream_peak_sum_over_requested']:.4f}")
    print("peak reserved / peak requested: " + ", ".join(
        f"{n} {v:.4f}" for n, v in zip(names, result["peak_reserved_over_requested"],
                                       strict=True)))
    print(f"{'event':>7} {'request':>18} {'requested':>9}  "
          + "  ".join(f"{n:>22}" for n in names))
    for row in result["rows"]:
        request = f"{row['action']} {row['size'] / 2**20:.0f} MiB"
        print(f"{row['event']:>7} {request:>18} {row['requested']:>9.4f}  "
              + "  ".join(f"{v:>22.4f}" for v in row["reserved"]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
