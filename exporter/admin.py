"""The sidecar's admin API: JSON over HTTP, for `allocwatch ctl`.

Served by the standard library's threading HTTP server (no new dependency; admin traffic is a
few requests, each handled on its own thread, so waiting for agents never touches the gRPC event
loop: commands are handed to the loop with run_coroutine_threadsafe and awaited from the thread).

Where it listens: a Unix socket (mode 0600 by default: file permissions are the access control),
and, only when configured, TCP (loopback unless configured otherwise) where every request must
carry `Authorization: Bearer TOKEN`; the token is compared in constant time and never logged.
With admin.tls_cert_file/tls_key_file the TCP listener speaks HTTPS (and with
tls_client_ca_file asks for client certificates), so the token never crosses a network in clear.

    GET  /v1/agents?rank=&host=&job=&agent=      the agents and their live figures
    POST /v1/settings     {"settings": "...", selectors}
    POST /v1/reclaim      {"mode": "gc"|"all", selectors}
    POST /v1/snapshot     {"frames": false, selectors}   -> path, bytes, download URL
    GET  /v1/snapshots/NAME                         the snapshot file's bytes
    POST /v1/reset-peaks  {selectors}

A bad request (unknown field, invalid settings, no agent selected) is answered 4xx with a message
and sends nothing. Every request is logged (endpoint, selectors, peer, status), never its headers.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hmac
import json
import logging
import os
import socket
import socketserver
import ssl
import stat
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric

from exporter.admin_config import AdminConfig, read_token, server_tls_context
from exporter.config import ConfigError
from exporter.protocol.figures import fragmentation_ratio
from exporter.protocol.proto.allocwatch.v1 import agent_pb2 as pb
from exporter.protocol.settings import validate_settings
from exporter.registry import AgentGoneError, AgentState, Registry

log = logging.getLogger("exporter.admin")

MAX_BODY_BYTES = 64 << 10
MAX_SNAPSHOT_BYTES = 256 << 20
SNAPSHOTS_KEPT = 64
SELECTOR_FIELDS = ("rank", "host", "job", "agent")
_COUNTER_FIELDS = ("alloc_retries", "ooms", "device_mallocs", "device_frees", "sync_all_streams",
                   "gc_reclaims", "gc_reclaimed_bytes", "empty_cache_calls", "allocations")
_POOL_FIELDS = ("allocated_bytes", "reserved_bytes", "active_bytes", "requested_bytes",
                "inactive_split_bytes", "segments", "peak_allocated_bytes", "peak_reserved_bytes")


class AdminError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


# ---------------------------------------------------------------------- selection


@dataclasses.dataclass(frozen=True)
class Selector:
    rank: int | None = None
    host: str | None = None
    job: str | None = None
    agent: str | None = None

    @classmethod
    def parse(cls, values: Mapping[str, Any]) -> Selector:
        rank = values.get("rank")
        if rank is not None and rank != "":
            if isinstance(rank, bool):
                raise AdminError(400, f"rank: expected an integer, got {rank!r}")
            try:
                rank = int(rank)
            except (TypeError, ValueError):
                raise AdminError(400, f"rank: expected an integer, got {rank!r}") from None
        else:
            rank = None
        strings = {}
        for name in ("host", "job", "agent"):
            value = values.get(name)
            if value is not None and not isinstance(value, str):
                raise AdminError(400, f"{name}: expected a string, got {value!r}")
            strings[name] = value or None
        return cls(rank=rank, **strings)

    def matches(self, state: AgentState) -> bool:
        ident = state.identity
        return ((self.rank is None or ident.rank == self.rank)
                and (self.host is None or ident.host == self.host)
                and (self.job is None or ident.training_job == self.job)
                and (self.agent is None or state.key == self.agent))

    def describe(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


def settings_view(settings: pb.AllocatorSettings) -> dict[str, Any]:
    return {"config_string": settings.config_string,
            "garbage_collection_threshold": settings.garbage_collection_threshold,
            "max_split_size_bytes": settings.max_split_size_bytes or None,
            "expandable_segments": settings.expandable_segments}


def _pool_view(pool: pb.PoolStats) -> dict[str, int]:
    return {name: getattr(pool, name) for name in _POOL_FIELDS}


def agent_view(state: AgentState) -> dict[str, Any]:
    ident = state.identity
    report = state.last_report
    devices = []
    for device in report.devices if report is not None else []:
        stats = device.allocator
        memory = None
        if device.HasField("device_memory"):
            memory = {"total_bytes": device.device_memory.total_bytes,
                      "used_bytes": device.device_memory.used_bytes}
        devices.append({
            "cuda_device": device.cuda_device, "gpu_uuid": device.gpu_uuid,
            **_pool_view(stats.all),
            "small_pool": _pool_view(stats.small_pool), "large_pool": _pool_view(stats.large_pool),
            "pending_free_bytes": stats.pending_free_bytes,
            "pending_events": stats.pending_events,
            "fragmentation_ratio": fragmentation_ratio(stats.all.reserved_bytes,
                                                       stats.all.allocated_bytes),
            "counters": {name: getattr(stats, name) for name in _COUNTER_FIELDS},
            "settings": settings_view(device.settings),
            "device_memory": memory,
        })
    return {
        "agent": state.key, "connected": state.connected, "rank": ident.rank,
        "local_rank": ident.local_rank, "world_size": ident.world_size, "host": ident.host,
        "pid": ident.pid, "job": ident.training_job, "pod": ident.pod,
        "backend": ident.backend, "protocol": state.protocol,
        "reports_received": state.reports_received,
        "report_sequence": report.sequence if report is not None else None,
        "report_timestamp": report.timestamp_seconds if report is not None else None,
        "devices": devices,
    }


# ---------------------------------------------------------------------- the service


@dataclasses.dataclass(frozen=True)
class _Endpoint:
    command: str                 # pb.Command's action, for logs and results
    fields: frozenset[str]       # body fields besides the selectors


_ENDPOINTS = {
    "/v1/settings": _Endpoint("set_config", frozenset({"settings"})),
    "/v1/reclaim": _Endpoint("reclaim", frozenset({"mode"})),
    "/v1/snapshot": _Endpoint("snapshot", frozenset({"frames", "max_bytes"})),
    "/v1/reset-peaks": _Endpoint("reset_peaks", frozenset()),
}


def _settings(text: Any) -> str:
    if not isinstance(text, str) or not text.strip():
        raise AdminError(400, "settings: expected a non-empty settings string "
                              "(e.g. garbage_collection_threshold:0.8)")
    try:
        return validate_settings(text)
    except ValueError as err:
        raise AdminError(400, f"settings: {err}") from None


def build_command(endpoint: _Endpoint, body: Mapping[str, Any]) -> pb.Command:
    """The command for a request body, validated before anything is sent."""
    if endpoint.command == "set_config":
        return pb.Command(cuda_device=-1, set_config=pb.SetConfig(
            settings=_settings(body.get("settings"))))
    if endpoint.command == "reclaim":
        mode = body.get("mode", "gc")
        if mode not in ("gc", "all"):
            raise AdminError(400, f"mode: must be gc or all, got {mode!r}")
        return pb.Command(cuda_device=-1, reclaim=pb.Reclaim(
            mode=pb.Reclaim.EMPTY_CACHE if mode == "all" else pb.Reclaim.GARBAGE_COLLECT))
    if endpoint.command == "snapshot":
        frames, max_bytes = body.get("frames", False), body.get("max_bytes", 0)
        if not isinstance(frames, bool):
            raise AdminError(400, f"frames: expected true or false, got {frames!r}")
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise AdminError(400, f"max_bytes: expected a byte count, got {max_bytes!r}")
        return pb.Command(cuda_device=-1, snapshot=pb.Snapshot(include_frames=frames,
                                                               max_bytes=max_bytes))
    return pb.Command(cuda_device=-1, reset_peaks=pb.ResetPeaks())


class AdminService:
    """What the endpoints do, independent of HTTP."""

    def __init__(self, registry: Registry, loop: asyncio.AbstractEventLoop,
                 timeout: Callable[[], float]):
        self.registry = registry
        self.loop = loop
        self.timeout = timeout
        self._snapshots: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._lock = threading.Lock()

    def list_agents(self, selector: Selector) -> dict[str, Any]:
        agents = [agent_view(a) for a in self.registry.agents() if selector.matches(a)]
        return {"agents": agents}

    def run(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        endpoint = _ENDPOINTS[path]
        unknown = set(body) - set(SELECTOR_FIELDS) - endpoint.fields
        if unknown:
            known = sorted(set(SELECTOR_FIELDS) | endpoint.fields)
            raise AdminError(400, f"unknown field {sorted(unknown)[0]!r} (known: "
                                  f"{', '.join(known)})")
        selector = Selector.parse(body)
        command = build_command(endpoint, body)
        targets = [a for a in self.registry.agents()
                   if a.connected and a.session is not None and selector.matches(a)]
        if not targets:
            raise AdminError(404, f"no connected agent matches {selector.describe() or 'any'}")
        timeout = self.timeout()
        future = asyncio.run_coroutine_threadsafe(self._dispatch(targets, command, timeout),
                                                  self.loop)
        outcomes = future.result(timeout + 5.0)
        results = [self._result_view(state, outcome) for state, outcome in outcomes]
        return {"command": endpoint.command, "selector": selector.describe(),
                "selected": len(targets), "ok": all(r["status"] == "ok" for r in results),
                "results": results}

    async def _dispatch(self, targets: list[AgentState], command: pb.Command, timeout: float
                        ) -> list[tuple[AgentState, pb.CommandResult | str]]:
        async def one(state: AgentState) -> tuple[AgentState, pb.CommandResult | str]:
            session = state.session
            if session is None:
                return state, "disconnected"
            copy = pb.Command()
            copy.CopyFrom(command)  # each agent's command gets its own id
            try:
                return state, await session.send(copy, timeout)
            except asyncio.TimeoutError:
                return state, "timeout"
            except AgentGoneError:
                return state, "disconnected"
        return list(await asyncio.gather(*(one(s) for s in targets)))

    def _result_view(self, state: AgentState, outcome: pb.CommandResult | str) -> dict[str, Any]:
        view: dict[str, Any] = {"agent": state.key, "rank": state.identity.rank,
                                "host": state.identity.host}
        if isinstance(outcome, str):
            view.update(status=outcome, message=f"no answer from the agent ({outcome})")
            return view
        view.update(
            status=pb.CommandResult.Status.Name(outcome.status).lower(),
            message=outcome.message, bytes_released=outcome.bytes_released,
            sync_seconds=outcome.sync_seconds,
            settings_in_force=[{"cuda_device": s.cuda_device, **settings_view(s.settings)}
                               for s in outcome.settings_in_force])
        if outcome.snapshot_path:
            name = Path(outcome.snapshot_path).name
            with self._lock:
                self._snapshots[name] = outcome.snapshot_path
                while len(self._snapshots) > SNAPSHOTS_KEPT:
                    self._snapshots.popitem(last=False)
            view["snapshot"] = {"path": outcome.snapshot_path, "bytes": outcome.snapshot_bytes,
                                "download": f"/v1/snapshots/{urllib.parse.quote(name)}"}
        return view

    def snapshot_bytes(self, name: str) -> bytes:
        """A snapshot an agent reported through this API (no other file is ever served)."""
        with self._lock:
            path = self._snapshots.get(name)
        if path is None:
            raise AdminError(404, f"no snapshot named {name!r} was taken through this sidecar")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as err:
            raise AdminError(409, f"cannot read {path}: {err.strerror} (the sidecar needs read "
                                  "access to the agents' snapshot directory)") from None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_SNAPSHOT_BYTES:
                raise AdminError(409, f"{path} is not a regular file of at most "
                                      f"{MAX_SNAPSHOT_BYTES} bytes")
            return f.read(MAX_SNAPSHOT_BYTES)


# ---------------------------------------------------------------------- HTTP


class _TcpServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    requires_token = True
    tls: _TlsFiles | None = None
    handshake_timeout = 10.0

    def finish_request(self, request: Any, client_address: Any) -> None:
        # The TLS handshake runs here, in the request's own thread, so a client that stalls
        # it holds up nobody else (wrapping the listening socket would do it in accept()).
        if self.tls is not None:
            request.settimeout(self.handshake_timeout)
            try:
                request = self.tls.context().wrap_socket(request, server_side=True)
            except (OSError, ValueError) as err:
                log.warning("admin API: TLS handshake failed",
                            extra={"client": str(client_address[0]), "reason": str(err)})
                return
            request.settimeout(None)
        super().finish_request(request, client_address)


class _TlsFiles:
    """The TLS context of the TCP listener, rebuilt when its files change on disk, so that a
    renewed certificate (a cert-manager Secret update, say) is served without a restart."""

    def __init__(self, config: AdminConfig):
        self._config = config
        self._files = [f for f in (config.tls_cert_file, config.tls_key_file,
                                   config.tls_client_ca_file) if f]
        self._lock = threading.Lock()
        self._stamp = self._read_stamp()
        context = server_tls_context(config)
        assert context is not None
        self._context: ssl.SSLContext = context

    def _read_stamp(self) -> tuple[float, ...]:
        try:
            return tuple(os.stat(f).st_mtime for f in self._files)
        except OSError:
            return ()

    def context(self) -> ssl.SSLContext:
        with self._lock:
            stamp = self._read_stamp()
            if stamp and stamp != self._stamp:
                try:
                    fresh = server_tls_context(self._config)
                except (OSError, ValueError) as err:  # half-written files: keep the old one
                    log.warning("admin API: the renewed TLS files cannot be loaded yet; the "
                                "previous certificate stays", extra={"reason": str(err)})
                else:
                    if fresh is not None:
                        self._context, self._stamp = fresh, stamp
            return self._context


class _TcpServer6(_TcpServer):
    address_family = socket.AF_INET6


class _UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    requires_token = False  # the socket's file mode is the access control


class AdminHttpServer:
    def __init__(self, config: AdminConfig, agents_socket: str, service: AdminService):
        self.service = service
        self._token: bytes | None = read_token(config)
        self._servers: list[socketserver.BaseServer] = []
        self._threads: list[threading.Thread] = []
        self.requests_total: collections.Counter[tuple[str, str]] = collections.Counter()
        self._lock = threading.Lock()
        self.unix_path = config.socket_path(agents_socket)
        self.tcp_url: str | None = None
        handler = self._make_handler()
        if self.unix_path:
            self._servers.append(_bind_unix(self.unix_path, config.socket_mode, handler))
        if config.tcp_port is not None:
            if self._token is None:  # parse_admin_section refuses this; never serve TCP open
                raise ConfigError("admin.tcp_port: a token is required")
            host = config.tcp_address
            server_class = _TcpServer6 if ":" in host else _TcpServer
            tcp = server_class((host, config.tcp_port), handler)
            tcp.tls = _TlsFiles(config) if config.tls_cert_file else None
            self._servers.append(tcp)
            shown = f"[{host}]" if ":" in host else host
            scheme = "https" if tcp.tls is not None else "http"
            self.tcp_url = f"{scheme}://{shown}:{tcp.server_address[1]}"

    def set_token(self, config: AdminConfig) -> None:
        """A reloaded settings file (or a rotated Secret) brings a new token."""
        token = read_token(config)
        if token is not None or not any(getattr(s, "requires_token", False)
                                        for s in self._servers):
            self._token = token

    def start(self) -> None:
        for server in self._servers:
            # A short poll interval: shutdown() waits for it, and the sidecar stops promptly.
            thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1},
                                      name="allocwatch-admin", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()
        if self.unix_path:
            try:
                os.unlink(self.unix_path)
            except OSError:
                pass

    def addresses(self) -> list[str]:
        found = [f"unix://{self.unix_path}"] if self.unix_path else []
        return found + ([self.tcp_url] if self.tcp_url else [])

    def authorized(self, header: str | None) -> bool:
        expected = self._token
        if expected is None:
            return False
        presented = b""
        if header and header[:7].lower() == "bearer ":
            presented = header[7:].strip().encode("utf-8", "replace")
        # Constant time: the comparison does not stop at the first differing byte.
        return hmac.compare_digest(presented, expected)

    def count(self, endpoint: str, code: int) -> None:
        with self._lock:
            self.requests_total[(endpoint, str(code))] += 1

    def families(self) -> Iterator[Metric]:
        with self._lock:
            totals = sorted(self.requests_total.items())
        family = CounterMetricFamily("allocwatch_admin_requests",
                                     "Admin API requests, by endpoint and HTTP status",
                                     labels=["endpoint", "code"])
        for labels, count in totals:
            family.add_metric(list(labels), count)
        yield family

    def _make_handler(self) -> type[BaseHTTPRequestHandler]:
        admin = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "allocwatch-admin"
            timeout = 30  # a client that stalls mid-request loses its thread, not ours

            def address_string(self) -> str:
                address = self.client_address
                return str(address[0]) if isinstance(address, tuple) and address else "unix"

            def log_message(self, format: str, *args: Any) -> None:
                pass  # every request is logged once, structured, in _finish

            def do_GET(self) -> None:
                self._handle("GET")

            def do_POST(self) -> None:
                self._handle("POST")

            def do_PUT(self) -> None:
                self._handle("PUT")

            def do_DELETE(self) -> None:
                self._handle("DELETE")

            def _handle(self, method: str) -> None:
                started = time.perf_counter()
                url = urllib.parse.urlsplit(self.path)
                endpoint = _endpoint_label(url.path)
                fields: dict[str, Any] = {}
                try:
                    if getattr(self.server, "requires_token", True) and not admin.authorized(
                            self.headers.get("Authorization")):
                        raise AdminError(401, "missing or wrong bearer token")
                    status, payload = self._route(method, url, fields)
                except AdminError as err:
                    status, payload = err.status, {"error": str(err)}
                except Exception as err:  # a bug must answer 500, never kill the server
                    log.exception("admin request failed")
                    status, payload = 500, {"error": f"{type(err).__name__}: {err}"}
                self._reply(status, payload)
                admin.count(endpoint, status)
                level = logging.WARNING if status in (401, 403) else logging.INFO
                log.log(level, "admin request", extra={
                    "method": method, "endpoint": endpoint, "status": status,
                    "peer": self.address_string(),
                    "duration_seconds": round(time.perf_counter() - started, 6), **fields,
                    **({"error": payload["error"]} if isinstance(payload, dict)
                       and "error" in payload else {})})

            def _route(self, method: str, url: urllib.parse.SplitResult,
                       fields: dict[str, Any]) -> tuple[int, Any]:
                if url.path == "/v1/agents" and method == "GET":
                    query = dict(urllib.parse.parse_qsl(url.query))
                    unknown = set(query) - set(SELECTOR_FIELDS)
                    if unknown:
                        raise AdminError(400, f"unknown query field {sorted(unknown)[0]!r}")
                    selector = Selector.parse(query)
                    fields["selector"] = selector.describe()
                    return 200, admin.service.list_agents(selector)
                if url.path.startswith("/v1/snapshots/") and method == "GET":
                    name = urllib.parse.unquote(url.path[len("/v1/snapshots/"):])
                    fields["snapshot"] = name
                    return 200, admin.service.snapshot_bytes(name)
                if url.path in _ENDPOINTS:
                    if method != "POST":
                        raise AdminError(405, f"{url.path} takes POST")
                    body = self._body()
                    fields["selector"] = {k: body[k] for k in SELECTOR_FIELDS if k in body}
                    result = admin.service.run(url.path, body)
                    fields.update(selected=result["selected"], ok=result["ok"],
                                  results={r["agent"]: r["status"] for r in result["results"]})
                    return 200, result
                raise AdminError(404, f"no endpoint {method} {url.path}")

            def _body(self) -> dict[str, Any]:
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                except ValueError:
                    raise AdminError(400, "bad Content-Length") from None
                if length > MAX_BODY_BYTES:
                    raise AdminError(413, f"the body is larger than {MAX_BODY_BYTES} bytes")
                raw = self.rfile.read(length) if length else b"{}"
                try:
                    body = json.loads(raw)
                except (ValueError, UnicodeDecodeError):
                    raise AdminError(400, "the body is not JSON") from None
                if not isinstance(body, dict):
                    raise AdminError(400, "the body must be a JSON object")
                return body

            def _reply(self, status: int, payload: Any) -> None:
                if isinstance(payload, bytes):
                    data, kind = payload, "application/octet-stream"
                else:
                    data, kind = (json.dumps(payload, indent=1) + "\n").encode(), \
                        "application/json"
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                if status == 401:
                    self.send_header("WWW-Authenticate", 'Bearer realm="allocwatch"')
                self.end_headers()
                self.wfile.write(data)

        return Handler


def _endpoint_label(path: str) -> str:
    # Bounded label values: a snapshot's name is not a label.
    if path.startswith("/v1/snapshots/"):
        return "/v1/snapshots"
    return path if path == "/v1/agents" or path in _ENDPOINTS else "other"


def _bind_unix(path: str, mode: int, handler: type[BaseHTTPRequestHandler]) -> _UnixServer:
    target = Path(path)
    target.parent.mkdir(mode=0o770, parents=True, exist_ok=True)
    if target.exists() or target.is_symlink():
        if not stat.S_ISSOCK(target.lstat().st_mode):
            raise ConfigError(f"admin.unix_socket: {path} exists and is not a socket")
        target.unlink()  # a stale socket of a previous sidecar
    old_umask = os.umask(0o777 & ~mode)  # never more open than asked, not even for an instant
    try:
        server = _UnixServer(path, handler)
    finally:
        os.umask(old_umask)
    os.chmod(path, mode)
    return server
