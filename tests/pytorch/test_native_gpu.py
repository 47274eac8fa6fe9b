"""The native back end on a real GPU (marker gpu; skipped without one): each scenario of
tests/pytorch/gpu_scenarios.py in a fresh process, since the allocator is installed before CUDA
starts. Without a GPU, the same back end runs on the simulated device (test_native_sim.py), the
core's pools and history are tested there too (test_core_history_pools.py), and the back end is
compiled against this machine's torch (test_native_build.py)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

SCENARIOS = Path(__file__).resolve().parent / "gpu_scenarios.py"
SEEDED = Path(__file__).resolve().parent / "seeded_snapshot.py"
NAMES = ["installed", "statistics", "history_and_snapshot", "out_of_memory", "record_stream",
         "graph_capture", "expandable_and_empty_cache", "mempool", "graph_trees",
         "checkpoint_state", "cudnn_benchmark", "fraction_and_settings", "every_setting",
         "raw_alloc_statistics", "ipc", "trace_trackers", "page_moves", "page_moves_off_thread",
         "waiting_frees", "waiting_frees_across_streams", "waiting_frees_off", "nccl_mempool"]


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_native_back_end_scenario(name: str) -> None:
    out = subprocess.run([sys.executable, str(SCENARIOS), name], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    skipped = [line for line in out.stdout.splitlines() if line.startswith(f"SKIP {name}: ")]
    if skipped:
        pytest.skip(skipped[0].removeprefix(f"SKIP {name}: "))
    assert f"PASS {name}" in out.stdout


@pytest.mark.gpu
def test_a_history_recorded_under_allocwatch_replays_to_pytorchs_own_figures(
        tmp_path: Path) -> None:
    """The same seeded workload, once under PyTorch's allocator (the reference) and once under
    allocwatch's native back end (its defaults) with memory history on: `allocwatch replay
    --config native` of allocwatch's snapshot gives the reference's peak reserved bytes and
    segment count (on the simulated device, with the core standing in for PyTorch:
    test_seeded_replay.py)."""
    from allocator_ext.replay import replay
    from allocator_ext.replay.trace import parse_snapshot

    env = {k: v for k, v in os.environ.items() if not k.startswith(("ALLOCWATCH_", "PYTORCH_"))}
    for mode in ("reference", "allocwatch"):
        out = subprocess.run([sys.executable, str(SEEDED), mode, str(tmp_path / mode)],
                             capture_output=True, text=True, timeout=300, env=env)
        assert out.returncode == 0 and f"PASS {mode}" in out.stdout, out.stderr[-4000:]
    reference = json.loads((tmp_path / "reference" / "stats.json").read_text())
    snapshot = pickle.loads((tmp_path / "allocwatch" / "snapshot.pickle").read_bytes())
    report = replay(parse_snapshot(snapshot, device=0), config="native").report
    assert report["peak_reserved_bytes"] == reference["reserved_bytes.all.peak"], report
    assert report["num_device_alloc"] == reference["num_device_alloc"], report
