"""The agent writes a snapshot by itself when the allocator runs out of memory: without
stack frames, readable by the pod's containers only, capped in number, its path in the log."""

from __future__ import annotations

import gzip
import pickle
import stat
from pathlib import Path

import pytest

import allocator_ext as ae
from allocator_ext.agent import start_agent

MiB = 1 << 20


def run_out_of_memory(alloc: ae.Allocator) -> None:
    with pytest.raises(ae.OutOfMemoryError):
        alloc.malloc(512 * MiB)


def test_an_out_of_memory_error_leaves_a_snapshot(tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    alloc = ae.Allocator(ae.SimDevice(capacity=256 * MiB), "native")
    keep = alloc.malloc(100 * MiB)
    # No sidecar listens here: the agent keeps sampling regardless.
    agent = start_agent("unix:///nonexistent/allocwatch.sock", interval=3600, source=alloc,
                        snapshot_dir=tmp_path, nvml=False, stop_at_exit=False)
    try:
        agent.oom_snapshots.max_count = 1
        agent.oom_snapshots.min_interval = 0
        agent.sample_once()                      # baseline: no OOM yet, nothing written
        assert list(tmp_path.glob("*.pickle.gz")) == []
        run_out_of_memory(alloc)
        agent.sample_once()
        files = list(tmp_path.glob("*.pickle.gz"))
        assert len(files) == 1
        assert f"out of memory on cuda:0: snapshot written to {files[0]}" in caplog.text
        assert stat.S_IMODE(files[0].stat().st_mode) == 0o640
        snapshot = pickle.loads(gzip.decompress(files[0].read_bytes()))
        blocks = [b for s in snapshot["segments"] for b in s["blocks"]]
        assert any(b["state"] == "active_allocated" and b["size"] == 100 * MiB for b in blocks)
        assert all(b["frames"] == [] for b in blocks)
        run_out_of_memory(alloc)                  # the cap: one per process here
        agent.sample_once()
        assert len(list(tmp_path.glob("*.pickle.gz"))) == 1
    finally:
        agent.stop(0.5)
        alloc.free(keep)
