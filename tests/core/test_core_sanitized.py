"""The core under sanitizers: 8 threads share one allocator on the simulated device and run
random operations while a checker recounts the invariants. AddressSanitizer and
UndefinedBehaviorSanitizer catch memory errors and leaks; ThreadSanitizer catches data races.
A few seconds each here; `bash bench/native/soak_core.sh` runs the same for 10 minutes."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from support.paths import REPO

BUILD = REPO / "bench" / "native" / "build.sh"  # bench/CMakeLists.txt's core_stress

pytestmark = pytest.mark.skipif(shutil.which("cmake") is None or shutil.which("c++") is None,
                                reason="no CMake or no C++ compiler")


@pytest.mark.parametrize("sanitizer", ["asan", "tsan"])
def test_core_survives_threads_under_sanitizers(sanitizer: str, tmp_path: Path) -> None:
    subprocess.run(["bash", str(BUILD), f"--{sanitizer}", str(tmp_path), "core_stress"],
                   check=True, timeout=600)
    exe = tmp_path / "core_stress"
    out = subprocess.run([str(exe), "--threads", "8", "--seconds", "3"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "WARNING: ThreadSanitizer" not in out.stderr
    assert "ERROR: AddressSanitizer" not in out.stderr
    assert out.stdout.count("ok=1") == 4         # every configuration of core_stress.cpp
    # Page moves' old places were unmapped by the allocator's own thread meanwhile.
    assert any(int(n) > 0 for n in re.findall(r"(\d+) unmaps off the allocating threads",
                                               out.stdout)), out.stdout
