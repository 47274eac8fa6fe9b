"""The sidecar's HTTP endpoint: /metrics, /healthz, /readyz and a landing page, served on the
sidecar's event loop with every client resource bounded (exporter.shared.bounded_http).
Optionally over HTTPS, and with a bearer token on /metrics and / (as the Prometheus operator's
PodMonitor sends one); the probes' /healthz and /readyz stay open.

/metrics speaks prometheus_client's exposition formats: the format is chosen from the Accept
header (OpenMetrics when asked), written by exporter.metrics.exposition_format, and the body is
gzip-compressed when the scraper accepts it (`gzip_accepted`). Building it is CPU work, so it
runs off the loop, on one worker thread (`Exposition`): a slow scrape can hold neither the
agents' gRPC stream nor another scrape's connection; concurrent scrapes share a build, and a
crowd of scrapes costs at most a few builds a second. While a build runs, the listeners sharing
the `Precedence` leave new connections queued (exporter.shared.precedence).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gzip
import html
import logging
import math
import ssl
import time
from collections.abc import Callable

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import gzip_accepted

from allocator_ext.protocol.version import PACKAGE_VERSION
from exporter.metrics.exposition_format import ExpositionWriter
from exporter.shared.bounded_http import BoundedHttpServer, HttpLimits
from exporter.shared.precedence import Precedence
from exporter.shared.refusals import Refusals
from exporter.shared.registry import Registry
from exporter.shared.tokens import RotatingToken

log = logging.getLogger("exporter.http")

# Builds of one kind of body start at least this far apart (Exposition).
BUILD_INTERVAL_SECONDS = 0.25


class Exposition:
    """/metrics bodies, built on one worker thread; builds of one kind (the bytes' format and
    compression) start at least `interval` seconds apart.

    A scrape joins the build of its kind that is waiting for its start or running, else asks
    for a new one, which starts at once, or `interval` after the last build of its kind
    started. Scrapers arriving together cost one build and wait for one; a crowd of scrapes
    (clients asking over and over, or never reading what they asked for) costs at most one
    build of each kind an `interval`, however many they are, so that the worker, and with it
    the interpreter's lock, stays free for the agents' streams and the next scrape. A body's
    figures are read after its scrape arrived, but where it joined a build already running
    (by less than one build's time: less than the age of the agents' figures it shows, a
    report interval). A scrape waits for its start at most `interval`, and only where another
    of its kind came less than `interval` before it (Prometheus scrapes a target every few
    seconds at the most)."""

    def __init__(self, registry: CollectorRegistry,
                 interval: float = BUILD_INTERVAL_SECONDS):
        self._registry = registry
        self._interval = interval
        self._worker = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="allocwatch-exposition")
        # Per kind (a few: ExpositionWriter.kind), on the event loop only: the build waiting or
        # running, and when the latest build started (on the loop's clock).
        self._building: dict[tuple[object, ...], asyncio.Task[bytes]] = {}
        self._started: dict[tuple[object, ...], float] = {}

    async def body(self, accept: str, accept_encoding: str) -> tuple[bytes, str, bool]:
        """(body, content type, gzip-compressed)."""
        writer = ExpositionWriter(accept)
        compressed = gzip_accepted(accept_encoding)
        key = (*writer.kind, compressed)
        build = self._building.get(key)
        if build is None or build.done():  # (done: ended, its callback not yet run)
            loop = asyncio.get_running_loop()
            start = max(loop.time(), self._started.get(key, -math.inf) + self._interval)
            self._started[key] = start
            build = self._building[key] = loop.create_task(
                self._build_at(start, writer, compressed))
            build.add_done_callback(lambda done: self._built(key, done))
        # Shielded: a scraper that goes away ends its own wait, not the build of the others.
        return await asyncio.shield(build), writer.content_type, compressed

    async def _build_at(self, start: float, writer: ExpositionWriter, compressed: bool
                        ) -> bytes:
        wait = start - asyncio.get_running_loop().time()
        if wait > 0:
            await asyncio.sleep(wait)
        return await asyncio.wrap_future(self._worker.submit(self._build, writer, compressed))

    def _built(self, key: tuple[object, ...], done: asyncio.Task[bytes]) -> None:
        if self._building.get(key) is done:
            del self._building[key]  # scrapes from now on ask for a new build
        if not done.cancelled():
            done.exception()  # seen by its scrapes, if any are left; else it is not news

    def _build(self, writer: ExpositionWriter, compressed: bool) -> bytes:
        body = writer(self._registry)
        # Speed over size: scrapes are frequent.
        return gzip.compress(body, compresslevel=1) if compressed else body

    def run(self, work: Callable[[], bytes]) -> asyncio.Future[bytes]:
        """Other CPU work of the endpoint (the landing page), on the same thread."""
        return asyncio.wrap_future(self._worker.submit(work))

    def close(self) -> None:
        for build in self._building.values():
            build.cancel()
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
        precedence: Precedence | None = None,
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
        # Marks each build; the listeners sharing it leave newcomers queued meanwhile.
        self._precedence = precedence or Precedence()
        self.http = BoundedHttpServer("metrics", self._handle, limits or HttpLimits(),
                                      self._precedence)
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
            with self._precedence.scrape():
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
