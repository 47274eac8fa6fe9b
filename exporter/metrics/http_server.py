"""The sidecar's HTTP endpoint: /metrics, /healthz, /readyz and a landing page, served on the
sidecar's event loop with every client resource bounded (exporter.shared.bounded_http).
Optionally over HTTPS, and with a bearer token on /metrics and / (as the Prometheus operator's
PodMonitor sends one); the probes' /healthz and /readyz stay open.

/metrics speaks prometheus_client's exposition formats: the format is chosen from the Accept
header (OpenMetrics when asked), written by exporter.metrics.exposition_format, and the body is
gzip-compressed when the scraper accepts it (`gzip_accepted`). Building it is CPU work, so it
runs off the loop, on one worker thread (`Exposition`): a slow scrape can hold neither the
agents' gRPC stream nor another scrape's connection, and concurrent scrapes share a build.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gzip
import html
import logging
import ssl
import threading
import time
from collections.abc import Callable

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import gzip_accepted

from allocator_ext.protocol.version import PACKAGE_VERSION
from exporter.metrics.exposition_format import ExpositionWriter
from exporter.shared.bounded_http import BoundedHttpServer, HttpLimits
from exporter.shared.refusals import Refusals
from exporter.shared.registry import Registry
from exporter.shared.tokens import RotatingToken

log = logging.getLogger("exporter.http")


class Exposition:
    """/metrics bodies, built on one worker thread.

    A scrape joins the build of its format that is queued or running, else queues a new one:
    N scrapers arriving together cost one build and wait for one, not N. A joined body may
    have started building before the request arrived, by less than one build's time: less
    than the age of the agents' figures it shows (a report interval)."""

    def __init__(self, registry: CollectorRegistry):
        self._registry = registry
        self._worker = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="allocwatch-exposition")
        # Reentrant: a build that ends before its done callback is added runs the callback at
        # once, on the thread that holds the lock.
        self._lock = threading.RLock()
        self._building: dict[tuple[str, bool], concurrent.futures.Future[bytes]] = {}

    async def body(self, accept: str, accept_encoding: str) -> tuple[bytes, str, bool]:
        """(body, content type, gzip-compressed)."""
        writer = ExpositionWriter(accept)
        content_type = writer.content_type
        compressed = gzip_accepted(accept_encoding)
        key = (content_type, compressed)
        with self._lock:  # held across submit: the build cannot end before it is listed
            future = self._building.get(key)
            if future is None:
                future = self._worker.submit(self._build, writer, compressed)
                self._building[key] = future
                future.add_done_callback(lambda done: self._built(key, done))
        return await asyncio.wrap_future(future), content_type, compressed

    def _built(self, key: tuple[str, bool], done: concurrent.futures.Future[bytes]) -> None:
        with self._lock:  # finished: scrapes from now on start a fresh build
            if self._building.get(key) is done:
                del self._building[key]

    def _build(self, writer: ExpositionWriter, compressed: bool) -> bytes:
        body = writer(self._registry)
        # Speed over size: scrapes are frequent.
        return gzip.compress(body, compresslevel=1) if compressed else body

    def run(self, work: Callable[[], bytes]) -> asyncio.Future[bytes]:
        """Other CPU work of the endpoint (the landing page), on the same thread."""
        return asyncio.wrap_future(self._worker.submit(work))

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)


class MetricsHttpServer:
    """`tls`: a callable giving the listening context (HTTPS), `token`: the bearer token
    /metrics and / ask for; neither by default."""

    def __init__(
        self,
        address: str,
        port: int,
        metrics_registry: CollectorRegistry,
        agents: Registry,
        is_ready: Callable[[], bool],
        is_healthy: Callable[[], bool],
        limits: HttpLimits | None = None,
        *,
        tls: Callable[[], ssl.SSLContext] | None = None,
        token: RotatingToken | None = None,
        refusals: Refusals | None = None,
        path: str = "/metrics",
    ):
        self._address = address
        self.path = path  # the exposition's (--web.telemetry-path)
        self._requested_port = port
        self._agents = agents
        self._is_ready = is_ready
        self._is_healthy = is_healthy
        self._tls = tls
        self._token = token
        self._refusals = refusals or Refusals()
        self._exposition = Exposition(metrics_registry)
        self.http = BoundedHttpServer("metrics", self._handle, limits or HttpLimits())
        self.port = 0

    @property
    def scheme(self) -> str:
        return "https" if self._tls is not None else "http"

    async def start(self) -> None:
        self.port = await self.http.listen_tcp(
            self._address, self._requested_port, self._tls() if self._tls else None)

    async def stop(self) -> None:
        await self.http.close()
        self._exposition.close()

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.method not in ("GET", "HEAD"):
            return web.Response(status=405, text="only GET and HEAD\n", headers={"Allow": "GET"})
        path = request.path
        if path in (self.path, "/") and self._token is not None and not await \
                self._token.admits(request.headers.get("Authorization")):
            peer = request.transport.get_extra_info("peername") if request.transport else None
            self._refusals.refuse("metrics_token", log, "scrape refused: missing or wrong "
                                  "bearer token", {"peer": str(peer[0]) if peer else "?"})
            return web.Response(status=401, text="missing or wrong bearer token\n",
                                headers={"WWW-Authenticate": 'Bearer realm="allocwatch"'})
        if path == self.path:
            return await self._metrics(request)
        if path == "/healthz":
            ok = self._is_healthy()
            return web.Response(status=200 if ok else 503, text="ok\n" if ok else "unhealthy\n")
        if path == "/readyz":
            ok = self._is_ready()
            return web.Response(status=200 if ok else 503,
                                text="ready\n" if ok else "not ready\n")
        if path == "/":
            page = await self._exposition.run(self._landing_page)
            return web.Response(body=page, content_type="text/html", charset="utf-8")
        return web.Response(status=404,
                            text=f"not found: try {self.path}, /healthz, /readyz or /\n")

    async def _metrics(self, request: web.BaseRequest) -> web.StreamResponse:
        started = time.perf_counter()
        try:
            body, content_type, compressed = await self._exposition.body(
                request.headers.get("Accept", ""), request.headers.get("Accept-Encoding", ""))
        except Exception:
            log.exception("building the metrics failed")
            return web.Response(status=500, text="metrics collection failed\n")
        response = web.Response(body=body, headers={"Content-Type": content_type})
        if compressed:
            response.headers["Content-Encoding"] = "gzip"
        log.debug("scrape served", extra={"seconds": round(time.perf_counter() - started, 6)})
        return response

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
<p><a href="{html.escape(self.path)}">{html.escape(self.path)}</a> ·
<a href="/healthz">/healthz</a> · <a href="/readyz">/readyz</a></p>
<h2>Agents ({len(rows)})</h2>
<table border="1" cellpadding="4"><tr>{header}</tr>
{"".join(rows) or '<tr><td colspan="12">no agent has connected</td></tr>'}
</table></body></html>
"""
        return page.encode()
