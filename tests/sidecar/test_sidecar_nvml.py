"""Device figures from NVML.

There is no GPU (and no NVML library) on the CI machine, so the GPU itself is faked: a stand-in
pynvml module is injected where a test needs NVML to answer. The "no NVML" path runs for real.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.fake_nvml import FakePynvml
from support.paths import REPO
from support.sidecar import FakeSource, samples, start_sidecar, values
from support.waiting import wait_for

from allocator_ext.agent import start_agent
from allocator_ext.protocol.nvml import NvmlReader

pytestmark = pytest.mark.timeout(60)
GiB = 1 << 30
DEVICE_NAMES = ("allocwatch_gpu_memory_total_bytes", "allocwatch_gpu_memory_used_bytes",
                "allocwatch_process_gpu_memory_used_bytes")


def test_without_nvml_a_warning_and_no_device_series(tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    # The real pynvml on a machine without the NVIDIA driver (CI's case).
    probe = NvmlReader()
    if probe.start():
        probe.close()
        pytest.skip("NVML works on this machine; this test covers machines without it")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="exporter.nvml"):
        running = start_sidecar(tmp_path)
    try:
        assert any("NVML unavailable" in r.getMessage() for r in caplog.records)
        url = running.sidecar.metrics_url
        agent = start_agent(running.sidecar.agent_targets[0], interval=0.1, source=FakeSource(),
                            nvml=True, stop_at_exit=False)  # the agent's real NVML path too
        try:
            wait_for(lambda: values(url, "torch_cuda_allocator_reserved_bytes"), what="report")
            names = {name for name, _ in samples(url)}
            assert not names & set(DEVICE_NAMES)
        finally:
            agent.stop()
    finally:
        running.stop()


def test_sidecar_reads_its_own_gpus(tmp_path: Path) -> None:
    fake = FakePynvml([("GPU-0000", 80 * GiB, 10 * GiB, {os.getpid(): 3 * GiB}),
                       ("GPU-1111", 80 * GiB, 1 * GiB, {})])
    running = start_sidecar(tmp_path, nvml_module=fake)
    url = running.sidecar.metrics_url
    agent = start_agent(running.sidecar.agent_targets[0], interval=0.1,
                        source=FakeSource({0: "GPU-0000"}), identity={"rank": 0}, nvml=False,
                        stop_at_exit=False)
    try:
        wait_for(lambda: values(url, "torch_cuda_allocator_reserved_bytes"), what="report")
        assert values(url, "allocwatch_gpu_memory_total_bytes", gpu_uuid="GPU-0000") == [80 * GiB]
        assert values(url, "allocwatch_gpu_memory_used_bytes", gpu_uuid="GPU-1111") == [1 * GiB]
        # Same PID namespace here: the sidecar matches the agent's pid in NVML's process list.
        assert values(url, "allocwatch_process_gpu_memory_used_bytes", rank="0",
                      gpu_uuid="GPU-0000") == [3 * GiB]

        # NVML fails mid-run: device series stop, allocator series carry on.
        fake.fail = True
        wait_for(lambda: not values(url, "allocwatch_gpu_memory_total_bytes"), what="stop")
        assert values(url, "torch_cuda_allocator_reserved_bytes")
        fake.fail = False
        wait_for(lambda: values(url, "allocwatch_gpu_memory_total_bytes"), what="recovery")
    finally:
        agent.stop()
        running.stop()


@pytest.mark.parametrize("connect_at_start", [False, True])
def test_agent_reports_its_own_gpu_where_the_sidecar_sees_none(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, connect_at_start: bool) -> None:
    # Kubernetes: the sidecar container has no GPU; the training container's agent reads NVML.
    # Its CUDA device 0 is the node's second GPU, which only NVML can name (the source cannot);
    # an agent that connects at start says so in its first Hello.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    fake = FakePynvml([("GPU-1111", 80 * GiB, 70 * GiB, {}),
                       ("GPU-2222", 40 * GiB, 5 * GiB, {os.getpid(): 2 * GiB})])
    running = start_sidecar(tmp_path, nvml=False)
    url = running.sidecar.metrics_url
    agent = start_agent(running.sidecar.agent_targets[0], interval=0.1,
                        source=FakeSource({0: ""}), identity={"rank": 1}, nvml=fake,
                        stop_at_exit=False, connect_at_start=connect_at_start)
    try:
        wait_for(lambda: values(url, "allocwatch_gpu_memory_total_bytes"), what="device series")
        assert values(url, "allocwatch_gpu_memory_total_bytes") == [40 * GiB]
        assert values(url, "allocwatch_gpu_memory_used_bytes", gpu_uuid="GPU-2222") == [5 * GiB]
        assert values(url, "allocwatch_process_gpu_memory_used_bytes", rank="1") == [2 * GiB]
        # The agent learnt its GPU's UUID from NVML (CUDA device 0 -> the second GPU).
        assert agent.identity.gpu_uuid == "GPU-2222"
        assert values(url, "torch_cuda_allocator_reserved_bytes", gpu_uuid="GPU-2222")
    finally:
        agent.stop()
        running.stop()


def test_reader_maps_visible_devices_and_survives_process_query_errors() -> None:
    fake = FakePynvml([("GPU-a", 10, 1, {}), ("GPU-b", 20, 2, {})])

    def refuse(handle: int) -> list:
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")

    fake.nvmlDeviceGetComputeRunningProcesses = refuse  # type: ignore[method-assign]
    reader = NvmlReader(fake, cache_seconds=0)
    assert reader.start()
    assert [g.uuid for g in reader.read()] == ["GPU-a", "GPU-b"]
    assert reader.find(index=1).total_bytes == 20  # type: ignore[union-attr]
    assert reader.find(uuid="GPU-a").index == 0  # type: ignore[union-attr]
    assert reader.find(uuid="GPU-zzz") is None


# A process whose NVML initialisation, on another thread, is under way when the main thread
# forks (a DataLoader starting its workers at the first step). The fork must wait for it: the
# child would otherwise inherit NVML's locks held by a thread it does not have.
FORK_DURING_NVML_INIT = """
import os, sys, threading, time
sys.path.insert(0, "tests")
from support.fake_nvml import FakePynvml
from support.paths import REPO
from allocator_ext.protocol import nvml

