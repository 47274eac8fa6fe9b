"""bench/replay/record_traces.py without a GPU: its self-check on the CPU build of torch, and its
trace summary on the shared traces recorded on an H200 (where ../shared is present)."""

from __future__ import annotations

import gzip
import pickle
import subprocess
import sys

import pytest
from support.paths import REPO, SHARED_TRACES

import bench.replay.record_traces as record_traces

MODULE = "bench.replay.record_traces"


def test_self_check_on_cpu_torch() -> None:
    pytest.importorskip("torch", reason="torch is not installed (pip install torch, CPU build)")
    record_traces.self_check()


def test_self_check_from_the_command_line() -> None:
    pytest.importorskip("torch", reason="torch is not installed (pip install torch, CPU build)")
    result = subprocess.run([sys.executable, "-m", MODULE, "--self-check"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "self-check passed" in result.stdout


def test_unknown_only_name_is_refused() -> None:
    result = subprocess.run([sys.executable, "-m", MODULE, "--out", "unused", "--only", "bogus"],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "bogus" in result.stderr


@pytest.mark.skipif(not SHARED_TRACES.is_dir(), reason=f"{SHARED_TRACES} is absent")
def test_summary_of_a_shared_trace() -> None:
    with gzip.open(SHARED_TRACES / "gpt_varlen.pickle.gz", "rb") as f:
        snapshot = pickle.load(f)  # the project's own test data, recorded on an H200
    summary = record_traces.summarize_trace(snapshot)
    assert summary["starts_empty"] and summary["segments_match_trace"]
    assert summary["actions"]["segment_alloc"] == 106
    assert summary["peak_reserved_bytes"] > 0
