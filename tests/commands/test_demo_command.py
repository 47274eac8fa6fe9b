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


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait is missing


def _processes_naming(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc")
@pytest.mark.parametrize("how", ["SIGINT to its process group (Ctrl-C)", "SIGTERM",
                                 "SIGHUP (its terminal closed)", "its parent killed",
                                 "SIGKILL (its workload cleans up)"])
def test_demo_stops_within_a_second_leaving_nothing(how: str, tmp_path: Path) -> None:
    allocwatch = Path(sys.executable).with_name("allocwatch")
    if not allocwatch.exists():
        pytest.skip(f"the allocwatch command is not installed beside {sys.executable}")
    # Started where a checkout's packages would shadow the installed ones, were the workload
    # to import from its working directory (`python -m` does, from the directory it starts in).
    for package in ("allocator_ext", "exporter"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text(
            "raise ImportError('imported from the working directory')\n")
    demo_argv = [str(allocwatch), "demo", "--duration", "120", "--port", "0", "--workload",
                 "sim"]
    if how == "its parent killed":
        # A shell that started the demo in the background, then died without a word.
        started = subprocess.Popen(["sh", "-c", '"$@" & echo "demo $!"; wait', "sh",
                                    *demo_argv], cwd=tmp_path, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True)
    else:
        started = subprocess.Popen(demo_argv, cwd=tmp_path, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True)
    assert started.stdout is not None
    printed, demo_pid = [], started.pid
    try:
        for line in started.stdout:  # up to the first figures with the agent connected
            printed.append(line)
            if line.startswith("demo "):
                demo_pid = int(line.split()[1])
            if "agents 1" in line or "workload exited" in line:
                break
        text = "".join(printed)
        assert "agents 1" in text, text
        directory = re.search(r"unix://(/\S+)/agent\.sock", text).group(1)  # type: ignore[union-attr]
        workload = [pid for pid in _processes_naming(directory) if pid != demo_pid]
        assert workload and Path(directory).is_dir()
        signals = {"SIGTERM": signal.SIGTERM, "SIGHUP (its terminal closed)": signal.SIGHUP}
        began = time.monotonic()
        if how.startswith("SIGINT"):
            os.killpg(started.pid, signal.SIGINT)
        elif how in signals:
            os.kill(demo_pid, signals[how])
        elif how == "its parent killed":
            started.kill()
        else:
            os.kill(demo_pid, signal.SIGKILL)
        while time.monotonic() - began < 10 and (
                any(_alive(pid) for pid in [demo_pid, *workload]) or Path(directory).exists()):
            time.sleep(0.01)
        took = time.monotonic() - began
        left = [pid for pid in [demo_pid, *workload] if _alive(pid)]
        assert not left and not Path(directory).exists(), (left, directory, text)
        # The demo's budget is a second; 2 s leaves a loaded machine its delays, and still
        # fails a stop that waits out a timeout of its own (an agent's 2 s stop, a watch that
        # never fires).
        assert took <= 2.0, f"{how}: everything gone after {took:.2f} s"
    finally:
        for pid in _processes_naming(str(tmp_path)) + [demo_pid]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        started.kill()
        started.communicate(timeout=30)
    if how in ("SIGTERM", "SIGHUP (its terminal closed)") or how.startswith("SIGINT"):
        signum = signal.SIGINT if how.startswith("SIGINT") else signals[how]
        assert started.returncode == 128 + signum


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

    def stop_in_the_second_pass() -> None:
        # Stopped by what the workload did, not by a clock: a loaded machine only makes it wait.
        # Early in a pass after the first (between passes the position still reads the end), so
        # that pauses remain before the pass could end.
        end = len(replayer.trace.events)
        while not (replayer.passes >= 1 and 100 <= replayer.position < end // 2):
            time.sleep(0.001)
        stop.set()

    threading.Thread(target=stop_in_the_second_pass, daemon=True).start()
    passes = run_sim_workload(replayer, stop, pace_seconds=0.0)
    stats = replayer.allocator.stats()
    assert passes == replayer.passes >= 1
    # The pass under way was abandoned at once (a stop waits for a pause, not a pass)...
    assert 0 < replayer.position < len(replayer.trace.events)
    assert stats["allocation.all.allocated"] > 100
    # ...and what it held freed, as each pass frees what it held at its end.
    assert stats["allocated_bytes.all.current"] == 0
    assert stats["reserved_bytes.all.peak"] > 0


SHARED_TRACE = SHARED_TRACES / "gpt_varlen.pickle.gz"
TRACE = EXAMPLE_TRACE if EXAMPLE_TRACE.exists() else SHARED_TRACE


@pytest.mark.skipif(not TRACE.exists(), reason="neither the shipped example trace nor "
                    "../shared/traces is present")
def test_sim_workload_replays_a_recorded_trace() -> None:
    replayer = Replayer(demo_trace(TRACE))
    stop = threading.Event()

    def stop_after_a_pass() -> None:
        while replayer.passes < 1:
            time.sleep(0.01)
        stop.set()

    threading.Thread(target=stop_after_a_pass, daemon=True).start()
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
