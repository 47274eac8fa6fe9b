"""The agents' listeners: the Unix socket and the TCP port agents dial, in front of the gRPC
server, which listens only on a socket of its own in a private directory.

grpc-python's server neither hands over the sockets it accepts nor tells a servicer more of a
connection than its peer's address, and its options bound streams, not connections: nothing
there caps how many connections are open, asks one to authenticate within a deadline, or says
which user is at the other end of a Unix socket. So the front accepts each connection itself:

- who: on the Unix socket, the peer's user (SO_PEERCRED) must be one `agents.allowed_uids`
  names (when it names any), else the connection is closed at once, counted
  (`allocwatch_refused_total{reason="peer_user"}`) and logged (rate-limited);
- count: at most `max_connections` open, silent ones included; one more closes, of those that
  have not yet carried an accepted agent (silent ones, preface-only ones, health checks,
  refused streams), the one whose client has been quiet longest, else the newcomer is refused:
  an agent shaking hands talks, so a crowd that connects and then keeps quiet goes first;
- time: a connection must carry an agent's accepted hello within
  `agents.hello_timeout_seconds` of its accept (and a second more, for the stream's own
  refusal to reach the client first), else it is closed, whatever it sends meanwhile;
- rate: at most ACCEPTS_PER_SECOND new connections a second (a burst of ACCEPT_BURST, a job's
  agents starting together): past it, the listeners are not read until the next is due, and
  newcomers wait in the kernel's listen queue (then their connect retries), so a flood of
  connections costs the sidecar a bounded share of its time whatever its rate; they wait
  there too while a scrape is being built (exporter.shared.precedence);
- cost: until a connection has sent the opening of an HTTP/2 connection (the preface and a
  frame's header: 33 bytes, which a client sends at once) or bytes that cannot begin one (a TLS
  ClientHello) it is a socket and a poll, what it sent kept; a crowd that sends the preface
  alone never reaches the gRPC server. Then it is joined to the gRPC server's private socket
  and bytes are relayed both ways, each side read only while the other takes what it is given
  (asyncio's flow control), so a peer that does not read holds at most the transports'
  buffers.

The relay's end at the gRPC server is bound to an abstract name of its own, which the servicer
reads back as the stream's peer (`unix-abstract:NAME`): `origin(peer)` says where the stream
really comes from (TCP, asking for the token; or the Unix socket, with the peer's user), and
`authenticated(peer)` marks its connection as an agent's, no longer subject to the deadline nor
evicted. A stream whose peer is no connection of the front (a client that reached the private
socket some other way) is refused.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import os
import secrets
import socket
import struct
import threading
from collections.abc import Callable, Iterable

from exporter.shared.precedence import Precedence
from exporter.shared.refusals import Refusals

log = logging.getLogger("exporter.grpc")

ABSTRACT_PEER = "unix-abstract:"
FLUSH_SECONDS = 5.0  # for the last bytes to one end once the other has closed
ACCEPTS_PER_SECOND = 64.0
ACCEPT_BURST = 128.0
REFUSAL_SECONDS = 1.0  # past the hello deadline: the stream's DEADLINE_EXCEEDED goes first
# An HTTP/2 client opens with the preface and a SETTINGS frame, sent without waiting for the
# server (RFC 9113, 3.4): a connection is relayed once it sent that much, the preface and a
# frame's header. One that sends the preface and stops is held as it is, a socket and a poll,
# never joined to the gRPC server.
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_OPENING = len(PREFACE) + 9
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclasses.dataclass(frozen=True)
class Origin:
    """Where an agent's connection comes from: `tcp` (its address) or the Unix socket (the
    peer's process and user)."""

    tcp: bool
    address: str
    uid: int | None = None
    pid: int | None = None

    def describe(self) -> str:
        return self.address if self.tcp else f"unix (uid {self.uid}, pid {self.pid})"


