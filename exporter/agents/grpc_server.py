"""The agents' gRPC endpoint: AgentService.Connect, one stream per training process.

Agents dial the front (exporter.agents.front: the Unix socket and the TCP port, connections
counted, timed and, on the Unix socket, checked for their user); the gRPC server itself listens
only on a socket in a private directory of its own, which the front relays to. Its own options
bound what gRPC can: streams per connection, connections without streams, the handshake, the
size of a message.

Each stream: the agent's Hello (within agents.hello_timeout_seconds, with a compatible protocol
version, else the stream is refused with a message saying why), the sidecar's Welcome, then
reports from the agent and commands from the sidecar, concurrently. Every message is read
without the fields this sidecar does not know (protobuf keeps them otherwise, and a stored report
would hold them for as long as the agent's series live). Bad input (screened by
exporter.agents.screening) ends that one stream with a clear status; other agents are not
affected. The gRPC health service answers Check; its Watch streams, which never end on their
own, are limited to MAX_HEALTH_WATCHES at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Any

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from allocator_ext.protocol.handshake import format_version, incompatibility, local_version
from allocator_ext.protocol.proto.allocwatch.v1 import agent_pb2 as pb
from allocator_ext.protocol.service import SERVICE_NAME
from allocator_ext.protocol.version import PACKAGE_VERSION
from exporter.agents.config import AgentsConfig
from exporter.agents.front import AgentFront, Origin
from exporter.agents.screening import message_problem, screened_report, screened_result
from exporter.shared.config import ConfigError
from exporter.shared.precedence import Precedence
from exporter.shared.refusals import Refusals
from exporter.shared.registry import (
    AgentRefusedError,
    AgentSession,
    AgentState,
    IdentityInUseError,
    Registry,
)
from exporter.shared.socket_dir import SocketDirError, prepare_socket_dir
from exporter.shared.tokens import RotatingToken

log = logging.getLogger("exporter.grpc")

# gRPC health Watch streams open at once (nothing in a pod needs one: the kubelet's probes and
# grpc_health_probe use Check).
MAX_HEALTH_WATCHES = 16
# Streams at once on one connection: an agent opens one (on a connection of its own), and a
# process whose agents shared one would have one each.
MAX_STREAMS_PER_CONNECTION = 16

_REFUSAL_CODES: dict[type[AgentRefusedError], grpc.StatusCode] = {
    IdentityInUseError: grpc.StatusCode.ALREADY_EXISTS}


class ListenError(RuntimeError):
    """The agents' listener cannot be set up (e.g. the socket directory is not writable)."""


def _identity_problem(identity: pb.Identity) -> str | None:
    if identity.pid <= 0:
        return "identity.pid must be a positive process id"
    if not identity.instance_id:
        return "identity.instance_id is empty"
    return None


def read_agent_message(data: bytes) -> pb.AgentMessage:
    """An agent's message without the fields this sidecar does not know."""
    message = pb.AgentMessage.FromString(data)
    message.DiscardUnknownFields()
    return message


def agent_token(config: AgentsConfig) -> RotatingToken | None:
    """The token agents on TCP must present (read again when its file changes), or None (no
    TCP listener, or mutual TLS alone). A token file that does not exist is created with a
    fresh token, readable by those the socket's mode admits and writable by nobody."""
    if config.tcp_port is None or not (config.token_file or config.token_env):
        return None
    if config.token_file and not os.path.lexists(config.token_file):
        _create_token_file(Path(config.token_file), config.socket_mode & 0o444)
    try:
        return RotatingToken(config, "agents")
    except ConfigError as err:  # replaced or emptied since the settings were checked
        raise ListenError(str(err)) from None


# What link() answers on filesystems without hard links (vfat, many FUSE volumes, some SMB).
_NO_HARD_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}


