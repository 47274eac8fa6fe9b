"""The agents' listeners against connections that never become agents: on the TCP port (any local
user reaches it, no token needed to connect) 1,100 connections that send the HTTP/2 preface and
nothing more, under the usual 1,024-descriptor limit, run the sidecar out of nothing: they are
capped, each closed at the hello deadline from its accept whatever it sent (a SETTINGS
acknowledgement included), the oldest going first when a newcomer needs its place; scrapes,
probes, the admin socket and a new agent get through throughout. A connection that sent the
preface alone is held as a socket, never joined to the gRPC server."""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.admin import call
from support.sidecar import FakeSource, scrape, values
from support.waiting import terminate, wait_for

from allocator_ext.agent import start_agent
from allocator_ext.agent.auth import AgentToken
from bench.lib.ports import free_port

pytestmark = pytest.mark.timeout(180)

FILE_LIMIT = 1024
CROWD = 1100
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
EMPTY_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
SETTINGS_ACK = b"\x00\x00\x00\x04\x01\x00\x00\x00\x00"


def _limited_files() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (FILE_LIMIT, hard))


@pytest.fixture
def many_files() -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = CROWD + 300
    if hard != resource.RLIM_INFINITY and hard < wanted:
        pytest.skip(f"the hard file limit ({hard}) is below the {wanted} this test holds")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@contextlib.contextmanager
def sidecar_with_tcp(tmp_path: Path, hello_timeout: float = 2
                     ) -> Iterator[tuple[subprocess.Popen, str, int, str, Path]]:
    """`allocwatch sidecar` under a 1,024-descriptor limit with the agents' TCP port; yields the
    process, its metrics URL, the agents' TCP port, the admin socket and the token file."""
    metrics_port, agents_port = free_port(), free_port()
    run = tmp_path / "run"
    config = tmp_path / "sidecar.yaml"
    config.write_text(
        f"agents: {{unix_socket: {run / 'agent.sock'}, tcp_port: {agents_port}, "
        f"token_file: {run / 'agent-token'}, hello_timeout_seconds: {hello_timeout}}}\n"
        f"metrics: {{address: 127.0.0.1, port: {metrics_port}}}\n"
        "nvml: {enabled: false}\nlogging: {level: warning}\n")
    process = subprocess.Popen([sys.executable, "-m", "exporter.cli", "sidecar", "--config",
                                str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               preexec_fn=_limited_files)
    url = f"http://127.0.0.1:{metrics_port}"
    try:
        wait_for(lambda: urllib.request.urlopen(url + "/readyz", timeout=1).status == 200,
                 timeout=30, what="sidecar ready")
        yield process, url, agents_port, f"unix://{run / 'admin.sock'}", run / "agent-token"
    finally:
        terminate(process)
        process.communicate()


def _descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _preface_only(port: int, ack: bool) -> socket.socket | None:
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=2)
    except OSError:
        return None
    with contextlib.suppress(OSError):
        sock.sendall(PREFACE + (EMPTY_SETTINGS + SETTINGS_ACK if ack else b""))
    return sock


def test_preface_only_connections_neither_exhaust_descriptors_nor_lock_out_anyone(
        tmp_path: Path, many_files: None) -> None:
    with sidecar_with_tcp(tmp_path) as (process, url, port, admin, token_file):
        crowd: list[socket.socket] = []
        most = 0
        try:
            for n in range(CROWD):
                sock = _preface_only(port, ack=n % 2 == 1)
                if sock is not None:
                    crowd.append(sock)
                if n % 100 == 0:
                    most = max(most, _descriptors(process.pid))
                time.sleep(0.001)
            most = max(most, _descriptors(process.pid))
            # The sidecar keeps room: every listener still answers, at once.
            started = time.monotonic()
            text, _ = scrape(url, timeout=5)
            assert "allocwatch_agents_connected" in text
            assert urllib.request.urlopen(url + "/healthz", timeout=5).status == 200
            assert call(admin, "GET", "/v1/agents")[0] == 200
            assert time.monotonic() - started < 5
            agent = start_agent(f"127.0.0.1:{port}", interval=0.05, source=FakeSource(),
                                identity={"rank": 5}, nvml=False, stop_at_exit=False,
                                token=AgentToken(file=str(token_file)))
            try:
                wait_for(lambda: values(url, "allocwatch_agents_connected") == [1.0],
                         timeout=20, what="an agent connected beside the crowd")
            finally:
                agent.stop()
        finally:
            for sock in crowd:
                sock.close()
        assert most < FILE_LIMIT - 64, f"{most} descriptors open"
        closed = {reason: values(url, "allocwatch_http_connections_closed_total",
                                 server="agents", reason=reason)
                  for reason in ("idle_evicted", "hello_timeout")}
        assert sum(sum(v) for v in closed.values()) >= CROWD - 300, closed


def test_the_preface_alone_is_held_as_a_socket_and_a_frame_after_it_reaches_the_server(
        tmp_path: Path) -> None:
    # The connections are looked at for seconds: a hello deadline past that, on a loaded
    # machine too, so that none is closed by it meanwhile.
    with sidecar_with_tcp(tmp_path, hello_timeout=30) as (process, url, port, _, _):
        time.sleep(0.5)  # past the start's last steps
        before = _descriptors(process.pid)
        with contextlib.ExitStack() as stack:
            held = [stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=5))
                    for _ in range(40)]
            for sock in held:
                sock.sendall(PREFACE)
            wait_for(lambda: values(url, "allocwatch_http_connections", server="agents")
                     == [40.0], timeout=10, what="the 40 accepted")
            time.sleep(0.5)
            # One descriptor each: no relay, no connection of the gRPC server (three each).
            assert _descriptors(process.pid) - before < 40 + 20
            held[1].settimeout(0.5)
            with pytest.raises(TimeoutError):
                held[1].recv(1)  # the server's SETTINGS never came: nothing reached it
            # The SETTINGS frame that a client sends after its preface, in a write of its own.
            held[0].sendall(EMPTY_SETTINGS)
            frame = held[0].recv(9)
            assert len(frame) == 9 and frame[3] == 0x04, frame  # the server's SETTINGS


def test_a_connection_that_carries_no_agent_is_closed_at_the_hello_deadline(
        tmp_path: Path) -> None:
    with sidecar_with_tcp(tmp_path) as (_, url, port, _, _):
        # The preface and SETTINGS acknowledged: a healthy HTTP/2 connection, with no stream.
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(PREFACE + EMPTY_SETTINGS + SETTINGS_ACK)
            started = time.monotonic()
            with contextlib.suppress(ConnectionResetError):
                while sock.recv(1 << 16):
                    pass
            assert 1.5 < time.monotonic() - started < 6
        assert values(url, "allocwatch_http_connections_closed_total", server="agents",
                      reason="hello_timeout") == [1.0]
