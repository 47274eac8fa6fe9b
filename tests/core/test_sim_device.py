"""The simulated device's physical memory follows the driver's rules: a physical allocation
released while still mapped holds its memory until its last mapping goes (cuMemRelease), as
pages moved between segments are, whose old address is unmapped only once the device is past
the move (Note [moving pages]). The checks are C++ (tests/native/sim_device_test.cpp: the
device's own calls, no allocator), compiled with the device alone."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from support.native_checks import run_native_checks

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")


def test_released_physical_memory_stays_until_its_last_mapping_goes(tmp_path: Path) -> None:
    out = run_native_checks(tmp_path, "sim_device_test", "devices/sim_device.cpp",
                            "core/unmapper.cpp")
    assert out.count("ok  ") == 9
