"""The admin API's listeners: JSON over HTTP, for `allocwatch ctl`.

Served by the standard library's threading HTTP server (no new dependency; admin traffic is a
few requests, each handled on its own thread).

Where it listens: a Unix socket (mode 0600 by default: file permissions are the access control),
and, only when configured, TCP (loopback unless configured otherwise) where every request must
carry `Authorization: Bearer TOKEN`; the token is compared in constant time and never logged.
With admin.tls_cert_file/tls_key_file the TCP listener speaks HTTPS (exporter.admin.tls).

Every request is logged (endpoint, selectors, peer, status), never its headers.
"""

from __future__ import annotations

import collections
import hmac
import json
import logging
import os
import socket
import socketserver
import stat
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from exporter.admin.config import AdminConfig, read_token
from exporter.admin.service import ENDPOINTS, SELECTOR_FIELDS, AdminError, AdminService, Selector
from exporter.admin.tls import RenewingTlsContext
from exporter.config import ConfigError, shown

log = logging.getLogger("exporter.admin")

MAX_BODY_BYTES = 64 << 10


class _TcpServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    requires_token = True
    tls: RenewingTlsContext | None = None
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
            if self._token is None:  # AdminConfig refuses this; never serve TCP open
                raise ConfigError("admin.tcp_port: a token is required")
            host = config.tcp_address
            server_class = _TcpServer6 if ":" in host else _TcpServer
            tcp = server_class((host, config.tcp_port), handler)
            tcp.tls = (RenewingTlsContext(config.tls_cert_file, config.tls_key_file,
                                          config.tls_client_ca_file)
                       if config.tls_cert_file else None)
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

    def request_counts(self) -> list[tuple[tuple[str, str], int]]:
        """Requests by endpoint and HTTP status, for the collector."""
        with self._lock:
            return sorted(self.requests_total.items())

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
                        raise AdminError(400, f"unknown query field {shown(sorted(unknown)[0])}")
                    selector = Selector.parse(query)
                    fields["selector"] = selector.describe()
                    return 200, admin.service.list_agents(selector)
                if url.path.startswith("/v1/snapshots/") and method == "GET":
                    name = urllib.parse.unquote(url.path[len("/v1/snapshots/"):])
                    fields["snapshot"] = name
                    return 200, admin.service.snapshot_bytes(name)
                if url.path in ENDPOINTS:
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
                except RecursionError:
                    raise AdminError(400, "the body is not JSON this API reads: nested too "
                                          "deeply") from None
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
    return path if path == "/v1/agents" or path in ENDPOINTS else "other"


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
