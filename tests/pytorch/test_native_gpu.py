"""The native back end on a real GPU (marker gpu; skipped without one): each scenario of
tests/pytorch/gpu_scenarios.py in a fresh process, since the allocator is installed before CUDA
starts. Without a GPU, the same back end runs on the simulated device (test_native_sim.py), the
core's pools and history are tested there too (test_core_history_pools.py), and the back end is
compiled against this machine's torch (test_native_build.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCENARIOS = Path(__file__).resolve().parent / "gpu_scenarios.py"
NAMES = ["installed", "history_and_snapshot", "out_of_memory", "mempool", "graph_trees",
         "checkpoint_state", "cudnn_benchmark", "fraction_and_settings", "raw_alloc_statistics",
         "ipc"]


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_native_back_end_scenario(name: str) -> None:
    out = subprocess.run([sys.executable, str(SCENARIOS), name], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    assert f"PASS {name}" in out.stdout
