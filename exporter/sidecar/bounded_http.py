"""HTTP on the sidecar's own event loop (aiohttp's low-level server), every resource a client
can take bounded: the metrics endpoint and the admin API both serve through it.

- connections: at most `max_connections` open; one more closes the oldest idle connection
  (one with no request in progress) that never completed a request (silent or trickling
  clients go first, before a scraper's kept-alive connection), else the oldest idle one, or,
  when every one is busy, the newcomer; each counted;
- time: `idle_timeout_seconds` from a connection's start, or from its last response, to the end
  of its next request's headers (a client trickling its headers is closed at that deadline:
  aiohttp's keep-alive timer, armed at connection start); `request_timeout_seconds` from then to
  the last byte of the response (a client that reads slowly, or not at all, is aborted, and its
  buffered answer dropped); a TLS handshake gets the idle deadline too;
- size: a request line or header line of at most `max_header_bytes`, at most 32 header lines;
  bodies are read only through `read_body`, which refuses a body without a length (411), larger
  than `max_body_bytes` (413, chunked bodies included: counted as they arrive) or encoded (415;
  nothing is decompressed);
- the listen backlog: `backlog`.

Nothing here blocks the loop: handlers run on it and must hand CPU work to an executor (the
metrics endpoint does, for the exposition).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import os
import socket
import ssl
import stat
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from exporter.config import ConfigError, Section, setting

log = logging.getLogger("exporter.http")

MAX_HEADER_LINES = 32
Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


@dataclasses.dataclass(frozen=True)
class HttpLimits(Section):
    """The `limits:` of an HTTP listener's section (metrics, admin)."""

    max_connections: int = setting(256, positive=True, maximum=65536)
    backlog: int = setting(128, positive=True, maximum=65536)
    idle_timeout_seconds: float = setting(10.0, positive=True, maximum=3600)
    request_timeout_seconds: float = setting(30.0, positive=True, maximum=3600)
    max_header_bytes: int = setting(8192, minimum=1024, maximum=1 << 20)
    max_body_bytes: int = setting(64 << 10, minimum=0, maximum=16 << 20)


class HttpError(Exception):
    """A request refused before its handler's work: `status` answers it."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


async def read_body(request: web.BaseRequest, limit: int) -> bytes:
    """The request's body, at most `limit` bytes; HttpError for a body without a declared
    length or chunked framing (411), one larger than the limit (413, counted as it arrives)
    or one with a content encoding (415)."""
    if request.headers.get("Content-Encoding", "identity").lower() != "identity":
        raise HttpError(415, "request bodies are read as sent: no Content-Encoding")
    length = request.content_length
    chunked = "chunked" in request.headers.get("Transfer-Encoding", "").lower()
    if length is None and not chunked:
        raise HttpError(411, "a request body needs a Content-Length (or chunked encoding)")
    if length is not None and length > limit:
        raise HttpError(413, f"the body is larger than {limit} bytes")
    body = bytearray()
    while chunk := await request.content.read(64 << 10):
        body += chunk
        if len(body) > limit:
            raise HttpError(413, f"the body is larger than {limit} bytes")
    return bytes(body)


class _Server(web.Server):
    """aiohttp's low-level server, counting its connections against the limit."""

    def __init__(self, handler: Handler, limits: HttpLimits, dropped: collections.Counter,
                 lock: threading.Lock, **kwargs: Any):
        super().__init__(handler, **kwargs)
        self._limits = limits
        self._dropped = dropped
        self._lock = lock
        self.busy: set[RequestHandler] = set()    # a request in progress
        self.served: set[RequestHandler] = set()  # completed a request at least once

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        if len(self._connections) <= self._limits.max_connections:
            return
        # Connections aborted already are still listed until their loss is processed.
        live = [h for h, t in self._connections.items() if not t.is_closing()]
        if len(live) <= self._limits.max_connections:
            return
        # The dict keeps opening order: the first of each kind is the oldest.
        idle = [h for h in live if h not in self.busy and h is not handler]
        victim = next((h for h in idle if h not in self.served), idle[0] if idle else None)
        reason = "idle_evicted" if victim is not None else "all_busy"
        self._connections[victim or handler].abort()
        with self._lock:
            self._dropped[reason] += 1

    def connection_lost(self, handler: RequestHandler, exc: BaseException | None = None) -> None:
        super().connection_lost(handler, exc)
        self.busy.discard(handler)
        self.served.discard(handler)


