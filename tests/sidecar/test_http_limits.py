"""The metrics endpoint's limits against crowded and hostile clients: idle connections never
starve scrapes or agents (not even past the process's file limit), silent connections are held
apart from aiohttp's and go first, oldest first, a client that says nothing, or trickles its
request a byte at a time (however long it kept silent first), is closed at the idle deadline
from its accept, and oversized headers are refused. Every limit is counted in
allocwatch_http_connections_closed_total."""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import resource
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.admin import closed_now, closed_within, exchange, raw_socket
from support.sidecar import FakeSource, scrape, values
from support.waiting import terminate, wait_for

from allocator_ext.agent import start_agent
from bench.lib.ports import free_port
from exporter.shared.bounded_http import BoundedHttpServer
from exporter.sidecar.app import SidecarThread
from exporter.sidecar.config import parse_config

pytestmark = pytest.mark.timeout(120)

FILE_LIMIT = 1024  # the usual soft limit of a container's processes
CROWD = 1100       # more idle connections than that limit


def _limited_files() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (FILE_LIMIT, hard))


@contextlib.contextmanager
def sidecar_process(tmp_path: Path, extra_yaml: str = "") -> Iterator[tuple[str, str]]:
    """`allocwatch sidecar` in a process of its own under a 1,024-file soft limit; yields its
    metrics URL and the agents' target."""
    port = free_port()
    socket_path = tmp_path / "run" / "agent.sock"
    config = tmp_path / "sidecar.yaml"
    config.write_text(f"agents: {{unix_socket: {socket_path}}}\n"
                      f"metrics: {{address: 127.0.0.1, port: {port}}}\n"
                      f"nvml: {{enabled: false}}\nlogging: {{level: warning}}\n{extra_yaml}")
    process = subprocess.Popen([sys.executable, "-m", "exporter.cli", "sidecar", "--config",
                                str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               preexec_fn=_limited_files)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: urllib.request.urlopen(url + "/readyz", timeout=1).status == 200,
                 timeout=30, what="sidecar ready")
        yield url, f"unix://{socket_path}"
    finally:
        terminate(process)
        process.communicate()


def idle_crowd(port: int, count: int) -> list[socket.socket]:
    """`count` connections that will never say anything, opened a little apart, as a client
    gathering them would (all at once, most would wait in the listen queue)."""
    crowd = []
    for _ in range(count):
        try:
            crowd.append(socket.create_connection(("127.0.0.1", port), timeout=2))
        except TimeoutError:
            break  # the listener takes no more: what follows says what that costs
        time.sleep(0.002)
    return crowd


