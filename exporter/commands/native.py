"""allocwatch native: the native back end (allocator_ext/native/), built for the torch here."""

from __future__ import annotations

import argparse
import sys

from exporter.commands._arguments import HelpFormatter

HELP = "build or inspect the native back end for the installed torch"
DESCRIPTION = """\
allocwatch's allocator serves PyTorch through a native back end compiled against the installed
torch (a C++ compiler, torch's headers and the CUDA runtime headers are needed). The first
process that needs it builds it, once per torch build, and caches it; `build` does that ahead
of time, for a container image or a shared cache, and retries a build that failed before.

  allocwatch native build            build (or rebuild) it now; prints where it is
  allocwatch native status           where it is, or why it cannot be built

The cache: ALLOCWATCH_NATIVE_DIR, else ~/.cache/allocwatch/native. A library in it is found
without a compiler: an image builds it in a builder stage and copies the cache into its final
stage, with the same torch at the same path (docs/deploy.md)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("native", help=HELP, description=DESCRIPTION,
                              formatter_class=HelpFormatter)
    p.add_argument("action", choices=["build", "status"])
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        import torch
    except ImportError:
        print("allocwatch native: torch is not installed", file=sys.stderr)
        return 1
    from allocator_ext.native import build

    try:
        if args.action == "status":
            key, describe = build.identity(torch)
            library = build.built(torch)
            if library is not None:
                print(f"built for {describe}: {library}")
                return 0
            failed = build.cache_dir() / key / build.FAILED_NAME
            if (reason := build.remembered_failure(failed)) is not None:
                print(f"not built, an earlier build failed: {reason}")
                return 1
            print(f"not built yet for {describe} (the first process that needs it builds it, "
                  f"or run `allocwatch native build`)")
            return 1
        plan = build.plan(torch)
        print(f"building for {plan.describe} ...", flush=True)
        library = build.ensure_built(plan, force=True)
    except build.BuildError as e:
        print(f"allocwatch native: {e}", file=sys.stderr)
        return 1
    print(f"built: {library}")
    return 0
