"""Where reserved memory grows in one replay of a trace, under each of several settings.

    python -m bench.replay.growth_timeline TRACE [--config SETTINGS ...] [--near 0.99]
                                           [--fixed-layout-bound] [--json FILE]

Replays TRACE once per --config (default: allocwatch's defaults and PyTorch's expandable
segments) and prints every event where one of them changes reserved memory while it is within
--near of its peak: the event's index in the trace, the request, the bytes requested then and
each setting's reserved bytes, both over the trace's peak requested bytes: so two settings'
peaks can be traced to the requests that make them differ.

Also printed: the sum over the trace's streams of each stream's own peak of bytes requested,
over the trace's peak requested. Without moving pages between streams an allocator holds at
least that much (a block serves only its own stream), so a figure of 1.0000 says the streams
themselves force no extra memory.

--fixed-layout-bound adds what a layout that never moves a page needs when it knows the whole
trace in advance: each stream's requests packed into one address range, largest first, each at
the lowest address free for its whole lifetime (greedy best fit by decreasing size, offline),
over the trace's peak requested bytes. An online allocator cannot know the future; a figure
near 1.0000 says the memory a setting holds beyond it is the price of not knowing, not of the
requests themselves. Quadratic in the worst case: seconds for tens of thousands of requests.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from allocator_ext.replay.replayer import Replayer
from allocator_ext.replay.trace import (
    Lifetime,
    Trace,
    TraceError,
    lifetimes,
    load_trace,
    peak_requested_by_stream,
)

DEFAULT_CONFIGS = ("", "native,expandable_segments:True")


def per_stream_peak_sum(trace: Trace) -> int:
    """The sum over streams of the most bytes each stream's requests held at once."""
    return sum(peak_requested_by_stream(trace)[1].values())


def packed_span(requests: list[Lifetime]) -> int:
    """The address range a fixed layout of `requests` needs, packed offline: largest first (the
    longer-lived first among equals), each at the lowest offset where no request placed before
    it and alive at the same time overlaps it."""
    placed: list[tuple[int, int, int, int]] = []  # (start, end, offset, size)
    span = 0
    for r in sorted(requests, key=lambda r: (-r.size, r.start - r.end)):
        taken = sorted((offset, offset + size) for start, end, offset, size in placed
                       if start < r.end and r.start < end)
        offset = 0
        for low, high in taken:
            if offset + r.size <= low:
                break
            offset = max(offset, high)
        placed.append((r.start, r.end, offset, r.size))
        span = max(span, offset + r.size)
    return span


def fixed_layout_bound(trace: Trace) -> int:
    """The bytes a layout that never moves a page needs with foresight: each stream packed
    apart (packed_span), summed."""
    by_stream: dict[int, list[Lifetime]] = {}
    for r in lifetimes(trace):
        by_stream.setdefault(r.stream, []).append(r)
    return sum(packed_span(requests) for requests in by_stream.values())


def reserved_by_event(trace: Trace, config: str) -> tuple[list[int], list[int], list[int]]:
    """Reserved bytes after each replayed event, the bytes requested then (the same under every
    setting of an uncapped replay), and the event's index in the trace (a free whose completion
    follows at once replays as one step)."""
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


def timeline(trace: Trace, configs: list[str], near: float,
             bound: bool = False) -> dict[str, Any]:
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
    result = {"trace": trace.path, "configs": configs, "peak_requested_bytes": peak_requested,
              "peak_reserved_over_requested": [p / peak_requested for p in peaks],
              "per_stream_peak_sum_over_requested": per_stream_peak_sum(trace) / peak_requested,
              "rows": rows}
    if bound:
        result["fixed_layout_bound_over_requested"] = fixed_layout_bound(trace) / peak_requested
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--config", action="append", metavar="SETTINGS",
                   help="an allocwatch settings string; repeat for several ('' = defaults)")
    p.add_argument("--near", type=float, default=0.99,
                   help="show changes within this fraction of a setting's peak (default 0.99)")
    p.add_argument("--fixed-layout-bound", action="store_true",
                   help="also pack each stream's requests offline, with foresight, and print "
                        "the span over the peak requested bytes")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    if not 0 < args.near <= 1:
        p.error(f"--near must be in (0, 1], not {args.near}")
    try:
        trace = load_trace(args.trace)
        result = timeline(trace, list(args.config or DEFAULT_CONFIGS), args.near,
                          args.fixed_layout_bound)
    except (TraceError, ValueError, OSError) as e:
        print(f"growth_timeline: {e}", file=sys.stderr)
        return 2
    names = [c or "defaults" for c in result["configs"]]
    print(f"{trace.path}: sum of per-stream peaks / peak requested = "
          f"{result['per_stream_peak_sum_over_requested']:.4f}")
    if args.fixed_layout_bound:
        print("a fixed layout packed with foresight (never moving a page) / peak requested = "
              f"{result['fixed_layout_bound_over_requested']:.4f}")
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
