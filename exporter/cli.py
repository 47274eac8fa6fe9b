"""The `allocwatch` command line.

Subcommands are modules (or packages) of exporter.commands, found at start-up: each defines
`register(subparsers)`, which adds its parser and sets `func` (called with the parsed arguments,
returning the exit status), and holds the command's code beside it. A new command is a new
module there; this one need not change.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence

import exporter.commands
from allocator_ext.protocol.version import PACKAGE_VERSION

# The order commands appear in --help; commands not listed follow alphabetically.
COMMAND_ORDER = ["sidecar", "demo", "replay", "tune", "run", "ctl"]


def _command_modules() -> list[str]:
    names = [m.name for m in pkgutil.iter_modules(exporter.commands.__path__)
             if not m.name.startswith("_")]
    rank = {name: i for i, name in enumerate(COMMAND_ORDER)}
    return sorted(names, key=lambda n: (rank.get(n, len(rank)), n))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="allocwatch",
        description="Watch and steer the GPU caching allocator of PyTorch training jobs.",
        epilog="Run 'allocwatch COMMAND --help' for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"allocwatch {PACKAGE_VERSION}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in _command_modules():
        module = importlib.import_module(f"exporter.commands.{name}")
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
