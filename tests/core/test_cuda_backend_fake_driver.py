"""The cuda back end and bench/native/device_call_costs on a stand-in libcuda.so.1 (no GPU needed).

tests/native/fake_libcuda.cpp implements the driver functions the back end loads, over host
memory, and checks the structures it is passed at the real cuda.h offsets. This proves the
loading, context handling, error paths and event pool; the real driver's behaviour is proved
on the GPU by `bash bench/gpu/gpu_checks.sh probes` (device_call_costs on the real driver).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from support.paths import BENCH_BUILD, BENCH_BUILD_GROUP, REPO

BUILD = REPO / "bench" / "native" / "build.sh"
BUILD_NATIVE = REPO / "bench" / "native" / "build_native.sh"

pytestmark = [pytest.mark.skipif(shutil.which("cmake") is None or shutil.which("c++") is None,
                                 reason="no CMake or no C++ compiler"),
              pytest.mark.xdist_group(BENCH_BUILD_GROUP)]


@pytest.fixture(scope="module")
def native_build() -> Path:
    """bench/CMakeLists.txt's back-end test, stand-in driver (in fake_libcuda/) and
    device_call_costs (by build_native.sh, as the GPU session builds it), in the benchmarks'
    build folder, where the core is compiled once for them and the benchmarks."""
    for command in (["bash", str(BUILD_NATIVE), str(BENCH_BUILD)],
                    ["bash", str(BUILD), str(BENCH_BUILD), "cuda_device_fake_driver_test",
                     "fake_libcuda"]):
        result = subprocess.run(command, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
    return BENCH_BUILD


@pytest.fixture(scope="module")
def fake_driver_dir(native_build: Path) -> Path:
    return native_build / "fake_libcuda"


def _run_with_fake_driver(fake_dir: Path, argv: list[str]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, LD_LIBRARY_PATH=str(fake_dir))
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)


def test_cuda_device_on_fake_driver(native_build: Path, fake_driver_dir: Path) -> None:
    result = _run_with_fake_driver(fake_driver_dir,
                                   [str(native_build / "cuda_device_fake_driver_test")])
    assert result.returncode == 0, result.stdout + result.stderr
    assert " 0 failed" in result.stdout


def test_device_call_costs_writes_cost_table(native_build: Path, fake_driver_dir: Path,
                                             tmp_path: Path) -> None:
    table = tmp_path / "costs.json"
    result = _run_with_fake_driver(
        fake_driver_dir, [str(native_build / "device_call_costs"), "--quick", "--json",
                          str(table)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "memory check: mapped and plain device memory written and read back" in result.stdout
    costs = json.loads(table.read_text())
    assert costs["device"] == "Fake GPU"
    assert set(costs["calls"]) == {"segment_alloc", "segment_free", "create", "map", "map_only",
                                   "set_access", "unmap", "release", "reserve", "address_free",
                                   "synchronize"}
    for entry in costs["calls"].values():
        assert entry["fixed_s"] >= 0 and entry["per_byte_s"] >= 0
    assert costs["command"].endswith(f"--quick --json {table}")
    # The stand-in driver refuses what the docs leave open (an unmap over several mappings,
    # mapping by offset): the probes report that, and the run carries on.
    probes = costs["probes"]
    assert probes["unmap_spanning_mappings"]["cu_result"] != 0
    assert probes["map_pieces_by_offset"]["cu_result"] != 0
    assert "probe: one cuMemUnmap over 8 mappings refused" in result.stdout
    # A 1000 MiB growth made back to back, in 2 MiB pages and in 10 MiB chunks, each timed whole
    # (the memory written and read back in between).
    burst = probes["growth_burst"]
    assert (burst["bytes"], burst["chunk_bytes"]) == (1000 << 20, 10 << 20)
    assert burst["single_pages_s"] > 0 and burst["chunks_s"] > 0
    assert "probe: 1000 MiB grown in a row: 500 single pages" in result.stdout
    # One page's calls first after a synchronisation and while the device works, and the
    # work's own time alone and with 40 pages' calls meanwhile. The stand-in's work is done at
    # once, so it never still runs after them.
    busy = probes["calls_while_busy"]
    assert (busy["rounds"], busy["pages"], busy["work_still_running"]) == (3, 40, 0)
    assert busy["work_alone_s"] > 0 and busy["work_with_calls_s"] > 0
    for side in ("after_synchronize_s", "busy_s"):
        assert set(busy[side]) == {"create", "map_only", "set_access", "unmap", "release"}
        assert all(v > 0 for v in busy[side].values()), busy
    assert "probe: one page's calls first after a synchronisation -> while" in result.stdout


def test_device_call_costs_fails_clearly_without_a_driver(native_build: Path,
                                                          tmp_path: Path) -> None:
    env = dict(os.environ, LD_LIBRARY_PATH=str(tmp_path))  # a folder with no libcuda.so.1
    result = subprocess.run([str(native_build / "device_call_costs"), "--quick"], env=env,
                            capture_output=True, text=True, timeout=60)
    if result.returncode == 0:
        pytest.skip("a real CUDA driver is installed here")
    assert result.returncode == 1
    assert "cannot load the CUDA driver libcuda.so.1" in result.stderr
