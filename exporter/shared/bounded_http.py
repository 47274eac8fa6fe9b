"""HTTP on the sidecar's own event loop (aiohttp's low-level server), every resource a client
can take bounded: the metrics endpoint and the admin API both serve through it.

- accepting: the listening sockets are polled here, not by asyncio's server; a connection is
  handed to aiohttp only once it has sent something (its first bytes, a TLS ClientHello, or
  its end), as the kernel's TCP_DEFER_ACCEPT would, which syncookies bypass past the SYN
  backlog. Until then it is a socket and a poll: a crowd of silent connections costs no
  request handler, and closing one costs a close(). With a `Precedence`, new connections
  wait in the kernel's queue while a scrape is being built (exporter.shared.precedence);
- connections: at most `max_connections` open, silent ones included; one more closes the
  oldest silent one, else the oldest that never began a request (a client trickling its
  first request, a stalled TLS handshake), else the one idle longest; when every one is busy,
  the newcomer; each counted. Silent and trickling clients go before a scraper's kept-alive
  connection, and choosing costs the same with 10 or 10,000 open (ordered maps, no scans);
- time: `idle_timeout_seconds` from a connection's accept, or from its last response, to the
  end of its next request's headers (a silent client, one trickling its headers, or a TLS
  handshake that stalls is closed at that deadline, however its bytes came); then
  `request_timeout_seconds` to the last byte of the response (a client that reads slowly, or
  not at all, is aborted, and its buffered answer dropped);
- size: a request line or header line of at most `max_header_bytes`, at most 32 header lines;
  bodies are read only through `read_body`, which refuses a body without a length (411), larger
  than `max_body_bytes` (413, chunked bodies included: counted as they arrive) or encoded (415;
  nothing is decompressed), and one that has not arrived whole `body_timeout_seconds` after the
  headers (408); a connection waiting for its body can be evicted as an idle one can. A request
  declaring a body over the limit (any body where it is 0, as on /metrics) is refused (413)
  before its handler runs. A body the handler did not read (a refusal, a GET with a body) is
  never waited for: what has arrived is dropped, and the connection closes after the answer
  unless the body had ended;
- answers: a body is written a chunk at a time, each once the client has taken the last
  (asyncio's write buffer limits), so a client that does not read holds at most a chunk and
  the kernel's buffer of it. The bodies that answers being written hold stay within
  `max_pending_body_bytes` (a client that never reads pins the body it was given): past it, the
  connection whose reader has stalled longest is cut, and past `max_connections` with every
  connection busy, such a writer goes before the newcomer is refused;
- the listen backlog: `backlog`.

Nothing here blocks the loop: handlers run on it and must hand CPU work to an executor (the
metrics endpoint does, for the exposition); a burst of connections is accepted `backlog` at a
time.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import inspect
import logging
import os
import socket
import ssl
import stat
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from exporter.shared.config import ConfigError, Section, setting
from exporter.shared.families import counter, gauge, named
from exporter.shared.precedence import Precedence
from exporter.shared.socket_dir import SocketDirError, prepare_socket_dir

log = logging.getLogger("exporter.http")

MAX_HEADER_LINES = 32
ACCEPT_RETRY_SECONDS = 1.0  # asyncio's own pause when accept() runs out of descriptors
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
    # From the end of a request's headers to the end of its body.
    body_timeout_seconds: float = setting(5.0, positive=True, maximum=3600)
    # The bodies of the answers being written, together (each counted once, however many
    # clients it goes to).
    max_pending_body_bytes: int = setting(64 << 20, minimum=1 << 20, maximum=4 << 30)


class HttpError(Exception):
    """A request refused before its handler's work: `status` answers it."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


async def read_body(request: web.BaseRequest, limit: int) -> bytes:
    """The request's body, at most `limit` bytes; HttpError for a body without a declared
    length or chunked framing (411), one larger than the limit (413, counted as it arrives),
    one with a content encoding (415), or one that has not arrived whole within the listener's
    `body_timeout_seconds` (408). While it waits for the body, the connection can be evicted
    as an idle one can."""
    if request.headers.get("Content-Encoding", "identity").lower() != "identity":
        raise HttpError(415, "request bodies are read as sent: no Content-Encoding")
    length = request.content_length
    chunked = "chunked" in request.headers.get("Transfer-Encoding", "").lower()
    if length is None and not chunked:
        raise HttpError(411, "a request body needs a Content-Length (or chunked encoding)")
    if length is not None and length > limit:
        raise HttpError(413, f"the body is larger than {limit} bytes")
    server = _SERVING.get(request.protocol)
    if server is None:  # not served through a BoundedHttpServer (a unit test's request)
        return await _read_within(request, limit)
    timeout = server.limits.body_timeout_seconds
    server.body_wait(request.protocol, True)
    try:
        return await asyncio.wait_for(_read_within(request, limit), timeout)
    except asyncio.TimeoutError:
        server.count("body_timeout")
        raise HttpError(408, f"the request body did not arrive within {timeout:g} s") from None
    finally:
        server.body_wait(request.protocol, False)


