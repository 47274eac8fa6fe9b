"""The simulated device's physical memory follows the driver's rules: a physical allocation
released while still mapped holds its memory until its last mapping goes (cuMemRelease), as
pages moved between segments are, whose old address is unmapped only once the device is past
the move (Note [moving pages]). The checks are C++ (tests/native/sim_device_test.cpp: the
device's own calls, no allocator), compiled with the device alone."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from support.paths import REPO

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")


def test_released_physical_memory_stays_until_its_last_mapping_goes(tmp_path: Path) -> None:
    exe = tmp_path / "sim_device_test"
    src = REPO / "allocator_ext" / "csrc"
    subprocess.run(["c++", "-std=c++17", "-Wall", "-Wextra", "-Werror", f"-I{src}",
                    str(REPO / "tests" / "native" / "sim_device_test.cpp"),
                    str(src / "devices" / "sim_device.cpp"), "-o", str(exe)],
                   check=True, timeout=300)
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "FAIL" not in out.stdout
    assert out.stdout.count("ok  ") == 9
