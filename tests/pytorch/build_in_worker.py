"""test_native_build.py's worker: build.ensure_built in a process of its own. A module apart from
the test's, so that each spawned worker imports the build module alone, not the test module and
torch with it (seconds each)."""

from __future__ import annotations

from pathlib import Path

from allocator_ext.native import build


def build_in_worker(args: tuple[build.Plan, str]) -> str:
    plan, root = args
    try:
        return str(build.ensure_built(plan, root=Path(root)))
    except build.BuildError as e:
        return f"BuildError: {e}"