def _within_body_limit(request: web.BaseRequest, limit: int) -> None:
    """HttpError (413) for a request that declares a body the listener would never read
    (larger than its limit; any at all where the limit is 0, as on /metrics): refused before
    its handler does any work."""
    if not request.body_exists:
        return
    length = request.content_length
    if (length is not None and length > limit) or (
            limit == 0 and "chunked" in request.headers.get("Transfer-Encoding", "").lower()):
        raise HttpError(413, f"the body is larger than {limit} bytes")


async def _read_within(request: web.BaseRequest, limit: int) -> bytes:
    body = bytearray()
    while chunk := await request.content.read(64 << 10):
        body += chunk
        if len(body) > limit:
            raise HttpError(413, f"the body is larger than {limit} bytes")
    return bytes(body)


# The server of each open connection (read_body's way to its limits).
_SERVING: dict[RequestHandler, BoundedHttpServer] = {}


class _Server(web.Server):
    """aiohttp's low-level server, its connections kept in the order they may be closed in."""

    def __init__(self, owner: BoundedHttpServer, handler: Handler, **kwargs: Any):
        super().__init__(handler, **kwargs)
        self.owner = owner
        # Oldest first: handed over, no request begun yet; served and idle, idle longest first;
        # waiting for a request's body, longest first.
        self.fresh: collections.OrderedDict[RequestHandler, asyncio.Transport] = (
            collections.OrderedDict())
        self.idle: collections.OrderedDict[RequestHandler, asyncio.Transport] = (
            collections.OrderedDict())
        self.reading: collections.OrderedDict[RequestHandler, asyncio.Transport] = (
            collections.OrderedDict())
        self.busy: dict[RequestHandler, asyncio.Transport] = {}  # a request in progress
        # Cuts the busy connection whose client has stalled longest reading its answer; False
        # when there is none (set by BoundedHttpServer).
        self.cut_stalled_writer: Callable[[], bool] = lambda: False

    def open_count(self) -> int:
        """Connections open, less those closed already whose loss is still to be processed."""
        return len(self.fresh) + len(self.idle) + len(self.reading) + len(self.busy)

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        self.fresh[handler] = transport
        _SERVING[handler] = self.owner

    def connection_lost(self, handler: RequestHandler, exc: BaseException | None = None) -> None:
        super().connection_lost(handler, exc)
        for line in (self.fresh, self.idle, self.reading, self.busy):
            line.pop(handler, None)
        _SERVING.pop(handler, None)

    def request_started(self, handler: RequestHandler) -> None:
        transport = self.fresh.pop(handler, None) or self.idle.pop(handler, None)
        if transport is not None:  # not closed meanwhile
            self.busy[handler] = transport

    def request_finished(self, handler: RequestHandler) -> None:
        transport = self.busy.pop(handler, None) or self.reading.pop(handler, None)
        if transport is not None:
            self.idle[handler] = transport

    def body_wait(self, handler: RequestHandler, waiting: bool) -> None:
        """A request's handler starts (True) or stops waiting for its body: meanwhile the
        connection may be evicted."""
        source, target = (self.busy, self.reading) if waiting else (self.reading, self.busy)
        transport = source.pop(handler, None)
        if transport is not None:
            target[handler] = transport

    def close_first_idle(self) -> bool:
        """Abort the first in line (never began a request, then idle longest, then waiting
        longest for its body); False when every connection is busy."""
        for line in (self.fresh, self.idle, self.reading):
            if line:
                line.popitem(last=False)[1].abort()
                return True
        return False

    def first_request_due(self, handler: RequestHandler) -> None:
        """A connection's idle deadline from its accept: closed unless a request began."""
        transport = self.fresh.pop(handler, None)
        if transport is not None:
            transport.abort()