def _create_token_file(path: Path, mode: int) -> None:
    """Write the token to a private file beside `path` and link it into place: the name
    appears with its whole content or not at all, so another sidecar of the pod never reads it
    empty, and a crash leaves at most a private staged file, never an empty token file. The
    link fails where the name exists: the sidecar that linked first wins, the others read its
    token. Where the filesystem has no hard links, the token is written into a file created
    exclusively instead (a sidecar starting at that very moment may then read it empty)."""
    token = secrets.token_hex(32) + "\n"
    try:
        path.parent.mkdir(mode=0o770, parents=True, exist_ok=True)
        fd, staged = tempfile.mkstemp(dir=path.parent, prefix=".token.")
    except OSError as err:
        raise ListenError(f"cannot create the agents' token file {path}: {err.strerror}") from None
    try:
        with os.fdopen(fd, "w") as f:
            f.write(token)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.link(staged, path)  # never follows or replaces what is at `path`
    except FileExistsError:
        return  # another sidecar of the pod made it first: read theirs
    except OSError as err:
        if err.errno not in _NO_HARD_LINKS:
            raise ListenError(
                f"cannot create the agents' token file {path}: {err.strerror}") from None
        log.info("no hard links on the token file's filesystem: created in place",
                 extra={"path": str(path), "reason": err.strerror})
        if not _create_token_file_in_place(path, mode, token):
            return
    finally:
        with contextlib.suppress(OSError):
            os.unlink(staged)
    log.info("agents' token file created", extra={"path": str(path), "mode": oct(mode)})


