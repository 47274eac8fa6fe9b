"""The sidecar's HTTP endpoint: /metrics, /healthz, /readyz and a landing page.

/metrics uses prometheus_client's own exposition: the format is chosen from the Accept header
(OpenMetrics when asked) and the body is gzip-compressed when the scraper accepts it.
"""

from __future__ import annotations

import gzip
import html
import logging
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from exporter.protocol.version import PACKAGE_VERSION
from exporter.sidecar.registry import Registry

log = logging.getLogger("exporter.http")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class MetricsHttpServer:
    def __init__(
        self,
        address: str,
        port: int,
        metrics_registry: CollectorRegistry,
        agents: Registry,
        is_ready: Callable[[], bool],
        is_healthy: Callable[[], bool],
    ):
        self._metrics_registry = metrics_registry
        self._agents = agents
        self._is_ready = is_ready
        self._is_healthy = is_healthy
        handler = self._make_handler()
        # IPv6 "::" listens on both families where the host allows it; "0.0.0.0" on IPv4 only.
        server_class = _Server6 if ":" in address else _Server
        self._server = server_class((address, port), handler)
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="allocwatch-http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def _make_handler(self) -> type[BaseHTTPRequestHandler]:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            server_version = f"allocwatch/{PACKAGE_VERSION}"

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                path = self.path.split("?", 1)[0]
                try:
                    if path == "/metrics":
                        outer._metrics(self)
                    elif path == "/healthz":
                        ok = outer._is_healthy()
                        self._reply(200 if ok else 503, b"ok\n" if ok else b"unhealthy\n")
                    elif path == "/readyz":
                        ok = outer._is_ready()
                        self._reply(200 if ok else 503, b"ready\n" if ok else b"not ready\n")
                    elif path == "/":
                        self._reply(200, outer._landing_page(), "text/html; charset=utf-8")
                    else:
                        self._reply(404, b"not found: try /metrics, /healthz, /readyz or /\n")
                except BrokenPipeError:
                    pass  # the scraper went away

            def _reply(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8",
                       headers: dict[str, str] | None = None) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                log.debug("http " + format % args)

        return Handler

    def _metrics(self, handler: BaseHTTPRequestHandler) -> None:
        started = time.perf_counter()
        encoder, content_type = choose_encoder(handler.headers.get("Accept", ""))
        try:
            body = encoder(self._metrics_registry)
        except Exception:
            log.exception("building the metrics failed")
            handler._reply(500, b"metrics collection failed\n")  # type: ignore[attr-defined]
            return
        headers = {}
        if "gzip" in handler.headers.get("Accept-Encoding", ""):
            body = gzip.compress(body, compresslevel=1)  # speed over size: scrapes are frequent
            headers["Content-Encoding"] = "gzip"
        handler._reply(200, body, content_type, headers)  # type: ignore[attr-defined]
        log.debug("scrape served", extra={"seconds": round(time.perf_counter() - started, 6)})

    def _landing_page(self) -> bytes:
        rows = []
        for agent in self._agents.agents():
            ident = agent.identity
            devices = ""
            if agent.last_report is not None:
                devices = ", ".join(str(d.cuda_device) for d in agent.last_report.devices)
            cells = [
                agent.key, "connected" if agent.connected else "departed", ident.host,
                str(ident.pid), str(ident.rank) if ident.rank >= 0 else "",
                str(ident.local_rank) if ident.local_rank >= 0 else "", devices,
                ident.gpu_uuid, ident.training_job, ident.pod, ident.backend,
                str(agent.reports_received),
            ]
            rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
        header = "".join(f"<th>{h}</th>" for h in (
            "agent", "state", "host", "pid", "rank", "local rank", "devices", "GPU UUID",
            "training job", "pod", "allocator", "reports"))
        page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>allocwatch sidecar</title></head>
<body><h1>allocwatch sidecar {html.escape(PACKAGE_VERSION)}</h1>
<p><a href="/metrics">/metrics</a> · <a href="/healthz">/healthz</a> ·
<a href="/readyz">/readyz</a></p>
<h2>Agents ({len(rows)})</h2>
<table border="1" cellpadding="4"><tr>{header}</tr>
{"".join(rows) or '<tr><td colspan="12">no agent has connected</td></tr>'}
</table></body></html>
"""
        return page.encode()
