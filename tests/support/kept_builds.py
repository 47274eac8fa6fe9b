"""Where the tests' builds against the torch releases go (the back end of each release, the
simulated-device scenarios' allocator_calls.so): the session's temporary folder, or, where
ALLOCWATCH_TEST_BUILDS names a folder (.ci/run keeps ~/.cache/allocwatch/test-builds between
runs, as it keeps the releases), a folder of it named by everything the build is made from, so
that a build none of whose inputs changed since an earlier run is not made again (ccache does
the same for the CMake builds; it cannot cache a command that compiles and links at once).

A build's inputs: its command (compiler, flags, include folders, the release's folder, what it
links), the compiler's and the C library's versions, and the files named here (the back end's
sources are in its plan's key already: build.identity). A failed build is not kept: the next
run tries it again."""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from allocator_ext.native import build

ENVIRONMENT = "ALLOCWATCH_TEST_BUILDS"
# A kept build no run has used for this long is removed (every source change leaves one behind).
UNUSED_S = 14 * 24 * 3600
STAMP = ".used"


def kept_root() -> Path | None:
    configured = os.environ.get(ENVIRONMENT)
    return Path(configured) if configured else None


@functools.cache
def _toolchain(compiler: str) -> bytes:
    """The compiler's version (with its distribution's revision) and target, and the C
    library's version: what a system update changes under an unchanged command. (Not `-v`: with
    no input, a compiler wrapper that adds link flags runs the linker, naming temporary files.)"""
    said = [subprocess.run([compiler, flag], capture_output=True, timeout=60).stdout
            for flag in ("--version", "-dumpmachine")]
    libc = subprocess.run(["ldd", "--version"], capture_output=True, timeout=60)
    return b"".join(said) + libc.stdout.split(b"\n", 1)[0]


def folder(base: Path, command: Sequence[str], inputs: Iterable[Path] = ()) -> Path:
    """base/<digest of the command, its toolchain and the contents of `inputs`>, marked used."""
    digest = hashlib.sha256()
    for part in command:
        digest.update(part.encode() + b"\0")
    compiler = shutil.which(command[0]) or command[0]
    digest.update(_toolchain(compiler))
    for path in inputs:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    found = base / digest.hexdigest()[:20]
    found.mkdir(parents=True, exist_ok=True)
    (found / STAMP).touch()
    return found


def prune(base: Path, now: float | None = None) -> None:
    """Removes the kept builds no run has used for UNUSED_S."""
    now = time.time() if now is None else now
    for child in base.iterdir() if base.is_dir() else ():
        stamp = child / STAMP
        try:
            unused = now - stamp.stat().st_mtime > UNUSED_S
        except FileNotFoundError:
            continue  # being made by another session, or not one of these
        if unused:
            shutil.rmtree(child, ignore_errors=True)


def ensure_built(plan: build.Plan, base: Path, inputs: Iterable[Path] = ()) -> Path:
    """build.ensure_built(plan) in its kept folder under `base`; a failure is not kept."""
    root = folder(base, plan.command, inputs)
    try:
        return build.ensure_built(plan, root)
    except build.BuildError:
        (root / plan.key / build.FAILED_NAME).unlink(missing_ok=True)
        raise
