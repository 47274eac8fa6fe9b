"""The core under sanitizers: 8 threads share one allocator on the simulated device and run
random operations while a checker recounts the invariants. AddressSanitizer and
UndefinedBehaviorSanitizer catch memory errors and leaks; ThreadSanitizer catches data races.
A few seconds each here; `bash bench/soak_core.sh` runs the same for 10 minutes."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from support.paths import REPO

BUILD = REPO / "tests" / "native" / "build_core_stress.sh"

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler (g++)")


@pytest.mark.parametrize("sanitizer", ["asan", "tsan"])
def test_core_survives_threads_under_sanitizers(sanitizer: str, tmp_path: Path) -> None:
    exe = tmp_path / f"core_stress_{sanitizer}"
    subprocess.run(["bash", str(BUILD), sanitizer, str(exe)], check=True, timeout=600)
    out = subprocess.run([str(exe), "--threads", "8", "--seconds", "3"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "WARNING: ThreadSanitizer" not in out.stderr
    assert "ERROR: AddressSanitizer" not in out.stderr
    assert out.stdout.count("ok=1") == 4         # every configuration of core_stress.cpp
