"""A recorded trace's program for bench/native/trace_ops: its allocations and frees in order.

    python -m bench.replay.trace_program TRACE OUT [--device N]

The replay stepper (allocator_ext/replay/replayer.py) drives the allocator from Python, whose
own cost per event hides the allocator's; trace_ops replays the same sequence from C++. Writes
the program to OUT and prints how many operations and allocations it holds. Each allocation
gets an id; a free names the id of the live allocation at its address, at its request
(`free_requested`). The first line is `allocwatch-program 1 OPS IDS`,
then one line an operation: `a ID SIZE STREAM` or `f ID`. What the program leaves out: the
recorded out-of-memory errors, and the waits of a free for other streams (every free is
reused at once, as a block freed on its own stream is).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from allocator_ext.replay import TraceError, load_trace
from allocator_ext.replay.trace import Trace

HEADER = "allocwatch-program 1"


def program(trace: Trace) -> tuple[list[str], int]:
    """The program's lines (after the header) and the number of allocation ids."""
    live: dict[int, int] = {}
    lines: list[str] = []
    ids = 0
    for e in trace.events:
        if e.action == "alloc":
            live[e.addr] = ids
            lines.append(f"a {ids} {e.size} {e.stream}")
            ids += 1
        elif e.action == "free_requested" and e.addr in live:
            lines.append(f"f {live.pop(e.addr)}")
    return lines, ids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", help="a snapshot with memory history (.pickle or .pickle.gz)")
    parser.add_argument("out", type=Path, help="where the program is written")
    parser.add_argument("--device", type=int, default=None, help="the device's history to take")
    args = parser.parse_args(argv)
    try:
        trace = load_trace(args.trace, device=args.device)
    except (OSError, TraceError) as err:
        print(f"trace_program: {err}", file=sys.stderr)
        return 2
    lines, ids = program(trace)
    args.out.write_text(f"{HEADER} {len(lines)} {ids}\n" + "\n".join(lines) + "\n")
    print(f"{args.out}: {len(lines)} operations, {ids} allocations")
    return 0


if __name__ == "__main__":
    sys.exit(main())
