"""The agent never blocks or crashes the training process: no sidecar, a sidecar killed and
restarted, a hung sidecar, bad settings, and exit."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
from support.paths import REPO
from support.sidecar import FakeSource, values
from support.waiting import wait_for

from allocator_ext.agent import maybe_start_from_env, start_agent
from allocator_ext.agent.backoff import Backoff
from bench.lib.ports import free_port

pytestmark = pytest.mark.timeout(90)


def test_no_sidecar_start_returns_at_once_and_drops_are_counted(tmp_path: Path) -> None:
    started = time.perf_counter()
    agent = start_agent(f"unix://{tmp_path}/absent.sock", interval=0.01, source=FakeSource(),
                        nvml=False, buffer_reports=8, stop_at_exit=False)
    assert time.perf_counter() - started < 0.5
    try:
        wait_for(lambda: agent.dropped >= 20, what="drops while nobody listens")
        assert len(agent.outbox) <= 8  # bounded
        wait_for(lambda: agent.reconnects >= 1 and "UNAVAILABLE" in (agent.last_error or ""),
                 what="a failed connection attempt, retried")
    finally:
        t0 = time.perf_counter()
        agent.stop()
        assert time.perf_counter() - t0 < 2.5


def _sidecar_process(config: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "exporter.cli", "sidecar", "--config",
                             str(config)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_sidecar_killed_and_restarted_agent_returns_and_counters_continue(tmp_path: Path) -> None:
    config, socket_path, url = _write_config(tmp_path)
    sidecar = _sidecar_process(config)
    source = FakeSource()
    agent = None
    try:
        wait_for(lambda: socket_path.exists() and values(url, "allocwatch_agents_connected")
                 == [0.0], timeout=20, what="sidecar up")
        agent = start_agent(f"unix://{socket_path}", interval=0.1, source=source,
                            backoff=Backoff(initial=0.1, maximum=1.0), nvml=False,
                            stop_at_exit=False)
        source.bump(num_alloc_retries=5)
        wait_for(lambda: values(url, "torch_cuda_allocator_alloc_retries_total") == [5.0],
                 what="first figures")
        sidecar.send_signal(signal.SIGKILL)
        sidecar.wait(10)
        # Training carries on meanwhile: the agent keeps sampling, never blocking us (1 s: what
        # a loaded machine may take to run a dict update, far short of a wait on the socket).
        t0 = time.perf_counter()
        source.bump(num_alloc_retries=2)
        assert time.perf_counter() - t0 < 1.0
        wait_for(lambda: not agent.connected.is_set(), what="the agent noticing")
        sidecar = _sidecar_process(config)
        # Ready: its agents' socket listens too (the metrics endpoint answers before it does).
        wait_for(lambda: urllib.request.urlopen(url + "/readyz", timeout=1).status == 200,
                 timeout=20, what="restarted sidecar")
        restarted = time.monotonic()
        wait_for(agent.connected.is_set, timeout=10, what="the agent back")
        assert time.monotonic() - restarted < 5.0  # its backoff is capped at 1 s
        wait_for(lambda: values(url, "torch_cuda_allocator_alloc_retries_total") == [7.0],
                 timeout=10, what="the agent back with its counters")
        # Counters continue from where they were: no reset, nothing lost.
        assert values(url, "allocwatch_agents_connected") == [1.0]
        assert agent.reconnects >= 1
    finally:
        if agent is not None:
            agent.stop()
        sidecar.kill()
        sidecar.wait(10)


def _write_config(tmp_path: Path) -> tuple[Path, Path, str]:
    port = free_port()
    socket_path = tmp_path / "run" / "agent.sock"
    config = tmp_path / "sidecar.yaml"
    config.write_text(textwrap.dedent(f"""\
        agents:
          unix_socket: {socket_path}
        metrics:
          address: 127.0.0.1
          port: {port}
        nvml:
          enabled: false
        """))
    return config, socket_path, f"http://127.0.0.1:{port}"


def test_hung_sidecar_keeps_agent_memory_bounded(tmp_path: Path) -> None:
    config, socket_path, url = _write_config(tmp_path)
    sidecar = _sidecar_process(config)
    agent = None
    try:
        wait_for(lambda: values(url, "allocwatch_agents_connected") == [0.0], timeout=20,
                 what="sidecar up")
        agent = start_agent(f"unix://{socket_path}", interval=0.001, source=FakeSource(),
                            nvml=False, buffer_reports=16, stop_at_exit=False)
        wait_for(agent.connected.is_set, what="connected")
        # A hung sidecar: the process is frozen, its socket stops draining. Once the socket
        # and gRPC's flow-control window are full, reports pile up only to the outbox's bound
        # and the oldest are dropped, counted.
        sidecar.send_signal(signal.SIGSTOP)
        wait_for(lambda: agent.dropped > 200, timeout=40, what="drops")
        assert len(agent.outbox) <= 16
        sampled = agent.sequence
        wait_for(lambda: agent.sequence > sampled + 50, what="sampling goes on")
        sidecar.send_signal(signal.SIGCONT)
        # Back to normal: the drops the agent counted reach /metrics.
        wait_for(lambda: (values(url, "allocwatch_agent_dropped_reports_total") or [0])[0] > 200,
                 timeout=20, what="drops reported")
    finally:
        sidecar.send_signal(signal.SIGCONT)
        if agent is not None:
            t0 = time.perf_counter()
            agent.stop()
            assert time.perf_counter() - t0 < 3
        sidecar.kill()
        sidecar.wait(10)


def test_env_start_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ALLOCWATCH_TARGET", raising=False)
    assert maybe_start_from_env(FakeSource()) is None
    monkeypatch.setenv("ALLOCWATCH_TARGET", "unix:///nonexistent/x.sock")
    monkeypatch.setenv("ALLOCWATCH_INTERVAL", "soon")
    assert maybe_start_from_env(FakeSource()) is None  # bad setting: warning, no agent


def test_env_started_agent_publishes_and_process_exits_promptly(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from support.sidecar import start_sidecar

    running = start_sidecar(tmp_path)
    url = running.sidecar.metrics_url
    # The child prints when its program ends (time.monotonic: the same clock in every process
    # here), so that what its exit takes is measured from there.
    script = textwrap.dedent("""\
        import sys, time
        sys.path.insert(0, %r)
        from support.sidecar import FakeSource
        from allocator_ext.agent import maybe_start_from_env
        agent = maybe_start_from_env(FakeSource())
        assert agent is not None
        assert maybe_start_from_env(FakeSource()) is agent  # once per process
        print("started", flush=True)
        time.sleep(float(sys.argv[1]))
        print(time.monotonic(), flush=True)
        """) % str(REPO / "tests")
    env = {**os.environ, "ALLOCWATCH_TARGET": running.sidecar.agent_targets[0],
           "ALLOCWATCH_INTERVAL": "0.1", "RANK": "4", "LOCAL_RANK": "0", "WORLD_SIZE": "8",
           "ALLOCWATCH_AGENT_NVML": "0"}
    try:
        child = subprocess.Popen([sys.executable, "-c", script, "3"], env=env,
                                 stdout=subprocess.PIPE, text=True)
        with caplog.at_level(logging.INFO, logger="exporter.grpc"):
            wait_for(lambda: values(url, "torch_cuda_allocator_reserved_bytes", rank="4"),
                     what="the child's series")
            info = [v for v in values(url, "torch_cuda_allocator_info", rank="4",
                                      world_size="8")]
            assert info == [1.0]
            out, _ = child.communicate(timeout=20)
            assert child.returncode == 0
            ended = float(out.split()[-1])
            # atexit: a goodbye, so the sidecar knows at once (not at a timeout).
            wait_for(lambda: values(url, "allocwatch_agents_connected") == [0.0], timeout=5,
                     what="the goodbye")
            reasons = wait_for(lambda: [getattr(r, "reason", "") for r in caplog.records
                                        if r.getMessage() == "agent disconnected"],
                               what="the departure logged")
        assert reasons == ["goodbye: process exiting"], reasons
        (state,) = running.sidecar.registry.agents()
        assert state.disconnected_monotonic - ended < 2.0

        # With the sidecar unreachable, exit is not delayed either.
        env["ALLOCWATCH_TARGET"] = f"unix://{tmp_path}/nobody.sock"
        unreachable = subprocess.run([sys.executable, "-c", script, "0.2"], env=env,
                                     stdout=subprocess.PIPE, text=True, timeout=30)
        exited = time.monotonic()
        assert unreachable.returncode == 0
        assert exited - float(unreachable.stdout.split()[-1]) < 4.0
    finally:
        running.stop()