class _Acceptor:
    """Accepts on the listening sockets and holds each new connection, polled, until it sends
    something; then hands it to aiohttp (with TLS where the listener has it: the ClientHello
    is those first bytes, left in the kernel's buffer as only readability was polled). Keeps
    the listeners' connections, silent ones and aiohttp's, within `max_connections`."""

    def __init__(self, server: _Server, limits: HttpLimits, count: Callable[[str], None],
                 precedence: Precedence | None):
        self._loop = asyncio.get_running_loop()
        self._server = server
        self._limits = limits
        self._count = count
        self._precedence = precedence
        self._listeners: list[socket.socket] = []
        # Accept order, hence deadline order: silent connections and their idle deadlines.
        self.waiting: collections.OrderedDict[socket.socket, float] = collections.OrderedDict()
        # Spoken, being handed over (a TLS handshake, or the instant of a plain one); from
        # aiohttp's connection_made to this task's next step counted twice, erring safe.
        self.handing: collections.OrderedDict[socket.socket, asyncio.Task[None]] = (
            collections.OrderedDict())
        self._sweep: asyncio.TimerHandle | None = None

    def open_count(self) -> int:
        return len(self.waiting) + len(self.handing) + self._server.open_count()

    def listen(self, listener: socket.socket, tls: ssl.SSLContext | None) -> None:
        self._listeners.append(listener)
        self._loop.add_reader(listener.fileno(), self._accept, listener, tls)

    def _accept(self, listener: socket.socket, tls: ssl.SSLContext | None) -> None:
        if self._precedence is not None and self._precedence.defers(
                lambda: self._resume(listener, tls)):
            self._loop.remove_reader(listener.fileno())  # newcomers wait while a scrape builds
            return
        for _ in range(self._limits.backlog):  # bounded: a burst never holds the loop long
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as err:  # out of descriptors or memory: pause, as asyncio does
                log.warning("HTTP listener cannot accept; retrying in %.0f s",
                            ACCEPT_RETRY_SECONDS, extra={"reason": str(err)})
                self._loop.remove_reader(listener.fileno())
                self._loop.call_later(ACCEPT_RETRY_SECONDS, self._resume, listener, tls)
                return
            self._admit(conn, tls)

    def _resume(self, listener: socket.socket, tls: ssl.SSLContext | None) -> None:
        if listener in self._listeners:  # not closed meanwhile
            self._loop.add_reader(listener.fileno(), self._accept, listener, tls)

    def _admit(self, conn: socket.socket, tls: ssl.SSLContext | None) -> None:
        if self.open_count() >= self._limits.max_connections and not self._make_room():
            conn.close()
            self._count("all_busy")
            return
        conn.setblocking(False)
        deadline = self._loop.time() + self._limits.idle_timeout_seconds
        self.waiting[conn] = deadline
        self._loop.add_reader(conn.fileno(), self._spoke, conn, tls)
        if self._sweep is None:
            self._sweep = self._loop.call_at(deadline, self._expire)

    def _make_room(self) -> bool:
        if self.waiting:
            self._drop(self.waiting.popitem(last=False)[0])
        elif self.handing:
            self._abandon(*self.handing.popitem(last=False))
        elif not self._server.close_first_idle():
            # Every connection busy: the answer whose client stalled longest goes (counted as
            # slow_reader), else the newcomer.
            return self._server.cut_stalled_writer()
        self._count("idle_evicted")
        return True

    def _drop(self, conn: socket.socket) -> None:
        self._loop.remove_reader(conn.fileno())
        conn.close()

    @staticmethod
    def _abandon(conn: socket.socket, task: asyncio.Task[None]) -> None:
        coro = task.get_coro()
        if inspect.iscoroutine(coro) and inspect.getcoroutinestate(coro) == inspect.CORO_CREATED:
            conn.close()  # never began: the socket is still ours alone (cancelling skips it)
        task.cancel()  # once begun, asyncio closes its transport

    def _expire(self) -> None:
        """The one sweep timer: closes the silent connections past their deadline, oldest
        first, and waits for the next one's."""
        self._sweep = None
        now = self._loop.time()
        while self.waiting:
            conn, deadline = next(iter(self.waiting.items()))
            if deadline > now:
                self._sweep = self._loop.call_at(deadline, self._expire)
                return
            del self.waiting[conn]
            self._drop(conn)

    def _spoke(self, conn: socket.socket, tls: ssl.SSLContext | None) -> None:
        self._loop.remove_reader(conn.fileno())
        deadline = self.waiting.pop(conn)
        try:
            ended = conn.recv(1, socket.MSG_PEEK) == b""
        except (BlockingIOError, InterruptedError):
            ended = False
        except OSError:  # reset
            ended = True
        if ended:  # gone before a byte (a TCP probe, say): nothing to serve
            conn.close()
            return
        self.handing[conn] = self._loop.create_task(self._hand_over(conn, tls, deadline))

    async def _hand_over(self, conn: socket.socket, tls: ssl.SSLContext | None,
                         deadline: float) -> None:
        try:
            _, handler = await self._loop.connect_accepted_socket(
                self._server, sock=conn, ssl=tls, ssl_handshake_timeout=(
                    max(deadline - self._loop.time(), 0.01) if tls else None))
        except (OSError, asyncio.TimeoutError):  # a failed or stalled handshake: closed
            return
        finally:
            self.handing.pop(conn, None)
        self._loop.call_at(deadline, self._server.first_request_due, handler)

    async def close(self) -> None:
        """Stop accepting; close the connections not handed over."""
        for listener in self._listeners:
            self._loop.remove_reader(listener.fileno())
            listener.close()
        self._listeners.clear()
        while self.waiting:
            self._drop(self.waiting.popitem()[0])
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        tasks = list(self.handing.values())
        while self.handing:
            self._abandon(*self.handing.popitem())
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)


