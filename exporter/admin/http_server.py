"""The admin API's listeners: JSON over HTTP, for `allocwatch ctl`, on the sidecar's event loop
with every client resource bounded (exporter.shared.bounded_http: connections, deadlines,
header and body sizes; a chunked body is read, counted against the limit, never dropped).

Where it listens: a Unix socket (mode 0600 by default: file permissions are the access control),
and, only when configured, TCP (loopback unless configured otherwise) where every request must
carry `Authorization: Bearer TOKEN`, checked before the body is read (a refused request's body
is never waited for); the token is compared in constant time and never logged. With
admin.tls_cert_file/tls_key_file the TCP listener speaks HTTPS (exporter.admin.tls), renewed
certificates taken at the next handshake.

`parse_request` turns method, target and body into what to do, refusing anything else with an
AdminError (and a status) before anything is sent; every request is logged (endpoint,
selectors, peer, status), never its headers, but a refusal for a missing or wrong token is
counted (allocwatch_refused_total{reason="admin_token"}) and logged rate-limited (a client
may send thousands a second).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import os
import threading
import time
import urllib.parse
from typing import Any

from aiohttp import hdrs, web

from exporter.admin.config import AdminConfig
from exporter.admin.service import (
    ENDPOINTS,
    SELECTOR_FIELDS,
    AdminError,
    AdminService,
    CommandRequest,
    Selector,
)
from exporter.admin.tls import RenewingTlsContext
from exporter.shared.bounded_http import BoundedHttpServer, HttpError, read_body
from exporter.shared.config import ConfigError, shown
from exporter.shared.precedence import Precedence
from exporter.shared.refusals import Refusals
from exporter.shared.tokens import RotatingToken, in_daemon_thread

log = logging.getLogger("exporter.admin")

SNAPSHOTS = "/v1/snapshots/"
_CHUNK = 1 << 20


@dataclasses.dataclass(frozen=True)
class AdminCall:
    """One request, parsed: list agents (`selector`), fetch a snapshot (`snapshot`), or run a
    command (`command`)."""

    endpoint: str                         # its label: a bounded set of values
    selector: Selector | None = None
    snapshot: str = ""
    command: CommandRequest | None = None


def endpoint_label(path: str) -> str:
    # Bounded label values: a snapshot's name is not a label.
    if path.startswith(SNAPSHOTS):
        return "/v1/snapshots"
    return path if path == "/v1/agents" or path in ENDPOINTS else "other"


def needs_body(method: str, path: str) -> bool:
    return method == "POST" and path in ENDPOINTS


def parse_body(raw: bytes) -> dict[str, Any]:
    """A command's JSON body: an object; AdminError (400) for anything else."""
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise AdminError(400, "the body is not JSON") from None
    except RecursionError:
        raise AdminError(400, "the body is not JSON this API reads: nested too deeply") from None
    if not isinstance(body, dict):
        raise AdminError(400, "the body must be a JSON object")
    return body


def parse_request(method: str, target: str, body: bytes = b"") -> AdminCall:
    """What a request asks; AdminError (with its status) for anything this API refuses. Pure:
    reads nothing but its arguments, changes nothing."""
    url = urllib.parse.urlsplit(target)
    path, label = url.path, endpoint_label(url.path)
    if path == "/v1/agents" and method == "GET":
        try:
            query = dict(urllib.parse.parse_qsl(url.query, max_num_fields=len(SELECTOR_FIELDS)))
        except ValueError:  # more fields than there are selectors
            raise AdminError(400, f"at most {len(SELECTOR_FIELDS)} query fields: "
                                  f"{', '.join(SELECTOR_FIELDS)}") from None
        unknown = set(query) - set(SELECTOR_FIELDS)
        if unknown:
            raise AdminError(400, f"unknown query field {shown(sorted(unknown)[0])}")
        return AdminCall(label, selector=Selector.parse(query))
    if path.startswith(SNAPSHOTS) and method == "GET":
        return AdminCall(label, snapshot=urllib.parse.unquote(path[len(SNAPSHOTS):]))
    if path in ENDPOINTS:
        if method != "POST":
            raise AdminError(405, f"{path} takes POST")
        return AdminCall(label, command=CommandRequest.parse(path, parse_body(body)))
    raise AdminError(404, f"no endpoint {shown(method)} {shown(path)}")


def _read_token(config: AdminConfig) -> tuple[RotatingToken, bytes | None]:
    """The token a settings file names, read (on a worker thread: see set_token)."""
    token = RotatingToken(config, "admin")
    return token, token.current()


