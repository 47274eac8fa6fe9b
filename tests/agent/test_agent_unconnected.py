"""A job whose agent never reaches the sidecar is said loudly: in the training process's own log
(the agent warns once, after a bounded time, naming the target and the reason, even where the
program configured no logging), and as a metric of the sidecar, which counts how long it has
waited for its first agent (AllocwatchNoAgentConnected reads it). An agent connects only once
its process uses a GPU; until then it samples nothing, sends nothing, never warns and never
initialises NVML."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from support.environment import without_allocwatch
from support.fake_nvml import FakePynvml
from support.paths import REPO
from support.sidecar import FakeSource, MiB, start_sidecar, values
from support.waiting import wait_for

from allocator_ext.agent import start_agent

pytestmark = pytest.mark.timeout(90)

TRAINER = textwrap.dedent("""
    import time
    import allocator_ext as ae
    from allocator_ext.agent import maybe_start_from_env

    alloc = ae.Allocator(ae.SimDevice(capacity=1 << 30))
    agent = maybe_start_from_env(source=alloc)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not agent.warned_unconnected:
        alloc.free(alloc.malloc(1 << 20, stream=0))
        time.sleep(0.05)
    time.sleep(1.0)  # time enough for a second warning, were there one
    print("trained", flush=True)
""")


def test_the_trainer_log_says_once_where_the_agent_could_not_reach(tmp_path: Path) -> None:
    target = f"unix://{tmp_path}/nobody-listens.sock"
    # A bound the first failed attempt (milliseconds, more on a loaded machine) comes well
    # within, so that the warning can name its reason.
    env = without_allocwatch(ALLOCWATCH_TARGET=target, ALLOCWATCH_INTERVAL="0.1",
                             ALLOCWATCH_WARN_UNCONNECTED_SECONDS="2",
                             ALLOCWATCH_AGENT_NVML="0")
    out = subprocess.run([sys.executable, "-c", TRAINER], capture_output=True, text=True,
                         env=env, cwd=REPO, timeout=60)
    assert out.returncode == 0 and "trained" in out.stdout, out.stderr
    warnings = [line for line in out.stderr.splitlines() if "has not reached its sidecar" in line]
    assert len(warnings) == 1, out.stderr
    assert target in warnings[0] and "UNAVAILABLE" in warnings[0]
    assert "not published" in warnings[0]


def test_an_agent_that_connects_does_not_warn(tmp_path: Path) -> None:
    sidecar = start_sidecar(tmp_path)
    bound = 2.0  # a connection on a loaded machine comes well within it
    agent = start_agent(sidecar.sidecar.agent_targets[0], interval=0.05,
                        source=FakeSource(), nvml=False, stop_at_exit=False,
                        warn_unconnected_after=bound)
    try:
        wait_for(lambda: agent.connected.is_set(), what="the agent's connection")
        # Its wait counts from before it connected: after this, each sample is past the bound.
        time.sleep(bound)
        sampled = agent.sequence
        wait_for(lambda: agent.sequence > sampled + 1, what="samples past the warning's bound")
        assert not agent.warned_unconnected
    finally:
        agent.stop()
        sidecar.stop()


def test_the_sidecar_counts_its_wait_for_a_first_agent(tmp_path: Path) -> None:
    sidecar = start_sidecar(tmp_path)
    url = sidecar.sidecar.metrics_url
    try:
        first = wait_for(lambda: values(url, "allocwatch_agent_wait_seconds"), what="the gauge")
        later = wait_for(lambda: [v for v in values(url, "allocwatch_agent_wait_seconds")
                                  if v > first[0]], what="the wait to grow")
        assert later[0] > first[0] > 0
        agent = start_agent(sidecar.sidecar.agent_targets[0], interval=0.1,
                            source=FakeSource(), nvml=False, stop_at_exit=False)
        wait_for(lambda: values(url, "allocwatch_agent_wait_seconds") == [0.0],
                 what="0 once an agent connected")
        agent.stop()
        wait_for(lambda: values(url, "allocwatch_agents_connected") == [0.0], what="departure")
        # The agent left: that is AllocwatchAgentGone's case; the wait stays over.
        assert values(url, "allocwatch_agent_wait_seconds") == [0.0]
    finally:
        sidecar.stop()


def test_an_agent_connects_only_once_its_process_uses_a_gpu(tmp_path: Path) -> None:
    # A DataLoader worker or a preprocessing pool imports torch but never touches the GPU: its
    # agent must not show in the sidecar as a second process with its parent's rank.
    sidecar = start_sidecar(tmp_path)
    url = sidecar.sidecar.metrics_url
    source = FakeSource(devices={})
    agent = start_agent(sidecar.sidecar.agent_targets[0], interval=0.05, source=source,
                        nvml=False, stop_at_exit=False, warn_unconnected_after=0.2)
    try:
        time.sleep(1.0)  # twenty intervals, and five times the warning's bound
        assert not agent.connected.is_set() and not agent.warned_unconnected
        assert agent.sequence == 0 and len(agent.outbox) == 0  # nothing sampled, nothing queued
        assert values(url, "allocwatch_agents_connected") == [0.0]
        assert agent.identity.cuda_device == -1  # started before CUDA was: no device yet
        with source.lock:  # the process's first CUDA allocation
            source.uuids[0] = "GPU-fake-0"
            source.stats[0] = source._initial()
        wait_for(lambda: values(url, "allocwatch_agents_connected") == [1.0],
                 what="the agent's connection after its first GPU use")
        assert agent.outbox.dropped == 0
        # The Hello carried the device it uses, known by then.
        assert (agent.identity.cuda_device, agent.identity.gpu_uuid) == (0, "GPU-fake-0")
    finally:
        agent.stop()
        sidecar.stop()


class InitRecordingNvml(FakePynvml):
    """A stand-in for pynvml (no NVML library here) that records the threads calling
    nvmlInit."""

    def __init__(self, gpus: list) -> None:
        super().__init__(gpus)
        self.init_threads: list[str] = []

    def nvmlInit(self) -> None:  # noqa: N802 (pynvml's name)
        self.init_threads.append(threading.current_thread().name)
        super().nvmlInit()


def test_nvml_starts_at_the_first_gpu_use_on_the_agents_thread(tmp_path: Path) -> None:
    # nvmlInit can take seconds where the GPUs are not in persistence mode: neither the
    # program's import of torch (where the agent starts) nor a DataLoader worker that never
    # uses a GPU may wait for it.
    sidecar = start_sidecar(tmp_path, nvml=False)
    url = sidecar.sidecar.metrics_url
    nvml = InitRecordingNvml([("GPU-3333", 40 * MiB * 1024, 5 * MiB * 1024, {})])
    source = FakeSource(devices={})
    agent = start_agent(sidecar.sidecar.agent_targets[0], interval=0.05, source=source,
                        nvml=nvml, stop_at_exit=False)
    try:
        time.sleep(0.5)  # ten intervals without a GPU
        assert nvml.init_threads == []
        with source.lock:  # the process's first CUDA allocation
            source.uuids[0] = ""
            source.stats[0] = source._initial()
        wait_for(lambda: values(url, "allocwatch_gpu_memory_total_bytes") == [40 * MiB * 1024],
                 what="the GPU's figures from the agent's NVML")
        assert nvml.init_threads == ["allocwatch-agent-sampler"]  # once, and not ours
        assert agent.identity.gpu_uuid == "GPU-3333"  # from NVML, the source had none
    finally:
        agent.stop()
        sidecar.stop()


def test_a_process_that_imports_torch_and_never_uses_cuda_stays_unseen(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="torch is not installed")
    sidecar = start_sidecar(tmp_path)
    url = sidecar.sidecar.metrics_url
    script = textwrap.dedent("""
        import time
        import torch
        from allocator_ext.agent import maybe_start_from_env

        agent = maybe_start_from_env(source="pytorch")
        torch.ones(1000).sum()  # CPU work only, as a DataLoader worker's
        time.sleep(1.5)
        print("connected" if agent.connected.is_set() else "unseen", agent.sequence, flush=True)
    """)
    env = without_allocwatch(ALLOCWATCH_TARGET=sidecar.sidecar.agent_targets[0],
                             ALLOCWATCH_INTERVAL="0.1",
                             ALLOCWATCH_WARN_UNCONNECTED_SECONDS="0.3",
                             ALLOCWATCH_AGENT_NVML="0")
    try:
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             env=env, cwd=REPO, timeout=60)
        assert out.returncode == 0 and out.stdout.split() == ["unseen", "0"], out.stderr
        assert "has not reached its sidecar" not in out.stderr
        assert values(url, "allocwatch_agents_connected") == [0.0]
    finally:
        sidecar.stop()


@pytest.mark.parametrize("setting, started, connected", [
    ("start", True, True), ("first-gpu-use", True, False), ("at-once", False, False)])
def test_the_environment_chooses_when_the_agent_connects(tmp_path: Path, setting: str,
                                                        started: bool, connected: bool) -> None:
    # ALLOCWATCH_AGENT_CONNECT=start connects a process with no GPU in use (a deployment
    # checked on a machine without one); a value it does not know starts no agent, and says so.
    pytest.importorskip("torch", reason="torch is not installed")
    sidecar = start_sidecar(tmp_path)
    script = textwrap.dedent("""
        import time, logging
        logging.basicConfig()
        import torch
        from allocator_ext.agent import maybe_start_from_env

        agent = maybe_start_from_env(source="pytorch")
        deadline = time.monotonic() + 10
        while agent is not None and not agent.connected.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5 if agent is None or agent.connected.is_set() else 0)
        print(agent is not None, agent is not None and agent.connected.is_set(), flush=True)
    """)
    env = without_allocwatch(ALLOCWATCH_TARGET=sidecar.sidecar.agent_targets[0],
                             ALLOCWATCH_INTERVAL="0.1", ALLOCWATCH_AGENT_NVML="0",
                             ALLOCWATCH_AGENT_CONNECT=setting)
    try:
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             env=env, cwd=REPO, timeout=60)
        assert out.returncode == 0 and out.stdout.split() == [str(started), str(connected)], (
            out.stdout, out.stderr)
        if not started:
            assert "ALLOCWATCH_AGENT_CONNECT='at-once'" in out.stderr and "start" in out.stderr
    finally:
        sidecar.stop()
