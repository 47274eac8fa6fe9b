"""Scrapers that ask for /metrics and never read it: each answer is written a chunk at a time as
the client takes it, the bodies held by answers being written stay within
`metrics.limits.max_pending_body_bytes` (the client stalled longest is cut first), and past the
connection limit such a client gives its place to a newcomer. The sidecar's memory stays flat
and scrapes pass meanwhile."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from support.sidecar import scrape, sidecar_config, values

from exporter.shared.bounded_http import HttpLimits
from exporter.sidecar.app import SidecarThread

pytestmark = pytest.mark.timeout(120)
BODY_BYTES = 4 << 20
READERS = 60


class Padding(Collector):
    """A /metrics body of BODY_BYTES (as a sidecar with many agents serves one)."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("test_padding", "a large body", labels=["pad"])
        family.add_metric(["x" * BODY_BYTES], 1.0)
        yield family


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture
def running(tmp_path: Path) -> Iterator[SidecarThread]:
    config = sidecar_config(tmp_path, nvml=False)
    limits = HttpLimits(max_body_bytes=0, max_connections=32, request_timeout_seconds=60,
                        max_pending_body_bytes=16 << 20)
    config = dataclasses.replace(config, metrics=dataclasses.replace(config.metrics,
                                                                     limits=limits))
    sidecar = SidecarThread(config).start()
    sidecar.sidecar.metrics_registry.register(Padding())
    try:
        yield sidecar
    finally:
        sidecar.stop()


def _reader_that_stops(port: int) -> socket.socket:
    """A connection that asks for /metrics, reads the first bytes of the answer (the build is
    done) and then nothing more."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(10)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: allocwatch\r\n\r\n")
    assert sock.recv(1024).startswith(b"HTTP/1.1 200")
    return sock


def test_scrapers_that_never_read_pin_neither_bodies_nor_places(running: SidecarThread) -> None:
    url = running.sidecar.metrics_url
    port = int(url.rsplit(":", 1)[1])
    scrape(url, timeout=10)  # the first build's one-off costs
    gc.collect()
    before = _rss_bytes()
    most = before
    with contextlib.ExitStack() as stack:
        for _ in range(READERS):  # one after another: each pins a body of its own
            stack.enter_context(_reader_that_stops(port))
            most = max(most, _rss_bytes())
        started = time.monotonic()
        text, _ = scrape(url, timeout=10)  # past the connection limit: a stalled one goes
        assert len(text) > BODY_BYTES and time.monotonic() - started < 5
        most = max(most, _rss_bytes())
    # Before, each reader pinned its whole body: READERS x 4 MiB.
    assert most - before < 64 << 20, f"RSS grew by {(most - before) >> 20} MiB"
    cut = values(url, "allocwatch_http_connections_closed_total", server="metrics",
                 reason="slow_reader")
    assert cut and cut[0] >= READERS - 32
    assert not values(url, "allocwatch_http_connections_closed_total", server="metrics",
                      reason="all_busy")