class _Side(asyncio.Protocol):
    """One end of a relayed connection: what it receives goes to the other end; it stops
    reading while the other end's transport cannot take more."""

    def __init__(self, link: _Link, client: bool):
        self.link = link
        self.client = client  # the end facing the connection's client
        self.transport: asyncio.Transport | None = None
        self.other: _Side | None = None
        self.early: list[bytes] = []  # received before the other end had its transport

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if self.other is not None and self.other.early:
            for data in self.other.early:
                transport.write(data)
            self.other.early.clear()

    def data_received(self, data: bytes) -> None:
        if self.client:
            self.link.front.heard(self.link)
        other = self.other.transport if self.other is not None else None
        if other is None:  # the instant between the two ends' set-up: one read at most
            self.early.append(data)
            self.transport.pause_reading()  # type: ignore[union-attr]
            self.link.front.loop.call_soon(self._resume_when_joined)
        elif not other.is_closing():
            other.write(data)

    def _resume_when_joined(self) -> None:
        if self.other is not None and self.other.transport is not None:
            if self.transport is not None and not self.transport.is_closing():
                self.transport.resume_reading()
        elif not self.link.closed:
            self.link.front.loop.call_later(0.01, self._resume_when_joined)

    def eof_received(self) -> bool:
        other = self.other.transport if self.other is not None else None
        if other is not None and not other.is_closing() and other.can_write_eof():
            other.write_eof()
            return True  # half-closed: the other direction goes on
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.link.close(flush=self.other)

    def pause_writing(self) -> None:
        if self.other is not None and self.other.transport is not None:
            self.other.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.other is not None and self.other.transport is not None:
            self.other.transport.resume_reading()


class _Link:
    """One accepted connection: silent (a socket, polled), then relayed."""

    def __init__(self, front: AgentFront, sock: socket.socket, origin: Origin, name: str,
                 deadline: float):
        self.front = front
        self.sock: socket.socket | None = sock
        self.origin = origin
        self.name = name
        self.deadline = deadline
        self.sides: list[_Side] = []
        self.task: asyncio.Task[None] | None = None
        self.head = b""  # read from the client before the relay began (at most _OPENING)
        self.closed = False

    def close(self, flush: _Side | None = None) -> None:
        """Close both ends: at once, except `flush`, the end whose peer closed last, which
        first sends what it holds (the other's last words: a status, a GOAWAY), for at most
        FLUSH_SECONDS."""
        if self.closed:
            return
        self.closed = True
        self.front.forget(self)
        if self.sock is not None:
            self.front.loop.remove_reader(self.sock.fileno())
            self.sock.close()
            self.sock = None
        if self.task is not None and not self.task.done():
            self.task.cancel()
        for side in self.sides:
            transport = side.transport
            if transport is None or transport.is_closing():
                continue
            if side is flush and transport.get_write_buffer_size():
                transport.close()
                self.front.loop.call_later(FLUSH_SECONDS, transport.abort)
            else:
                transport.abort()