@pytest.fixture
def many_files() -> Iterator[None]:
    """This process may hold the crowd's sockets (raised up to the hard limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = CROWD + 200
    if hard != resource.RLIM_INFINITY and hard < wanted:
        pytest.skip(f"the hard file limit ({hard}) is below the {wanted} this test holds")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_crowd_of_idle_connections_starves_neither_scrapes_nor_agents(
        tmp_path: Path, many_files: None) -> None:
    with sidecar_process(tmp_path) as (url, target):
        port = int(url.rsplit(":", 1)[1])
        crowd = idle_crowd(port, CROWD)
        try:
            started = time.monotonic()
            text, _ = scrape(url, timeout=5)
            assert "allocwatch_agents_connected" in text
            assert time.monotonic() - started < 5
            agent = start_agent(target, interval=0.05, source=FakeSource(),
                                identity={"rank": 3}, nvml=False, stop_at_exit=False)
            try:
                wait_for(lambda: values(url, "allocwatch_agents_connected") == [1.0],
                         timeout=15, what="an agent connected beside the crowd")
            finally:
                agent.stop()
            # The listener keeps within its limit (256 by default) by closing idle ones.
            assert values(url, "allocwatch_http_connections", server="metrics")[0] <= 257
            evicted = values(url, "allocwatch_http_connections_closed_total", server="metrics",
                             reason="idle_evicted")
            assert evicted and evicted[0] >= CROWD - 256
        finally:
            for sock in crowd:
                sock.close()


@contextlib.contextmanager
def limited_sidecar(tmp_path: Path, idle_timeout: float
                    ) -> Iterator[tuple[str, BoundedHttpServer]]:
    """A sidecar whose metrics listener has small limits (8 connections); yields its URL and
    that listener."""
    parsed = parse_config({"metrics": {"address": "127.0.0.1", "port": 0, "limits": {
        "max_connections": 8, "idle_timeout_seconds": idle_timeout,
        "request_timeout_seconds": 2}},
        "agents": {"unix_socket": str(tmp_path / "run" / "agent.sock")},
        "nvml": {"enabled": False}})
    running = SidecarThread(parsed).start()
    try:
        assert running.sidecar.http is not None
        yield running.sidecar.metrics_url, running.sidecar.http.http
    finally:
        running.stop()


@pytest.fixture
def limited(tmp_path: Path) -> Iterator[str]:
    with limited_sidecar(tmp_path, idle_timeout=1) as (url, _):
        yield url


def all_handed_over(server: BoundedHttpServer, count: int) -> bool:
    """Whether the listener holds `count` connections, every one of them aiohttp's: none
    silent, none in the middle of its hand-over."""
    acceptor = server._acceptor  # no public view of these lines: the tests look in
    return server.connections() == count and not acceptor.waiting and not acceptor.handing


def get_over(sock: socket.socket, path: str = "/metrics") -> tuple[int, str]:
    """GET `path` over an open connection (kept alive): (status, body)."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    response = http.client.HTTPResponse(sock, method="GET")
    response.begin()
    return response.status, response.read().decode()


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of the sample `name` with exactly these labels in an exposition."""
    for family in text_string_to_metric_families(text):
        for found in family.samples:
            if found.name == name and found.labels == labels:
                return found.value
    return None


def test_a_silent_or_trickling_client_is_closed_at_the_idle_deadline(limited: str) -> None:
    with raw_socket(limited) as silent, raw_socket(limited) as trickling:
        assert (closed_within(silent, 5) or 99) < 3
        request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: y\r\n" * 20
        assert (closed_within(trickling, 5, send=request) or 99) < 3
    # A client that finished its request was never idle: it has its answer.
    status, body = exchange(limited, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (status, body) == (200, b"ok\n")


def test_silent_connections_are_counted_and_closed_at_their_idle_deadline(tmp_path: Path
                                                                          ) -> None:
    idle_timeout = 5  # time enough to count them on a loaded machine before it
    with limited_sidecar(tmp_path, idle_timeout) as (limited, server):
        port = int(limited.rsplit(":", 1)[1])
        for _ in range(20):  # ended before a byte, as a TCP probe is: nothing to serve or hold
            socket.create_connection(("127.0.0.1", port)).close()
        # This scrape's connection is accepted after the probes': any place they took from
        # each other is counted in it.
        evicted = values(limited, "allocwatch_http_connections_closed_total", server="metrics")
        wait_for(lambda: server.connections() == 0, what="the probes' ends seen")
        connected = time.monotonic()  # before any accept: no deadline falls earlier
        silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(6)]
        try:
            # The six silent ones and this scrape's connection.
            wait_for(lambda: values(limited, "allocwatch_http_connections",
                                    server="metrics") == [7.0], what="the silent ones counted")
            assert [closed_now(sock) for sock in silent] == [False] * 6
            closed_at: dict[int, float] = {}

            def all_closed() -> bool:
                for i, sock in enumerate(silent):
                    if i not in closed_at and closed_now(sock):
                        closed_at[i] = time.monotonic()  # after the close: never early
                return len(closed_at) == len(silent)

            wait_for(all_closed, timeout=20, interval=0.02, what="the idle deadline")
            assert min(closed_at.values()) - connected >= idle_timeout
        finally:
            for sock in silent:
                sock.close()
        wait_for(lambda: server.connections() == 0, what="the silent ones gone")
        assert values(limited, "allocwatch_http_connections", server="metrics") == [1.0]
        # The deadline closed them, not the limit.
        assert values(limited, "allocwatch_http_connections_closed_total", server="metrics"
                      ) == evicted


@dataclasses.dataclass(frozen=True)
class Listener:
    address: str             # http://host:port or unix:///path
    server: str              # its label in allocwatch_http_connections{server}
    path: str                # a GET it answers without a token
    metrics_url: str         # where its counters are read
    http: BoundedHttpServer  # the listener itself, whose connections are watched


@pytest.fixture(params=["metrics over TCP", "admin API over its Unix socket"])
def small_listener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Listener]:
    """One of the sidecar's listeners limited to 8 connections (idle deadline 30 s: far past
    what a test takes, on a loaded machine too, so that only the limit closes connections)."""
    limits = {"max_connections": 8, "idle_timeout_seconds": 30, "request_timeout_seconds": 2}
    parsed = parse_config({
        "metrics": {"address": "127.0.0.1", "port": 0, "limits": limits},
        "admin": {"command_timeout_seconds": 1, "limits": limits},
        "agents": {"unix_socket": str(tmp_path / "run" / "agent.sock")},
        "nvml": {"enabled": False}})
    running = SidecarThread(parsed).start()
    url = running.sidecar.metrics_url
    try:
        if request.param.startswith("metrics"):
            assert running.sidecar.http is not None
            yield Listener(url, "metrics", "/healthz", url, running.sidecar.http.http)
        else:
            assert running.sidecar.admin is not None
            (address,) = running.sidecar.admin.addresses()
            yield Listener(address, "admin", "/v1/agents", url, running.sidecar.admin.http)
    finally:
        running.stop()


def test_past_the_connection_limit_silent_connections_go_first_oldest_first(
        small_listener: Listener) -> None:
    listener = small_listener
    with contextlib.ExitStack() as stack:
        kept_alive = stack.enter_context(raw_socket(listener.address))
        assert get_over(kept_alive, listener.path)[0] == 200
        # Older than every silent one, spoken but its request unfinished: aiohttp has it.
        trickling = stack.enter_context(raw_socket(listener.address))
        trickling.sendall(f"GET {listener.path} HTTP/1.1\r\n".encode())
        wait_for(lambda: all_handed_over(listener.http, 2), what="the trickling one handed over")
        silent = [stack.enter_context(raw_socket(listener.address)) for _ in range(12)]
        # 14 connections for 8 places: 6 must go (once all 14 are accepted); which ones follows.
        wait_for(lambda: sum(closed_now(sock) for sock in [kept_alive, trickling, *silent]) >= 6,
                 what="six connections closed")
        # The 6 oldest silent ones went, those that spoke stay.
        assert [closed_now(sock) for sock in silent] == [True] * 6 + [False] * 6
        assert not closed_now(trickling)
        # The silent ones count.
        assert values(listener.metrics_url, "allocwatch_http_connections",
                      server=listener.server) == [8.0]
        # That scrape's connection closed (on the metrics listener): only ours are left.
        wait_for(lambda: listener.http.connections() == 2 + sum(
            not closed_now(sock) for sock in silent), what="the scrape's connection gone")
        assert exchange(listener.address,
                        f"GET {listener.path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())[0] == 200
        # A client on a new connection took the place of the oldest silent one left: on the
        # metrics listener that scrape, on the admin API this exchange.
        assert [closed_now(sock) for sock in silent] == [True] * 7 + [False] * 5
        # ...and those that spoke are served: the request finished, the kept-alive one.
        trickling.sendall(b"Host: x\r\n\r\n")
        response = http.client.HTTPResponse(trickling, method="GET")
        response.begin()
        assert response.status == 200 and response.read()
        assert get_over(kept_alive, listener.path)[0] == 200
        for sock in silent:
            sock.close()
        # Their ends (and the exchange's) seen: no place is taken from anyone below.
        wait_for(lambda: listener.http.connections() == 2, what="the silent ones' ends seen")
        assert values(listener.metrics_url, "allocwatch_http_connections_closed_total",
                      server=listener.server, reason="idle_evicted") == [7.0]


def test_past_the_connection_limit_the_idle_connections_of_clients_that_spoke_go_next(
        tmp_path: Path) -> None:
    """With no silent connection to close: the one that never began a request, then the one
    idle longest."""
    # Idle deadline 30 s: far past what the test takes, so that only the limit closes any.
    with limited_sidecar(tmp_path, idle_timeout=30) as (limited, server), \
            contextlib.ExitStack() as stack:
        served = [stack.enter_context(raw_socket(limited)) for _ in range(7)]
        for sock in served:
            assert get_over(sock, "/healthz")[0] == 200
        assert get_over(served[0], "/healthz")[0] == 200  # now idle the shortest
        trickling = stack.enter_context(raw_socket(limited))
        trickling.sendall(b"GET /metrics HTTP/1.1\r\n")
        wait_for(lambda: all_handed_over(server, 8), what="the trickling one handed over")
        # Each newcomer served before the next connects: its request began, so it is neither
        # silent nor one that never began a request when the next needs a place.
        for _ in range(2):
            newcomer = stack.enter_context(raw_socket(limited))
            assert get_over(newcomer, "/healthz")[0] == 200
        assert closed_now(trickling)
        assert [closed_now(sock) for sock in served] == [False, True] + [False] * 5
        status, text = get_over(served[0])
        assert sample(text, "allocwatch_http_connections_closed_total", server="metrics",
                      reason="idle_evicted") == 2.0


def test_a_client_silent_before_trickling_is_closed_at_the_idle_deadline_from_its_accept(
        tmp_path: Path) -> None:
    """Its silence and its trickle share one deadline: the hand-over to aiohttp on its
    first byte does not start another."""
    with limited_sidecar(tmp_path, idle_timeout=4) as (url, _), raw_socket(url) as client:
        started = time.monotonic()
        time.sleep(3)
        request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: y\r\n" * 20
        assert closed_within(client, 5, send=request) is not None
        assert time.monotonic() - started < 6.5  # a second deadline would close it at 7 or later


@pytest.mark.parametrize("request_bytes", [
    b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n",
    b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(40))
    + b"\r\n",
    b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
], ids=["a 9 kB header", "40 headers", "a 9 kB request line"])
def test_oversized_headers_are_refused(limited: str, request_bytes: bytes) -> None:
    status, _ = exchange(limited, request_bytes)
    assert status in (400, 413, 414, 431)
    assert exchange(limited, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")[0] == 200


def test_only_get_and_head_are_served(limited: str) -> None:
    assert exchange(limited, b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
                    )[0] == 405
    status, body = exchange(limited, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (status, body) == (200, b"")
