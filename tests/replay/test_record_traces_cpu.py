"""bench/replay/record_traces.py without a GPU: its self-check on the CPU build of torch, and its
trace summary on the shared traces recorded on an H200 (where ../shared is present)."""

from __future__ import annotations

import gzip
import importlib.util
import pickle
import subprocess
import sys
from types import ModuleType

import pytest
from support.paths import REPO, SHARED_TRACES

SCRIPT = REPO / "bench" / "replay" / "record_traces.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("record_traces", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_self_check_on_cpu_torch() -> None:
    pytest.importorskip("torch", reason="torch is not installed (pip install torch, CPU build)")
    _load().self_check()


def test_self_check_from_the_command_line() -> None:
    pytest.importorskip("torch", reason="torch is not installed (pip install torch, CPU build)")
    result = subprocess.run([sys.executable, str(SCRIPT), "--self-check"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "self-check passed" in result.stdout


def test_unknown_only_name_is_refused() -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), "--out", "unused", "--only", "bogus"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "bogus" in result.stderr


@pytest.mark.skipif(not SHARED_TRACES.is_dir(), reason=f"{SHARED_TRACES} is absent")
def test_summary_of_a_shared_trace() -> None:
    with gzip.open(SHARED_TRACES / "gpt_varlen.pickle.gz", "rb") as f:
        snapshot = pickle.load(f)  # the project's own test data, recorded on an H200
    summary = _load().summarize_trace(snapshot)
    assert summary["starts_empty"] and summary["segments_match_trace"]
    assert summary["actions"]["segment_alloc"] == 106
    assert summary["peak_reserved_bytes"] > 0
