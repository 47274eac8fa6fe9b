"""Requests whose body never comes, against both HTTP listeners: a body the handler does not read
(a refusal, a GET that declares one) is never waited for, so the answer goes at once and the
connection closes; a body a handler reads that does not arrive is refused at
`body_timeout_seconds`, and meanwhile its connection gives its place to a newcomer. A crowd of
such requests locks out neither ctl (on the Unix socket or TCP) nor scrapes and probes."""

from __future__ import annotations

import contextlib
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.admin import call, raw_socket
from support.control import metric, start_control_sidecar
from support.sidecar import scrape

from exporter.sidecar.app import SidecarThread

pytestmark = pytest.mark.timeout(120)
TOKEN = "0d3c5b7a9f1e4d2c6b8a0f9e7d5c3b1a"


@pytest.fixture
def running(tmp_path: Path) -> Iterator[SidecarThread]:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    sidecar = start_control_sidecar(tmp_path, admin={
        "tcp_port": 0, "token_file": str(token_file),
        "limits": {"body_timeout_seconds": 1.0}})
    try:
        yield sidecar
    finally:
        sidecar.stop()


def _addresses(running: SidecarThread) -> tuple[str, str]:
    unix = next(a for a in running.sidecar.admin.addresses() if a.startswith("unix://"))
    tcp = next(a for a in running.sidecar.admin.addresses() if a.startswith("http://"))
    return unix, tcp


def _answer_and_close(sock: socket.socket, within: float) -> tuple[int, float, bool]:
    """(the answer's status, seconds until it began, whether the server then closed)."""
    started = time.monotonic()
    sock.settimeout(within)
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(1 << 16)
            if not chunk:
                break
            data += chunk
    except TimeoutError:
        return 0, time.monotonic() - started, False
    took = time.monotonic() - started
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0
    try:
        while sock.recv(1 << 16):
            pass
        closed = True
    except TimeoutError:
        closed = False
    except ConnectionResetError:
        closed = True
    return status, took, closed


@pytest.mark.parametrize("listener", ["unix", "tcp"])
def test_requests_declaring_a_body_they_never_send_are_answered_at_once_and_lock_nobody_out(
        running: SidecarThread, listener: str) -> None:
    unix, tcp = _addresses(running)
    address = unix if listener == "unix" else tcp
    # As many as the admin API's connection limit (32): before, each held its place for the
    # whole request deadline, counted busy, and every other client was refused meanwhile.
    request = (b"GET /v1/agents HTTP/1.1\r\nHost: allocwatch\r\n"
               b"Content-Length: 60000\r\n\r\n")
    with contextlib.ExitStack() as stack:
        crowd = [stack.enter_context(raw_socket(address)) for _ in range(32)]
        for sock in crowd:
            sock.sendall(request)
        answers = [_answer_and_close(sock, within=3) for sock in crowd]
    # The Unix socket's mode admits the caller (200); on TCP without the token: 401.
    expected = 200 if listener == "unix" else 401
    assert all(status == expected for status, _, _ in answers), answers
    assert max(took for _, took, _ in answers) < 2, answers
    assert all(closed for _, _, closed in answers), answers
    started = time.monotonic()
    status, _ = call(unix, "GET", "/v1/agents")
    assert status == 200 and time.monotonic() - started < 1


def test_a_body_that_does_not_arrive_is_refused_at_the_body_deadline_and_can_be_evicted(
        tmp_path: Path) -> None:
    running = start_control_sidecar(tmp_path, admin={
        "limits": {"body_timeout_seconds": 1.0, "max_connections": 4}})
    (unix,) = running.sidecar.admin.addresses()
    try:
        head = (b"POST /v1/reset-peaks HTTP/1.1\r\nHost: allocwatch\r\n"
                b"Content-Length: 100\r\n\r\n{\"rank\": ")
        with raw_socket(unix) as late:
            late.sendall(head)
            status, took, closed = _answer_and_close(late, within=5)
            assert (status, closed) == (408, True) and 0.8 < took < 3
        # Four connections waiting for their bodies fill the listener: a newcomer takes the
        # place of the one that has waited longest instead of being refused.
        with contextlib.ExitStack() as stack:
            waiting = [stack.enter_context(raw_socket(unix)) for _ in range(4)]
            for sock in waiting:
                sock.sendall(head)
            time.sleep(0.2)
            status, _ = call(unix, "GET", "/v1/agents")
            assert status == 200
        assert metric(running, "allocwatch_http_connections_closed_total", server="admin",
                      reason="body_timeout") >= 1
        assert metric(running, "allocwatch_http_connections_closed_total", server="admin",
                      reason="all_busy") == 0
    finally:
        running.stop()


def test_scrapes_and_probes_pass_beside_300_chunked_requests_without_a_chunk(
        running: SidecarThread) -> None:
    url = running.sidecar.metrics_url
    port = int(url.rsplit(":", 1)[1])
    request = (b"GET /metrics HTTP/1.1\r\nHost: allocwatch\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n")
    failures = []
    with contextlib.ExitStack() as stack:
        crowd = []
        for _ in range(300):  # a little apart, as a client gathering them would
            sock = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=5))
            sock.sendall(request)
            crowd.append(sock)
            time.sleep(0.003)
        deadline = time.monotonic() + 8
        probes = 0
        while time.monotonic() < deadline:
            for path in ("/metrics", "/healthz"):
                started = time.monotonic()
                try:
                    if path == "/metrics":
                        scrape(url, timeout=2)
                    else:
                        urllib.request.urlopen(url + path, timeout=2).read()
                except OSError as err:
                    failures.append(f"{path}: {err}")
                probes += 1
                assert time.monotonic() - started < 2
            time.sleep(0.2)
    assert probes >= 20 and failures == []
