"""The admin API's request reader and its limits: a body is read only with a length that is one
(a negative or missing Content-Length is refused, a chunked body is read whole and counted
against the size limit, never dropped), nothing is decompressed, a refused request is answered
without waiting for its body and its connection closed, a client trickling its request
is closed at the idle deadline before its token is even looked at, one that never reads its
answer is cut at the request deadline, and a crowd of idle connections locks nobody out. Every
refusal changes nothing: no command reaches an agent."""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import socket
import time
from pathlib import Path

import pytest
from support.admin import call, closed_now, closed_within, exchange, raw_socket
from support.control import connect_agent, metric, start_control_sidecar
from support.sidecar import FakeSource
from support.waiting import wait_for

pytestmark = pytest.mark.timeout(60)
TOKEN = "4f1c0a9e7b2d4c6a8e0f1b3d5c7a9e2f"


def _post(path: str, headers: str, body: bytes = b"") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: allocwatch\r\n{headers}\r\n".encode() + body)


def _chunked(body: bytes, size: int = 7) -> bytes:
    chunks = [body[i:i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"


def _nothing_sent(running, sources) -> bool:
    return (all(source.calls == [] for source in sources)
            and metric(running, "allocwatch_commands_total") == 0.0)


@pytest.mark.parametrize("request_bytes, code", [
    (_post("/v1/reclaim", "Content-Length: -1\r\n", b'{"mode": "all"}'), 400),
    (_post("/v1/reclaim", ""), 411),
    (_post("/v1/reclaim", "Transfer-Encoding: chunked\r\n",
           _chunked(json.dumps({"mode": "all", "host": "x" * 100_000}).encode(), 4096)), 413),
    (_post("/v1/reclaim", f"Content-Length: {20 << 20}\r\n", b'{"mode": "all"'), 413),
    (_post("/v1/reclaim", "Content-Encoding: gzip\r\nContent-Length: 2\r\n", b"{}"), 415),
], ids=["negative length", "no length", "chunked, too large", "20 MB declared",
        "compressed"])
def test_a_body_without_a_usable_length_is_refused_and_sends_nothing(
        two_agents, caplog: pytest.LogCaptureFixture, request_bytes: bytes, code: int) -> None:
    running, address, sources = two_agents
    with caplog.at_level(logging.INFO, logger="exporter.admin"):
        status, _ = exchange(address, request_bytes)
    assert status == code
    assert _nothing_sent(running, sources)
    # What was sent shows in no log line: each stays short.
    assert all(len(record.getMessage()) + len(str(record.__dict__)) < 4000
               for record in caplog.records)


def test_a_chunked_body_is_read_with_its_selectors(two_agents) -> None:
    running, address, (first, second) = two_agents
    body = json.dumps({"mode": "all", "rank": 1}).encode()
    status, answer = exchange(address, _post("/v1/reclaim", "Transfer-Encoding: chunked\r\n",
                                             _chunked(body)))
    assert status == 200 and json.loads(answer)["selected"] == 1
    assert first.calls == [] and second.calls == [("reclaim", (0, True))]


def _answer_before_the_body(address: str, head: bytes, body: bytes) -> tuple[int, bool]:
    """Send a request's headers, read the answer before sending its body (as a client that
    waits 0.3 s between the two would), then send the body; (the answer's status, whether the
    server had closed the connection by then)."""
    with raw_socket(address, timeout=0.3) as sock:
        sock.sendall(head)
        response = http.client.HTTPResponse(sock, method="POST")
        response.begin()  # within 0.3 s: the body is not waited for
        response.read()
        closed = closed_within(sock, 1.0) is not None
        with contextlib.suppress(OSError):  # a reset: the connection is gone
            sock.sendall(body)
        return response.status, closed


def test_a_refused_request_is_answered_without_waiting_for_its_body_and_closed(
        two_agents, tmp_path: Path) -> None:
    running, address, sources = two_agents
    body = json.dumps({"mode": "all"}).encode()
    head = _post("/v1/reboot", f"Content-Length: {len(body)}\r\n")
    assert _answer_before_the_body(address, head, body) == (404, True)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    tcp_running = start_control_sidecar(tmp_path / "tcp", admin={
        "tcp_port": 0, "token_file": str(token_file)})
    try:
        tcp = next(a for a in tcp_running.sidecar.admin.addresses() if a.startswith("http://"))
        wrong = _post("/v1/reclaim", "Authorization: Bearer wrong\r\n"
                      f"Content-Length: {len(body)}\r\n")
        assert _answer_before_the_body(tcp, wrong, body) == (401, True)
        assert metric(tcp_running, "allocwatch_commands_total") == 0.0
    finally:
        tcp_running.stop()
    assert _nothing_sent(running, sources)


def test_a_client_trickling_its_request_is_closed_before_its_token_is_read(
        tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    running = start_control_sidecar(tmp_path, admin={
        "tcp_port": 0, "token_file": str(token_file), "limits": {"idle_timeout_seconds": 1}})
    try:
        tcp = next(a for a in running.sidecar.admin.addresses() if a.startswith("http://"))
        request = _post("/v1/reclaim", f"Authorization: Bearer {TOKEN}\r\n"
                        "Content-Length: 2\r\n", b"{}")
        with raw_socket(tcp) as trickling:
            assert (closed_within(trickling, 6, send=request) or 99) < 3
        assert metric(running, "allocwatch_admin_requests_total") == 0.0  # never a request
    finally:
        running.stop()


def test_a_client_that_never_reads_its_answer_is_cut_at_the_request_deadline(
        tmp_path: Path) -> None:
    running = start_control_sidecar(tmp_path, admin={
        "command_timeout_seconds": 0.5, "limits": {"request_timeout_seconds": 1.5}})
    snapshots = tmp_path / "run" / "snapshots"
    snapshots.mkdir(parents=True, exist_ok=True)
    (snapshots / "big.pickle").write_bytes(b"\0" * (64 << 20))  # far beyond socket buffers
    (address,) = running.sidecar.admin.addresses()
    try:
        with raw_socket(address) as reader:
            reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sent = time.monotonic()  # the request's deadline cannot start before this
            reader.sendall(b"GET /v1/snapshots/big.pickle HTTP/1.1\r\nHost: a\r\n\r\n")
            started = time.monotonic()
            while time.monotonic() - started < 1:  # the loop serves others meanwhile
                assert call(address, "GET", "/v1/agents")[0] == 200
                time.sleep(0.1)
            wait_for(lambda: metric(running, "allocwatch_http_connections_closed_total",
                                    server="admin", reason="request_timeout") == 1.0,
                     what="the reader cut at the request deadline")
            assert time.monotonic() - sent >= 1.5  # not before it
    finally:
        running.stop()


def test_a_crowd_of_idle_connections_locks_nobody_out(tmp_path: Path) -> None:
    running = start_control_sidecar(tmp_path, admin={"limits": {"max_connections": 8}})
    agent = connect_agent(running, tmp_path, FakeSource())
    (address,) = running.sidecar.admin.addresses()
    try:
        with contextlib.ExitStack() as stack:
            crowd = [stack.enter_context(raw_socket(address)) for _ in range(40)]
            status, answer = call(address, "POST", "/v1/reset-peaks", {})
            assert status == 200 and answer["ok"]
            assert sum(closed_now(sock) for sock in crowd) >= 40 - 8
    finally:
        agent.stop()
        running.stop()
