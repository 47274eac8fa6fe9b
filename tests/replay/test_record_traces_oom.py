"""bench/replay/record_traces.py --oom without a GPU: its self-check covers the step loop that
catches out-of-memory errors; here the parent's orchestration runs for real and, with no CUDA
for the recording processes, reports every recording as failed, saying why, in its manifest."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import REPO

SCRIPT = REPO / "bench" / "replay" / "record_traces.py"


def test_oom_mode_without_a_gpu_writes_a_manifest_of_failures(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed (CPU build suffices)")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: this checks the no-GPU path")
    out = subprocess.run([sys.executable, str(SCRIPT), "--oom", "--out", str(tmp_path),
                          "--only", "convnet"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr
    manifest = json.loads((tmp_path / "oom_manifest.json").read_text())
    traces = manifest["traces"]
    assert [(t["workload"], t["setting"]) for t in traces] == [("convnet", "default"),
                                                               ("convnet", "gc")]
    assert all(t["status"] == "failed" and "CUDA is not available" in t["error"]
               for t in traces)
    assert manifest["oom_setting"]["max_ooms"] == 3
    assert "convnet__gc_oom" in out.stdout and "0 of 2 out-of-memory traces" in out.stdout
    assert not list(tmp_path.glob("*.pickle.gz"))


def test_oom_mode_refuses_workloads_it_does_not_record() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--oom", "--out", "unused", "--only",
                          "decode"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "nothing to record" in out.stderr