_CHUNK = 64 << 10  # an answer's body is written this much at a time


@dataclasses.dataclass(eq=False)
class _Write:
    """An answer being written: the body it holds (by identity) and its connection."""

    body: int
    size: int
    transport: asyncio.Transport
    released: bool = False


class BoundedHttpServer:
    """One HTTP service (`name`: its label in the counters) on any number of listeners.

    Construct on the event loop, `await listen_tcp(...)` / `await listen_unix(...)`, and
    `await close()`. `handler(request)` answers each request; it runs on the loop, within the
    request deadline, and its response is sent within that deadline too."""

    def __init__(self, name: str, handler: Handler, limits: HttpLimits,
                 precedence: Precedence | None = None):
        self.name = name
        self.limits = limits
        self._handler = handler
        self._lock = threading.Lock()
        self.dropped: collections.Counter[str] = collections.Counter()
        self._server = _Server(
            self, self._bounded, handler_cancellation=True,
            keepalive_timeout=limits.idle_timeout_seconds, max_line_size=limits.max_header_bytes,
            max_field_size=limits.max_header_bytes, max_headers=MAX_HEADER_LINES,
            auto_decompress=False, lingering_time=0, access_log=None)
        self._server.cut_stalled_writer = self._cut_stalled_writer
        self._acceptor = _Acceptor(self._server, limits, self.count, precedence)
        self._unix_paths: list[str] = []
        # Answers being written, the one whose client took a chunk least recently first; the
        # bodies they hold, by identity: [size, writers].
        self._writes: collections.OrderedDict[_Write, None] = collections.OrderedDict()
        self._bodies: dict[int, list[int]] = {}
        self.pending_body_bytes = 0

    def count(self, reason: str) -> None:
        with self._lock:
            self.dropped[reason] += 1

    def body_wait(self, handler: RequestHandler, waiting: bool) -> None:
        self._server.body_wait(handler, waiting)

    async def _bounded(self, request: web.BaseRequest) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        transport = request.transport
        deadline = loop.call_later(self.limits.request_timeout_seconds, self._timed_out,
                                   transport)
        protocol = request.protocol
        self._server.request_started(protocol)
        try:
            try:
                _within_body_limit(request, self.limits.max_body_bytes)
                response = await self._handler(request)
            except HttpError as err:
                response = web.Response(status=err.status, text=f"{err}\n")
            if not response.prepared:  # sent here, within the deadline
                self._drop_unread_body(request, response)
                response = await self._send(request, response)
            return response
        finally:
            deadline.cancel()
            self._server.request_finished(protocol)

    def _drop_unread_body(self, request: web.BaseRequest, response: web.StreamResponse) -> None:
        """A body the handler left unread (a refusal, a GET with a body) is never waited for:
        what has arrived is dropped, and unless that was all of it the connection closes after
        the answer (a client still sending may then read a reset rather than the answer)."""
        content = request.content
        if not request.body_exists or content.is_eof():
            return
        dropped = 0
        while dropped <= self.limits.max_body_bytes and (chunk := content.read_nowait()):
            dropped += len(chunk)
        if not content.is_eof():
            response.force_close()

    async def _send(self, request: web.BaseRequest,
                    response: web.StreamResponse) -> web.StreamResponse:
        """Send `response`; a body of more than a chunk a chunk at a time, each once the client
        has taken the last, holding its share of `max_pending_body_bytes` meanwhile."""
        body = response.body if isinstance(response, web.Response) else None
        if (request.method == "HEAD" or not isinstance(body, bytes) or len(body) <= _CHUNK
                or request.transport is None):
            await response.prepare(request)
            await response.write_eof()
            return response
        stream = web.StreamResponse(status=response.status, reason=response.reason,
                                    headers=response.headers)
        stream.content_length = len(body)
        if not response.keep_alive:
            stream.force_close()
        write = self._hold(body, request.transport)
        view = memoryview(body)
        try:
            await stream.prepare(request)
            for start in range(0, len(body), _CHUNK):
                await stream.write(view[start:start + _CHUNK])
                if write.released:  # cut meanwhile: its transport is closing
                    break
                self._writes.move_to_end(write)
            else:
                await stream.write_eof()
        except ConnectionError:
            pass  # cut, or the client went away: aiohttp closes the connection
        finally:
            self._release(write)
        return stream

    def _hold(self, body: bytes, transport: asyncio.Transport) -> _Write:
        """Count `body` as held by one more answer; a body not yet held first makes room for
        itself, cutting the writers whose clients stalled longest."""
        key = id(body)  # unique while held: the writers hold the object itself
        if key not in self._bodies:
            while (self._writes
                   and self.pending_body_bytes + len(body) > self.limits.max_pending_body_bytes):
                self._cut(next(iter(self._writes)))
            self._bodies[key] = [len(body), 0]
            self.pending_body_bytes += len(body)
        self._bodies[key][1] += 1
        write = _Write(key, len(body), transport)
        self._writes[write] = None
        return write

    def _release(self, write: _Write) -> None:
        if write.released:
            return
        write.released = True
        self._writes.pop(write, None)
        held = self._bodies[write.body]
        held[1] -= 1
        if not held[1]:
            del self._bodies[write.body]
            self.pending_body_bytes -= write.size

    def _cut(self, write: _Write) -> None:
        write.transport.abort()
        self._release(write)
        self.count("slow_reader")

    def _cut_stalled_writer(self) -> bool:
        if not self._writes:
            return False
        self._cut(next(iter(self._writes)))
        return True

    def _timed_out(self, transport: asyncio.Transport | None) -> None:
        if transport is not None and not transport.is_closing():
            transport.abort()  # not close(): that would wait to flush to a client not reading
            self.count("request_timeout")

    async def listen_tcp(self, host: str, port: int,
                         tls: ssl.SSLContext | None = None) -> int:
        """Listen on TCP (IPv6 "::" takes IPv4 too, where the host allows); the port bound."""
        sock = _tcp_socket(host, port, self.limits.backlog)
        self._acceptor.listen(sock, tls)
        return int(sock.getsockname()[1])

    async def listen_unix(self, path: str, mode: int, setting_name: str) -> None:
        """Listen on a Unix socket at `path`, of file mode `mode` from its creation on (a stale
        socket of a previous run is replaced; any other file there is an error naming
        `setting_name`)."""
        self._acceptor.listen(_unix_socket(path, mode, self.limits.backlog, setting_name), None)
        self._unix_paths.append(path)

    def connections(self) -> int:
        """Connections open now, silent ones included (read from any thread: len() of a dict
        is atomic)."""
        return self._acceptor.open_count()

    @staticmethod
    def over_unix_socket(request: web.BaseRequest) -> bool:
        """Whether the request came through one of the Unix sockets (False once its
        connection is lost)."""
        sock = request.transport.get_extra_info("socket") if request.transport else None
        return sock is not None and sock.family == socket.AF_UNIX

    def dropped_counts(self) -> list[tuple[str, int]]:
        """Connections closed by the limits, by reason (idle_evicted, all_busy,
        request_timeout, body_timeout, slow_reader)."""
        with self._lock:
            return sorted(self.dropped.items())

    async def close(self) -> None:
        await self._acceptor.close()
        self._server.pre_shutdown()
        await self._server.shutdown(1.0)
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
    try:
        prepare_socket_dir(target.parent, mode, setting_name, exact=False)
    except SocketDirError as err:
        raise ConfigError(str(err)) from None
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


_CONNECTION_ROWS = named("allocwatch_http_connections", "allocwatch_http_connections_closed_total")


class Listener(Protocol):
    """What HttpCollector reads of a listener (a BoundedHttpServer, the agents' front)."""

    name: str

    def connections(self) -> int: ...

    def dropped_counts(self) -> list[tuple[str, int]]: ...


class HttpCollector(Collector):
    """allocwatch_http_connections{server} and
    allocwatch_http_connections_closed_total{server, reason}: the listeners' limits at work."""

    def __init__(self) -> None:
        self.servers: list[Listener] = []

    def collect(self) -> Iterator[Metric]:
        open_now, closed = gauge(_CONNECTION_ROWS[0]), counter(_CONNECTION_ROWS[1])
        for server in list(self.servers):
            open_now.add_metric([server.name], server.connections())
            for reason, count in server.dropped_counts():
                closed.add_metric([server.name, reason], count)
        yield open_now
        yield closed