def _create_token_file_in_place(path: Path, mode: int, token: str) -> bool:
    """Whether this sidecar created the file (False: another made it first; read theirs)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return False
    except OSError as err:
        raise ListenError(f"cannot create the agents' token file {path}: {err.strerror}") from None
    with os.fdopen(fd, "w") as f:
        f.write(token)
        os.fchmod(f.fileno(), mode)
    return True


class AgentService:
    def __init__(self, registry: Registry, config: AgentsConfig, front: AgentFront,
                 refusals: Refusals, token: RotatingToken | None = None):
        self._registry = registry
        self._config = config
        self._front = front
        self._refusals = refusals
        self._token = token

    def add_to(self, server: aio.Server) -> None:
        handlers = {"Connect": grpc.stream_stream_rpc_method_handler(
            self.Connect, request_deserializer=read_agent_message,
            response_serializer=pb.SidecarMessage.SerializeToString)}
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))

    async def _authenticated(self, origin: Origin, context: aio.ServicerContext) -> bool:
        """Whether a stream may go on: any on the Unix socket (its directory, its mode and the
        front's check of the peer's user guard it); on TCP, one presenting the token where one
        is required (compared in constant time)."""
        if self._token is None or not origin.tcp:
            return True
        return await self._token.admits(
            dict(context.invocation_metadata() or ()).get("authorization"))

    async def _refuse(self, context: aio.ServicerContext, code: grpc.StatusCode, reason: str,
                      message: str, peer: str, counted: bool = False) -> None:
        """End the stream with `code`; counted as a stream error unless the refusal was
        counted where it was decided (`counted`); logged, rate-limited by reason."""
        if not counted:
            self._registry.count_stream_error(reason)
        self._refusals.warn(f"agent_stream_{reason}", log, "agent stream refused", {
            "peer": peer, "reason": reason, "detail": message})
        await context.abort(code, message)

    async def Connect(self, request_iterator: Any, context: aio.ServicerContext) -> None:  # noqa: N802
        stream_peer = context.peer() or ""
        origin = self._front.origin(stream_peer)
        if origin is None:  # reached the private socket some other way
            await self._refuse(context, grpc.StatusCode.PERMISSION_DENIED, "not_via_listener",
                               "agents connect through agents.unix_socket or agents.tcp_port",
                               stream_peer)
            return
        peer = origin.describe()
        if not await self._authenticated(origin, context):
            self._refusals.refuse("agent_token", log, "agent stream refused: missing or wrong "
                                  "token", {"peer": peer})
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or wrong agent token: on TCP an agent presents the token of "
                "agents.token_file (ALLOCWATCH_TOKEN_FILE) or agents.token_env "
                "(ALLOCWATCH_TOKEN)")
            return
        try:
            first = await asyncio.wait_for(context.read(), self._config.hello_timeout_seconds)
        except asyncio.TimeoutError:
            await self._refuse(
                context, grpc.StatusCode.DEADLINE_EXCEEDED, "no_hello",
                f"no hello within {self._config.hello_timeout_seconds:g} s: an agent must open "
                "the stream with AgentMessage.hello", peer)
            return
        if first is aio.EOF:
            return
        kind = first.WhichOneof("body")
        if kind != "hello":
            await self._refuse(
                context, grpc.StatusCode.INVALID_ARGUMENT, "no_hello",
                f"the first message must be hello, got {kind or 'an empty message'}", peer)
            return
        hello = first.hello
        if not hello.HasField("protocol_version"):
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "bad_hello",
                               "hello.protocol_version is missing", peer)
            return
        why = incompatibility(hello.protocol_version)
        if why is not None:
            await self._refuse(context, grpc.StatusCode.FAILED_PRECONDITION, "protocol_version",
                               f"sidecar {PACKAGE_VERSION}: agent {why}", peer)
            return
        problem = message_problem(first) or _identity_problem(hello.identity)
        if problem is not None:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "bad_hello", problem,
                               peer)
            return
        protocol = format_version(hello.protocol_version)
        try:
            state = self._registry.connect(hello.identity, protocol, peer)
        except AgentRefusedError as err:
            code = _REFUSAL_CODES.get(type(err), grpc.StatusCode.RESOURCE_EXHAUSTED)
            await self._refuse(context, code, err.reason, str(err), peer, counted=True)
            return
        self._front.authenticated(stream_peer)
        session = AgentSession(asyncio.get_running_loop(), self._registry, state.key)
        state.session = session
        ident = hello.identity
        log.info("agent connected", extra={
            "agent": state.key, "peer": peer, "pid": ident.pid, "host": ident.host,
            "rank": ident.rank, "local_rank": ident.local_rank, "protocol": protocol,
            "backend": ident.backend})
        writer = asyncio.create_task(self._write_commands(context, session))
        reason = "stream ended"
        try:
            await context.write(pb.SidecarMessage(welcome=pb.Welcome(
                protocol_version=local_version(), sidecar_version=PACKAGE_VERSION,
                agent_key=state.key)))
            reason = await self._read_loop(context, state, session)
        finally:
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await writer
            self._registry.disconnect(state)
            log.info("agent disconnected", extra={"agent": state.key, "reason": reason})

    async def _write_commands(self, context: aio.ServicerContext, session: AgentSession) -> None:
        while True:
            command = await session.outgoing.get()
            await context.write(pb.SidecarMessage(command=command))

    async def _read_loop(self, context: aio.ServicerContext, state: AgentState,
                         session: AgentSession) -> str:
        while True:
            message = await context.read()
            if message is aio.EOF:
                return "agent closed the stream"
            kind = message.WhichOneof("body")
            problem = message_problem(message)
            if problem is not None:
                await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT,
                                   "bad_report" if kind == "report" else "bad_message", problem,
                                   state.peer)
            if kind == "report":
                report, dropped = screened_report(message.report)
                self._registry.count_figures_dropped(dropped)
                self._registry.record_report(state, report)
            elif kind == "command_result":
                result, dropped = screened_result(message.command_result)
                self._registry.count_figures_dropped(dropped)
                if not session.resolve(result):
                    self._refusals.warn("unknown_command_result", log,
                                        "result for an unknown command", {
                                            "agent": state.key, "command_id": result.command_id})
            elif kind == "goodbye":
                return f"goodbye: {message.goodbye.reason}"
            elif kind == "hello":
                await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "bad_sequence",
                                   "hello sent twice on one stream", state.peer)
            else:
                await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "bad_message",
                                   "empty AgentMessage (no body set)", state.peer)


class BoundedHealth(health_aio.HealthServicer):  # type: ignore[misc]
    """grpc's health service, its Watch streams limited to MAX_HEALTH_WATCHES at once (each
    lasts as long as its client keeps it, and holds memory meanwhile)."""

    def __init__(self, refusals: Refusals):
        super().__init__()
        self._refusals = refusals
        self.watching = 0

    async def Watch(self, request: Any, context: aio.ServicerContext) -> None:  # noqa: N802
        if self.watching >= MAX_HEALTH_WATCHES:
            self._refusals.refuse("health_watch_limit", log, "gRPC health Watch refused", {
                "watching": self.watching})
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"at most {MAX_HEALTH_WATCHES} health Watch streams at once; "
                                "Check answers without one")
            return
        self.watching += 1
        try:
            await super().Watch(request, context)
        finally:
            self.watching -= 1


class AgentsEndpoint:
    """The gRPC server on its private socket and the front before it. `await start()`, then
    `targets` are the addresses agents dial; `await stop(grace)`."""

    def __init__(self, registry: Registry, config: AgentsConfig, refusals: Refusals,
                 max_connections: int, precedence: Precedence | None = None):
        self._registry = registry
        self._precedence = precedence
        self._config = config
        self._refusals = refusals
        self._max_connections = max_connections
        self.front: AgentFront | None = None
        self.server: aio.Server | None = None
        self.health: BoundedHealth | None = None
        self.targets: list[str] = []
        self._private = ""

    async def start(self) -> None:
        config = self._config
        # The gRPC server's own socket, in a directory only this user can enter.
        self._private = tempfile.mkdtemp(prefix="allocwatch-grpc-")
        plain = f"{self._private}/grpc.sock"
        secure = f"{self._private}/grpc-tls.sock"
        credentials = _tls_credentials(config) if config.tcp_port is not None else None
        hello_ms = int(config.hello_timeout_seconds * 1000)
        server = aio.server(options=[
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
            # Behind the front's deadline (which decides, and counts), in case it did not: a
            # connection without a stream is closed (an agent's ends with its stream), and one
            # still shaking hands.
            ("grpc.max_connection_idle_ms", 2 * hello_ms + 1000),
            ("grpc.server_handshake_timeout_ms", hello_ms + 1000),
            ("grpc.so_reuseport", 0),
        ])
        self.server = server
        self.front = AgentFront(
            lambda origin: secure if origin.tcp and credentials is not None else plain,
            max_connections=self._max_connections, hello_timeout=config.hello_timeout_seconds,
            allowed_uids=config.allowed_uids, refusals=self._refusals,
            precedence=self._precedence)
        service = AgentService(self._registry, config, self.front, self._refusals,
                               agent_token(config))
        service.add_to(server)
        self.health = BoundedHealth(self._refusals)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        server.add_insecure_port(f"unix://{plain}")
        if credentials is not None:
            server.add_secure_port(f"unix://{secure}", credentials)
        await server.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if config.unix_socket:
            path = Path(config.unix_socket)
            try:
                prepare_socket_dir(path.parent, config.socket_mode, "agents.unix_socket")
                self.front.listen_unix(str(path), config.socket_mode)
            except SocketDirError as err:
                raise ListenError(str(err)) from None
            except OSError as err:
                raise ListenError(f"cannot listen on unix socket {path}: "
                                  f"{err.strerror or err}") from None
            self.targets.append(f"unix://{path}")
        if config.tcp_port is not None:
            host = config.tcp_address
            bracketed = f"[{host}]" if ":" in host else host
            try:
                port = self.front.listen_tcp(host, config.tcp_port)
            except OSError as err:
                raise ListenError(f"cannot listen on {bracketed}:{config.tcp_port}: "
                                  f"{err.strerror}") from None
            self.targets.append(f"{bracketed}:{port}")

    async def stop(self, grace: float | None = None) -> None:
        if self.front is not None:
            await self.front.close()
        if self.server is not None:
            await self.server.stop(grace)
        if self._private:
            shutil.rmtree(self._private, ignore_errors=True)


def _tls_credentials(config: AgentsConfig) -> grpc.ServerCredentials | None:
    """Server credentials for the TCP listener, or None for plaintext."""
    if not config.tls_cert_file:
        return None

    def read(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    client_ca = read(config.tls_client_ca_file) if config.tls_client_ca_file else None
    return grpc.ssl_server_credentials(
        [(read(config.tls_key_file), read(config.tls_cert_file))],
        root_certificates=client_ca, require_client_auth=client_ca is not None)
