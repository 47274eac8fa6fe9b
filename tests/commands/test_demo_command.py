"""`allocwatch demo` for real: a sidecar, a workload process on the simulated device, and the
live summary read back from /metrics."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support.paths import SHARED_TRACES

from exporter.commands.demo import EXAMPLE_TRACE, _synthetic_trace, demo_trace, run_sim_workload

ae = pytest.importorskip("allocator_ext._core", reason="the allocator core is not built")
Replayer = pytest.importorskip("allocator_ext.replay").Replayer
pytestmark = pytest.mark.timeout(120)


def test_demo_prints_address_and_live_summary() -> None:
    # The peak figure needs five readings of the workload's figures: 14 s leaves the workload
    # up to 9 s to start and report on a loaded machine.
    result = subprocess.run(
        [sys.executable, "-m", "exporter.cli", "demo", "--duration", "14", "--port", "0",
         "--workload", "sim"], capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert re.search(r"metrics:\s+http://127\.0\.0\.1:\d+/metrics", out)
    lines = [line for line in out.splitlines() if "reserved" in line and "fragmentation" in line]
    assert len(lines) >= 3, out
    reserved = [float(m.group(1)) for line in lines
                if (m := re.search(r"reserved\s+([\d.]+) GiB", line))]
    assert max(reserved) > 0, "the workload's figures never reached /metrics"
    # The headline is the peak figure (shown once a few seconds of readings span a pass of
    # the trace): allocwatch's allocator strands little at its peak, though most of its cache
    # is unused between the trace's steps.
    assert "peak fragmentation      -" in lines[0]
    peak = [float(m.group(1)) for line in lines
            if (m := re.search(r"peak fragmentation\s+([\d.]+)%", line))]
    unused = [float(m.group(1)) for line in lines if (m := re.search(r"unused now\s+([\d.]+)%",
                                                                       line))]
    assert peak and max(peak) < 5 and max(unused) > 30, out
    assert "agents 1" in lines[-1]
    assert out.rstrip().endswith("allocwatch demo: done")


def test_the_printed_ctl_line_works_as_printed() -> None:
    bin_dir = Path(sys.executable).parent
    if not (bin_dir / "allocwatch").exists():
        pytest.skip(f"the allocwatch command is not installed beside {sys.executable}")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    demo = subprocess.Popen(
        ["allocwatch", "demo", "--duration", "30", "--port", "0", "--workload", "sim"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert demo.stdout is not None
        printed = []
        for line in demo.stdout:  # up to the first figures: the agent has connected by then
            printed.append(line)
            if "agents 1" in line:
                break
        ctl = [line.strip() for line in printed if line.strip().startswith("allocwatch ctl")]
        assert len(ctl) == 1, "".join(printed)
        assert re.search(r"admin API: unix://\S+admin\.sock", "".join(printed))
        result = subprocess.run(ctl[0], shell=True, capture_output=True, text=True, env=env,
                                timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "allocwatch-demo" in result.stdout and "connected" in result.stdout
    finally:
        demo.send_signal(signal.SIGINT)
        demo.communicate(timeout=60)


def test_demo_without_a_gpu_refuses_the_gpu_workload() -> None:
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the GPU workload runs")
    result = subprocess.run(
        [sys.executable, "-m", "exporter.cli", "demo", "--workload", "gpu", "--duration", "5"],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--workload gpu needs a CUDA GPU" in result.stderr and "sees no CUDA GPU" in \
        result.stderr
    assert "reserved" not in result.stdout  # no run of zeros


def test_sim_workload_drives_the_allocator_until_stopped() -> None:
    replayer = Replayer(demo_trace())
    stop = threading.Event()

    def stop_once_it_allocated() -> None:
        # Stopped by what the workload did, not by a clock: a loaded machine only makes it wait.
        while replayer.allocator.stats()["allocation.all.allocated"] <= 100:
            time.sleep(0.01)
        stop.set()

    threading.Thread(target=stop_once_it_allocated, daemon=True).start()
    passes = run_sim_workload(replayer, stop, pace_seconds=0.0)
    stats = replayer.allocator.stats()
    assert passes >= 1
    assert stats["allocation.all.allocated"] > 100
    assert stats["allocated_bytes.all.current"] == 0  # each pass frees what it held
    assert stats["reserved_bytes.all.peak"] > 0


SHARED_TRACE = SHARED_TRACES / "gpt_varlen.pickle.gz"
TRACE = EXAMPLE_TRACE if EXAMPLE_TRACE.exists() else SHARED_TRACE


@pytest.mark.skipif(not TRACE.exists(), reason="neither the shipped example trace nor "
                    "../shared/traces is present")
def test_sim_workload_replays_a_recorded_trace() -> None:
    replayer = Replayer(demo_trace(TRACE))
    stop = threading.Event()
    threading.Timer(3.0, stop.set).start()
    assert run_sim_workload(replayer, stop, pace_seconds=0.0) >= 1
    stats = replayer.allocator.stats()
    assert stats["allocation.all.allocated"] > 5000  # the trace's ~10k allocations, at least half
    assert stats["num_ooms"] == 0


def test_trace_reader_refuses_classes(tmp_path: Path) -> None:
    import gzip
    import pickle

    hostile = tmp_path / "t.pickle.gz"
    with gzip.open(hostile, "wb") as f:
        pickle.dump({"device_traces": [[{"action": "alloc", "x": Path("/")}]]}, f)
    from allocator_ext.replay import TraceError

    with pytest.raises(TraceError, match="only plain data"):
        demo_trace(hostile)
    assert Replayer(_synthetic_trace(steps=2)).run_pass(release=True).peak_reserved_bytes > 0
