"""allocwatch demo: a sidecar and a workload publishing to it, with a live summary."""

from __future__ import annotations

import argparse

HELP = "start a sidecar and a training workload publishing to it; print a live summary"
DESCRIPTION = """\
Starts a sidecar (temporary Unix socket, metrics on --port) and a training workload whose agent
publishes to it: a real PyTorch loop where a CUDA GPU is present, otherwise allocwatch's
allocator on the simulated device replaying, in a loop, the trace that ships with the project.
Prints where the metrics are, then one line a second (reserved, allocated, fragmentation,
retries) read back from /metrics, until --duration ends."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help=HELP, description=DESCRIPTION,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=30.0, metavar="S",
                        help="seconds to run (default 30)")
    parser.add_argument("--port", type=int, default=9464,
                        help="metrics port (default 9464; 0: any free port)")
    parser.add_argument("--workload", choices=("auto", "gpu", "sim"), default="auto",
                        help="auto (default): gpu where torch sees CUDA, else sim")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from exporter.demo import run_demo

    return run_demo(duration=args.duration, port=args.port, workload=args.workload)