class BoundedHttpServer:
    """One HTTP service (`name`: its label in the counters) on any number of listeners.

    Construct on the event loop, `await listen_tcp(...)` / `await listen_unix(...)`, and
    `await close()`. `handler(request)` answers each request; it runs on the loop, within the
    request deadline, and its response is sent within that deadline too."""

    def __init__(self, name: str, handler: Handler, limits: HttpLimits):
        self.name = name
        self.limits = limits
        self._handler = handler
        self._lock = threading.Lock()
        self.dropped: collections.Counter[str] = collections.Counter()
        self._server = _Server(
            self._bounded, limits, self.dropped, self._lock, handler_cancellation=True,
            keepalive_timeout=limits.idle_timeout_seconds, max_line_size=limits.max_header_bytes,
            max_field_size=limits.max_header_bytes, max_headers=MAX_HEADER_LINES,
            auto_decompress=False, lingering_time=0, access_log=None)
        self._listeners: list[asyncio.AbstractServer] = []
        self._unix_paths: list[str] = []

    async def _bounded(self, request: web.BaseRequest) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        transport = request.transport
        deadline = loop.call_later(self.limits.request_timeout_seconds, self._timed_out,
                                   transport)
        protocol = request.protocol
        self._server.busy.add(protocol)
        try:
            try:
                response = await self._handler(request)
            except HttpError as err:
                response = web.Response(status=err.status, text=f"{err}\n")
            if not response.prepared:  # sent here, within the deadline
                await response.prepare(request)
                await response.write_eof()
            return response
        finally:
            deadline.cancel()
            self._server.busy.discard(protocol)
            if protocol.transport is not None:  # not lost meanwhile
                self._server.served.add(protocol)

    def _timed_out(self, transport: asyncio.Transport | None) -> None:
        if transport is not None and not transport.is_closing():
            transport.abort()  # not close(): that would wait to flush to a client not reading
            with self._lock:
                self.dropped["request_timeout"] += 1

    async def listen_tcp(self, host: str, port: int,
                         tls: ssl.SSLContext | None = None) -> int:
        """Listen on TCP (IPv6 "::" takes IPv4 too, where the host allows); the port bound."""
        sock = _tcp_socket(host, port, self.limits.backlog)
        loop = asyncio.get_running_loop()
        listener = await loop.create_server(
            self._server, sock=sock, backlog=self.limits.backlog, ssl=tls,
            ssl_handshake_timeout=self.limits.idle_timeout_seconds if tls else None)
        self._listeners.append(listener)
        return int(sock.getsockname()[1])

    async def listen_unix(self, path: str, mode: int, setting_name: str) -> None:
        """Listen on a Unix socket at `path`, of file mode `mode` from its creation on (a stale
        socket of a previous run is replaced; any other file there is an error naming
        `setting_name`)."""
        sock = _unix_socket(path, mode, self.limits.backlog, setting_name)
        loop = asyncio.get_running_loop()
        self._listeners.append(await loop.create_unix_server(
            self._server, sock=sock, backlog=self.limits.backlog))
        self._unix_paths.append(path)

    def connections(self) -> int:
        """Connections open now (read from any thread: len() of a dict is atomic)."""
        return len(self._server._connections)

    @staticmethod
    def over_unix_socket(request: web.BaseRequest) -> bool:
        """Whether the request came through one of the Unix sockets (False once its
        connection is lost)."""
        sock = request.transport.get_extra_info("socket") if request.transport else None
        return sock is not None and sock.family == socket.AF_UNIX

    def dropped_counts(self) -> list[tuple[str, int]]:
        """Connections closed by the limits, by reason (idle_evicted, all_busy,
        request_timeout)."""
        with self._lock:
            return sorted(self.dropped.items())

    async def close(self) -> None:
        for listener in self._listeners:
            listener.close()
        self._server.pre_shutdown()
        await self._server.shutdown(1.0)
        for listener in self._listeners:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(listener.wait_closed(), 1.0)
        for path in self._unix_paths:
            with contextlib.suppress(OSError):
                os.unlink(path)


def _tcp_socket(host: str, port: int, backlog: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:  # asyncio would make it IPv6 only
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def _unix_socket(path: str, mode: int, backlog: int, setting_name: str) -> socket.socket:
    target = Path(path)
    target.parent.mkdir(mode=0o770, parents=True, exist_ok=True)
    if target.exists() or target.is_symlink():
        if not stat.S_ISSOCK(target.lstat().st_mode):
            raise ConfigError(f"{setting_name}: {path} exists and is not a socket")
        target.unlink()  # a stale socket of a previous sidecar
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o777 & ~mode)  # never more open than asked, not even for an instant
    try:
        sock.bind(path)
    except BaseException:
        sock.close()
        raise
    finally:
        os.umask(old_umask)
    os.chmod(path, mode)
    sock.listen(backlog)
    sock.setblocking(False)
    return sock


class HttpCollector(Collector):
    """allocwatch_http_connections{server} and
    allocwatch_http_connections_closed_total{server, reason}: the listeners' limits at work."""

    def __init__(self) -> None:
        self.servers: list[BoundedHttpServer] = []

    def collect(self) -> Iterator[Metric]:
        open_now = GaugeMetricFamily("allocwatch_http_connections",
                                     "HTTP connections open, by server (metrics, admin)",
                                     labels=["server"])
        closed = CounterMetricFamily(
            "allocwatch_http_connections_closed",
            "HTTP connections closed by the listeners' limits, by server and reason "
            "(idle_evicted, all_busy, request_timeout)", labels=["server", "reason"])
        for server in list(self.servers):
            open_now.add_metric([server.name], server.connections())
            for reason, count in server.dropped_counts():
                closed.add_metric([server.name, reason], count)
        yield open_now
        yield closed