class AgentFront:
    """The agents' listeners (construct on the event loop; `listen_unix`, `listen_tcp`;
    `await close()`). `upstream(origin)` is the gRPC server's private socket for a
    connection from there (TLS on TCP goes to a TLS listener)."""

    name = "agents"  # its label in allocwatch_http_connections{server}

    def __init__(self, upstream: Callable[[Origin], str], *, max_connections: int,
                 hello_timeout: float, allowed_uids: Iterable[int], refusals: Refusals,
                 backlog: int = 128, precedence: Precedence | None = None):
        self.loop = asyncio.get_running_loop()
        self._precedence = precedence
        self._upstream = upstream
        self.max_connections = max_connections
        self.hello_timeout = hello_timeout
        self.allowed_uids = frozenset(allowed_uids)
        self._refusals = refusals
        self._backlog = backlog
        self._listeners: list[socket.socket] = []
        self._unix_paths: dict[str, int] = {}  # the sockets bound, by path: their inodes
        # Not yet an agent's, in accept order (hence deadline order); agents' connections.
        self._pending: collections.OrderedDict[_Link, None] = collections.OrderedDict()
        # The same, the one whose client has been quiet longest first: eviction's order.
        self._quiet: collections.OrderedDict[_Link, None] = collections.OrderedDict()
        self._agents: set[_Link] = set()
        self._by_name: dict[str, _Link] = {}
        self._prefix = f"allocwatch-{os.getpid()}-{secrets.token_hex(6)}-"
        self._serial = 0
        self._sweep: asyncio.TimerHandle | None = None
        # The accepts' token bucket: what is left of the burst, when last counted; the timer
        # that reads the listeners again once it ran dry.
        self._accepts = (ACCEPT_BURST, self.loop.time())
        self._paused: asyncio.TimerHandle | None = None
        self._lock = threading.Lock()
        self.dropped: collections.Counter[str] = collections.Counter()
        self.seen_uids: set[int] = set()  # of agents accepted on the Unix socket

    # ---------------------------------------------------------------- listening

    def listen_unix(self, path: str, mode: int) -> None:
        """Listen on a Unix socket at `path`, of mode `mode` from its creation on (a stale
        socket is replaced); its directory must be made safe first (shared.socket_dir)."""
        if os.path.lexists(path):
            os.unlink(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o777 & ~mode)
        try:
            sock.bind(path)
        except BaseException:
            sock.close()
            raise
        finally:
            os.umask(old_umask)
        os.chmod(path, mode)
        self._unix_paths[path] = os.stat(path).st_ino
        self._listen(sock)

    def listen_tcp(self, host: str, port: int) -> int:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
        except BaseException:
            sock.close()
            raise
        self._listen(sock)
        return int(sock.getsockname()[1])

    def _listen(self, sock: socket.socket) -> None:
        sock.listen(self._backlog)
        sock.setblocking(False)
        self._listeners.append(sock)
        self.loop.add_reader(sock.fileno(), self._accept, sock)

    def _accept(self, listener: socket.socket) -> None:
        if self._precedence is not None and self._precedence.defers(
                lambda: self._resume(listener)):
            self.loop.remove_reader(listener.fileno())  # newcomers wait while a scrape builds
            return
        for _ in range(self._backlog):  # bounded: a burst never holds the loop long
            if not self._take_accept():
                return
            try:
                conn, address = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as err:  # out of descriptors: pause, as asyncio does
                self._refusals.warn("agents_accept", log, "agents' listener cannot accept", {
                    "reason": err.strerror})
                self.loop.remove_reader(listener.fileno())
                self.loop.call_later(1.0, self._resume, listener)
                return
            self._admit(conn, address)

    def _resume(self, listener: socket.socket) -> None:
        # Not while the accepts' rate holds every listener: _unpause reads them all again.
        if listener in self._listeners and self._paused is None:
            self.loop.add_reader(listener.fileno(), self._accept, listener)

    def _take_accept(self) -> bool:
        """Whether the rate allows one more accept now; when not, stop reading the listeners
        until it does."""
        now = self.loop.time()
        tokens, then = self._accepts
        tokens = min(ACCEPT_BURST, tokens + (now - then) * ACCEPTS_PER_SECOND)
        if tokens >= 1.0:
            self._accepts = (tokens - 1.0, now)
            return True
        self._accepts = (tokens, now)
        if self._paused is None:
            for listener in self._listeners:
                self.loop.remove_reader(listener.fileno())
            self._paused = self.loop.call_later((1.0 - tokens) / ACCEPTS_PER_SECOND,
                                                self._unpause)
        return False

    def _unpause(self) -> None:
        self._paused = None
        for listener in self._listeners:
            self.loop.add_reader(listener.fileno(), self._accept, listener)

    def _admit(self, conn: socket.socket, address: object) -> None:
        if conn.family == socket.AF_UNIX:
            pid, uid, _ = _PEERCRED.unpack(conn.getsockopt(
                socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
            origin = Origin(False, "unix", uid, pid)
            if self.allowed_uids and uid not in self.allowed_uids:
                conn.close()
                self._refusals.refuse("peer_user", log, "agent connection refused: its user is "
                                      "not in agents.allowed_uids", {
                                          "uid": uid, "pid": pid,
                                          "allowed_uids": sorted(self.allowed_uids)})
                return
        else:
            host, port = address[:2] if isinstance(address, tuple) else ("?", 0)
            origin = Origin(True, f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}")
        if self.open_count() >= self.max_connections and not self._make_room():
            conn.close()
            self._count("all_busy")
            return
        conn.setblocking(False)
        self._serial += 1
        link = _Link(self, conn, origin, f"{self._prefix}{self._serial}",
                     self.loop.time() + self.hello_timeout + REFUSAL_SECONDS)
        self._pending[link] = None
        self._quiet[link] = None
        self._by_name[link.name] = link
        self.loop.add_reader(conn.fileno(), self._spoke, link)
        if self._sweep is None:
            self._sweep = self.loop.call_at(link.deadline, self._expire)

    def _make_room(self) -> bool:
        if not self._quiet:
            return False
        next(iter(self._quiet)).close()
        self._count("idle_evicted")
        return True

    def _expire(self) -> None:
        """The one sweep timer: closes the connections past their deadline that carry no
        agent yet, oldest first, and waits for the next one's."""
        self._sweep = None
        now = self.loop.time()
        while self._pending:
            link = next(iter(self._pending))
            if link.deadline > now:
                self._sweep = self.loop.call_at(link.deadline, self._expire)
                return
            link.close()
            self._count("hello_timeout")

    # ---------------------------------------------------------------- relaying

    def _spoke(self, link: _Link) -> None:
        """The client sent something: relayed once it is past the connection's opening (or
        cannot be the start of one), else held as it is, a socket and a poll."""
        sock = link.sock
        assert sock is not None
        try:
            data = sock.recv(_OPENING - len(link.head))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # gone before its opening: nothing to relay
            link.close()
            return
        self.heard(link)
        link.head += data
        if len(link.head) < _OPENING and PREFACE.startswith(link.head[:len(PREFACE)]):
            return  # the preface so far, and no frame after it yet
        self.loop.remove_reader(sock.fileno())
        link.task = self.loop.create_task(self._relay(link))

    async def _relay(self, link: _Link) -> None:
        client, link.sock = link.sock, None
        assert client is not None
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        near, far = _Side(link, client=True), _Side(link, client=False)
        near.other, far.other = far, near
        near.early.append(link.head)  # what the client sent so far: the server's first bytes
        link.sides = [near, far]
        try:
            upstream.bind("\0" + link.name)
            upstream.setblocking(False)
            upstream.connect(self._upstream(link.origin))  # a local socket: at once, or never
            await self.loop.create_unix_connection(lambda: far, sock=upstream)
            await self.loop.connect_accepted_socket(lambda: near, sock=client)
        except (OSError, asyncio.CancelledError) as err:
            # Sockets not yet a transport's are still ours to close.
            for side, sock in ((near, client), (far, upstream)):
                if side.transport is None:
                    sock.close()
            link.close()
            if isinstance(err, OSError):
                self._refusals.warn("agents_relay", log, "cannot reach the gRPC server",
                                    {"reason": err.strerror})

    # ---------------------------------------------------------------- the servicer's view

    def origin(self, peer: str) -> Origin | None:
        """Where the stream of gRPC peer `peer` comes from; None when not through the front."""
        link = self._by_name.get(peer.removeprefix(ABSTRACT_PEER)) \
            if peer.startswith(ABSTRACT_PEER) else None
        return link.origin if link is not None and not link.closed else None

    def authenticated(self, peer: str) -> None:
        """The connection of `peer` carries an accepted agent: no deadline, not evicted."""
        link = self._by_name.get(peer.removeprefix(ABSTRACT_PEER))
        if link is not None and self._pending.pop(link, False) is None:
            self._quiet.pop(link, None)
            self._agents.add(link)
            if link.origin.uid is not None:
                self.seen_uids.add(link.origin.uid)

    def heard(self, link: _Link) -> None:
        """The client of `link` sent something: last in eviction's order, if not an agent's."""
        if link in self._quiet:
            self._quiet.move_to_end(link)

    def forget(self, link: _Link) -> None:
        self._pending.pop(link, None)
        self._quiet.pop(link, None)
        self._agents.discard(link)
        self._by_name.pop(link.name, None)

    # ---------------------------------------------------------------- counters, closing

    def open_count(self) -> int:
        return len(self._pending) + len(self._agents)

    def connections(self) -> int:
        return self.open_count()

    def _count(self, reason: str) -> None:
        with self._lock:
            self.dropped[reason] += 1

    def dropped_counts(self) -> list[tuple[str, int]]:
        """Connections closed by the limits, by reason (idle_evicted, all_busy,
        hello_timeout)."""
        with self._lock:
            return sorted(self.dropped.items())

    async def close(self) -> None:
        if self._paused is not None:
            self._paused.cancel()
            self._paused = None
        for listener in self._listeners:
            self.loop.remove_reader(listener.fileno())
            listener.close()
        self._listeners.clear()
        for path, inode in self._unix_paths.items():
            with contextlib.suppress(OSError):
                if os.lstat(path).st_ino == inode:
                    os.unlink(path)  # ours still: another's is left alone
        self._unix_paths.clear()
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for link in [*self._pending, *self._agents]:
            link.close()
        await asyncio.sleep(0)
