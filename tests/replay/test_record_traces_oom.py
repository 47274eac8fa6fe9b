"""bench/replay/record_traces.py --oom without a GPU: its self-check covers the step loop that
catches out-of-memory errors; here the parent's orchestration runs for real and, with no CUDA
for the recording processes, reports every recording as failed, saying why, in its manifest.
The retry under lower caps is driven by a stand-in for one recording process (what makes a GPU
run fit or fail is the GPU's); the manifest it writes beside an earlier one is real."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.paths import REPO

import bench.replay.record_traces as rt

MODULE = "bench.replay.record_traces"
RECORDED_MANIFEST = REPO / "tests" / "data" / "traces" / "oom_manifest.json"


class Recorder:
    """Stands in for one recording process: fits (no out-of-memory error) under every cap
    above `fails_below`, runs out of memory at or under it."""

    def __init__(self, fails_below: float, status: str = "ok") -> None:
        self.fails_below, self.status = fails_below, status
        self.caps: list[float] = []

    def __call__(self, cap: float, fraction: float) -> dict[str, Any]:
        self.caps.append(cap)
        failed = cap <= self.fails_below
        return {"status": self.status if failed else "no_oom", "memory_fraction": fraction,
                "allowed_bytes": int(fraction * 1000), "ooms_caught": 2 if failed else 0,
                "trace": {"actions": {"oom": 5}}}


def test_a_recording_that_runs_out_of_memory_at_once_keeps_the_first_cap() -> None:
    recorder = Recorder(fails_below=1.02)
    result = rt.record_under_lowering_caps(recorder, 500, 1000)
    assert recorder.caps == [1.02]
    assert result["status"] == "ok" and result["cap_of_peak_requested"] == 1.02
    assert result["memory_fraction"] == pytest.approx(0.51)
    assert [a["cap_of_peak_requested"] for a in result["attempts"]] == [1.02]


def test_a_recording_that_fits_is_recorded_again_under_lower_caps_until_one_fails() -> None:
    recorder = Recorder(fails_below=0.95)
    result = rt.record_under_lowering_caps(recorder, 500, 1000)
    assert recorder.caps == [1.02, 0.98, 0.94]
    assert result["status"] == "ok" and result["cap_of_peak_requested"] == 0.94
    attempts = result["attempts"]
    assert [a["status"] for a in attempts] == ["no_oom", "no_oom", "ok"]
    assert [a["memory_fraction"] for a in attempts] == pytest.approx([0.51, 0.49, 0.47])
    assert [a["ooms_caught"] for a in attempts] == [0, 0, 2]
    assert all(a["oom_events"] == 5 for a in attempts)  # cuDNN's, say, that it survived


def test_the_retries_are_bounded_and_a_run_that_never_fails_stays_unused() -> None:
    recorder = Recorder(fails_below=0.5)
    result = rt.record_under_lowering_caps(recorder, 500, 1000)
    assert recorder.caps == list(rt.OOM_CAPS) and len(rt.OOM_CAPS) <= 5
    assert result["status"] == "no_oom" and len(result["attempts"]) == len(rt.OOM_CAPS)


def test_a_recording_that_fails_otherwise_is_not_retried() -> None:
    recorder = Recorder(fails_below=2.0, status="failed")
    result = rt.record_under_lowering_caps(recorder, 500, 1000)
    assert recorder.caps == [1.02] and result["status"] == "failed"


def test_re_recording_one_trace_keeps_the_other_entries_of_the_folders_manifest(
        tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="torch is not installed (CPU build suffices)")
    if not RECORDED_MANIFEST.exists():
        pytest.skip(f"{RECORDED_MANIFEST} is absent: no earlier recording to keep entries from")
    earlier = json.loads(RECORDED_MANIFEST.read_text())
    (tmp_path / "oom_manifest.json").write_text(json.dumps(earlier))
    out = subprocess.run([sys.executable, "-m", MODULE, "--oom", "--out", str(tmp_path),
                          "--only", "convnet__gc"], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 1, out.stderr  # no CUDA here: the one recording failed
    manifest = json.loads((tmp_path / "oom_manifest.json").read_text())
    by_name = {(t["workload"], t["setting"]): t for t in manifest["traces"]}
    before = {(t["workload"], t["setting"]): t for t in earlier["traces"]}
    assert list(by_name) == list(before)  # the same traces, in the same order
    assert by_name.pop(("convnet", "gc"))["status"] == "failed"
    assert by_name == {k: v for k, v in before.items() if k != ("convnet", "gc")}
    # Each kept trace names the recording it came from: the one the earlier manifest named for
    # it, else the earlier manifest's own command.
    came_from = {n: e["command"] for e in earlier.get("earlier_recordings", [])
                 for n in e["traces"]}
    kept = {rt.trace_name(w, s, oom=True) for (w, s) in before if (w, s) != ("convnet", "gc")}
    named = {n: e["command"] for e in manifest["earlier_recordings"] for n in e["traces"]}
    assert set(named) == kept
    assert named == {n: came_from.get(n, earlier["command"]) for n in kept}
    assert "--only convnet__gc" in manifest["command"]


def test_oom_mode_without_a_gpu_writes_a_manifest_of_failures(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed (CPU build suffices)")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: this checks the no-GPU path")
    out = subprocess.run([sys.executable, "-m", MODULE, "--oom", "--out", str(tmp_path),
                          "--only", "convnet"], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
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
    out = subprocess.run([sys.executable, "-m", MODULE, "--oom", "--out", "unused", "--only",
                          "decode"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "nothing to record" in out.stderr
