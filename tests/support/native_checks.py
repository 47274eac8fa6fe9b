"""The C++ checks that tests/core compiles on their own (tests/native/*_test.cpp, each with
tests/native/expect.h): built with the allocator's sources they name, run, and their output
handed back once every check printed "ok"."""

from __future__ import annotations

import subprocess
from pathlib import Path

from support.paths import REPO

CSRC = REPO / "allocator_ext" / "csrc"


def run_native_checks(tmp_path: Path, test: str, *sources: str) -> str:
    """Compiles tests/native/`test`.cpp with `sources` (paths under allocator_ext/csrc), runs
    it, and returns what it printed; fails the test where it did not exit cleanly or a check
    printed FAIL."""
    exe = tmp_path / test
    subprocess.run(["c++", "-std=c++17", "-Wall", "-Wextra", "-Werror", f"-I{CSRC}",
                    str(REPO / "tests" / "native" / f"{test}.cpp"),
                    *(str(CSRC / s) for s in sources), "-o", str(exe)],
                   check=True, timeout=300)
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "FAIL" not in out.stdout
    return out.stdout