class AdminHttpServer:
    def __init__(self, config: AdminConfig, agents_socket: str, service: AdminService,
                 refusals: Refusals | None = None, precedence: Precedence | None = None):
        self.service = service
        self._refusals = refusals or Refusals()
        self._config = config
        self._token = RotatingToken(config, "admin")
        self._token_reloads = 0
        self.requests_total: collections.Counter[tuple[str, str]] = collections.Counter()
        self._lock = threading.Lock()
        self.unix_path = config.socket_path(agents_socket)
        self.tcp_url: str | None = None
        if config.tcp_port is not None and self._token.current() is None:
            # AdminConfig refuses this; never serve TCP open
            raise ConfigError("admin.tcp_port: a token is required")
        self._tls = (RenewingTlsContext(config.tls_cert_file, config.tls_key_file,
                                        config.tls_client_ca_file)
                     if config.tcp_port is not None and config.tls_cert_file else None)
        self.http = BoundedHttpServer("admin", self._handle, config.limits, precedence)

    async def start(self) -> None:
        config = self._config
        if self.unix_path:
            await self.http.listen_unix(self.unix_path, config.socket_mode, "admin.unix_socket")
        if config.tcp_port is not None:
            host = config.tcp_address
            port = await self.http.listen_tcp(
                host, config.tcp_port, self._tls.listening_context() if self._tls else None)
            shown_host = f"[{host}]" if ":" in host else host
            self.tcp_url = f"{'https' if self._tls else 'http'}://{shown_host}:{port}"

    async def stop(self) -> None:
        await self.http.close()

    async def set_token(self, config: AdminConfig) -> None:
        """A reloaded settings file names a new token (a rotated Secret behind the same file
        needs no reload: `RotatingToken` reads it again). Its file is read in a daemon thread,
        never on the event loop, which answers the scrapes too: a file on a mount that stopped
        answering holds up nothing but its own reading, not even the sidecar's exit. Until it
        is read, and where it cannot be used, the token in force stays; of two reloads read
        out of order, the later wins."""
        self._token_reloads += 1
        reload = self._token_reloads
        try:
            token, current = await asyncio.wrap_future(
                in_daemon_thread(lambda: _read_token(config), "allocwatch-admin-token-reload"))
        except ConfigError as err:
            log.error("the reloaded admin token cannot be read; the old one stays",
                      extra={"reason": str(err)})
            return
        if reload == self._token_reloads and (current is not None or self.tcp_url is None):
            self._token = token

    def addresses(self) -> list[str]:
        found = [f"unix://{self.unix_path}"] if self.unix_path else []
        return found + ([self.tcp_url] if self.tcp_url else [])

    async def authorized(self, header: str | None) -> bool:
        return await self._token.admits(header)

    def count(self, endpoint: str, code: int) -> None:
        with self._lock:
            self.requests_total[(endpoint, str(code))] += 1

    def request_counts(self) -> list[tuple[tuple[str, str], int]]:
        """Requests by endpoint and HTTP status, for the collector."""
        with self._lock:
            return sorted(self.requests_total.items())

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        started = time.perf_counter()
        method, target = request.method, request.raw_path
        path = urllib.parse.urlsplit(target).path
        endpoint = endpoint_label(path)
        fields: dict[str, Any] = {}
        response: web.StreamResponse
        try:
            # The Unix socket's file mode is its access control; TCP needs the token.
            if not (BoundedHttpServer.over_unix_socket(request)
                    or await self.authorized(request.headers.get("Authorization"))):
                raise AdminError(401, "missing or wrong bearer token")
            body = (await read_body(request, self._config.limits.max_body_bytes)
                    if needs_body(method, path) else b"")
            call = parse_request(method, target, body)
            response = await self._answer(request, call, fields)
        except (AdminError, HttpError) as err:
            response = _json(err.status, {"error": str(err)})
            fields["error"] = str(err)
        except Exception as err:  # a bug must answer 500, never kill the server
            log.exception("admin request failed")
            response = _json(500, {"error": f"{type(err).__name__}: {shown(str(err))}"})
        status = response.status
        self.count(endpoint, status)
        peer = request.transport.get_extra_info("peername") if request.transport else None
        # A method the protocol knows as it is; anything else a client sent, shortened.
        extra = {"method": method if method in hdrs.METH_ALL else shown(method),
                 "endpoint": endpoint, "status": status,
                 "peer": str(peer[0]) if isinstance(peer, tuple) and peer else "unix",
                 "duration_seconds": round(time.perf_counter() - started, 6), **fields}
        if status == 401:  # a client without the token may send thousands a second
            self._refusals.refuse("admin_token", log, "admin request refused", extra)
        else:
            log.log(logging.WARNING if status == 403 else logging.INFO, "admin request",
                    extra=extra)
        return response

    async def _answer(self, request: web.BaseRequest, call: AdminCall,
                      fields: dict[str, Any]) -> web.StreamResponse:
        if call.selector is not None:
            fields["selector"] = call.selector.describe()
            return await asyncio.to_thread(_json, 200, self.service.list_agents(call.selector))
        if call.command is not None:
            fields["selector"] = call.command.selector.describe()
            result = await self.service.run(call.command)
            fields.update(selected=result["selected"], ok=result["ok"],
                          results={r["agent"]: r["status"] for r in result["results"]})
            # Up to service.MAX_REPLY_BYTES: written off the loop, which serves the scrapes.
            return await asyncio.to_thread(_json, 200, result)
        fields["snapshot"] = shown(call.snapshot)
        return await self._send_snapshot(request, call.snapshot)

    async def _send_snapshot(self, request: web.BaseRequest, name: str) -> web.StreamResponse:
        fd, size = self.service.open_snapshot(name)
        loop = asyncio.get_running_loop()
        reading: asyncio.Future[bytes] | None = None
        try:
            response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
            response.content_length = size
            await response.prepare(request)
            sent = 0
            while sent < size:  # read off the loop, a chunk at a time: memory stays flat
                reading = loop.run_in_executor(None, os.read, fd, min(_CHUNK, size - sent))
                chunk = await asyncio.shield(reading)
                if not chunk:
                    break  # truncated under us: the client sees a short body
                await response.write(chunk)
                sent += len(chunk)
            await response.write_eof()
            return response
        finally:
            if reading is not None and not reading.done():  # cut off: close after the read
                reading.add_done_callback(lambda _: os.close(fd))
            else:
                os.close(fd)


def _json(status: int, payload: Any) -> web.Response:
    headers = {"WWW-Authenticate": 'Bearer realm="allocwatch"'} if status == 401 else None
    # UTF-8 as it is: escaping each non-ASCII character would make it up to six bytes.
    return web.Response(status=status,
                        text=json.dumps(payload, indent=1, ensure_ascii=False) + "\n",
                        content_type="application/json", headers=headers)