class SlowInit(FakePynvml):
    def nvmlInit(self):
        self.entered.set()
        time.sleep(0.5)
        self.done_at = time.monotonic()

fake = SlowInit([("GPU-1", 1 << 30, 0, {})])
fake.entered = threading.Event()
reader = nvml.NvmlReader(fake)
starting = threading.Thread(target=reader.start)
starting.start()
fake.entered.wait()
pid = os.fork()
if pid == 0:  # NVML was up when the fork came, and the child's own calls are not held up
    lock = getattr(nvml, "_nvml_calls", None)
    os._exit(0 if (lock is None or not lock.locked()) and reader.read() else 3)
forked_at = time.monotonic()
_, status = os.waitpid(pid, 0)
starting.join()
waited = "waited" if forked_at >= fake.done_at else "forked mid-init"
print(waited, os.waitstatus_to_exitcode(status))
"""


def test_a_fork_waits_for_an_nvml_call_under_way() -> None:
    out = subprocess.run([sys.executable, "-c", FORK_DURING_NVML_INIT], capture_output=True,
                         text=True, cwd=REPO, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["waited", "0"], out.stdout + out.stderr


def test_a_fork_waits_for_a_hung_nvml_call_only_so_long() -> None:
    # An NVML call that hangs with its GPU: the fork goes ahead after FORK_WAIT_SECONDS.
    script = (FORK_DURING_NVML_INIT
              .replace("time.sleep(0.5)", "time.sleep(2)")
              .replace("reader = nvml.NvmlReader(fake)",
                       "nvml.FORK_WAIT_SECONDS = 0.2\nreader = nvml.NvmlReader(fake)"))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=REPO, timeout=30)
    assert out.returncode == 0, out.stderr
    # The child forked mid-call: NVML was not up in its copy (exit status 3), but it ran.
    assert out.stdout.split() == ["forked", "mid-init", "3"], out.stdout + out.stderr


# The fork comes while another thread's read hangs inside NVML, past FORK_WAIT_SECONDS: the
# child's own reads must not wait for the reader's lock, which that thread held at the fork.
FORK_DURING_A_HUNG_READ = """
import os, signal, sys, threading, time
sys.path.insert(0, "tests")
from support.fake_nvml import FakePynvml
from allocator_ext.protocol import nvml

class HungRead(FakePynvml):
    def nvmlDeviceGetMemoryInfo(self, handle):
        if threading.current_thread().name == "hung-reader":
            self.entered.set()
            time.sleep(3)
        return super().nvmlDeviceGetMemoryInfo(handle)

fake = HungRead([("GPU-1", 1 << 30, 0, {})])
fake.entered = threading.Event()
nvml.FORK_WAIT_SECONDS = 0.2
reader = nvml.NvmlReader(fake, cache_seconds=0)
reader.start()
threading.Thread(target=reader.read, name="hung-reader", daemon=True).start()
fake.entered.wait()
pid = os.fork()
if pid == 0:
    os._exit(0 if reader.read() else 3)
# A child held by the lock never ends: a generous wait costs nothing when it is not held, and a
# loaded machine may take seconds to run the child at all.
deadline = time.monotonic() + 15
while time.monotonic() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        print("child", os.waitstatus_to_exitcode(status))
        break
    time.sleep(0.02)
else:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    print("child hung")
"""


def test_a_child_forked_during_a_hung_read_reads_on_its_own() -> None:
    out = subprocess.run([sys.executable, "-c", FORK_DURING_A_HUNG_READ], capture_output=True,
                         text=True, cwd=REPO, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["child", "0"], out.stdout + out.stderr
