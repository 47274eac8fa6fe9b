"""The admin API's Prometheus families, built fresh on each scrape."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from exporter.admin.http_server import AdminHttpServer
from exporter.shared.families import counter, named

(_REQUESTS,) = named("allocwatch_admin_requests_total")


class AdminCollector(Collector):
    """allocwatch_admin_requests_total{endpoint, code}."""

    def __init__(self, server: AdminHttpServer):
        self._server = server

    def collect(self) -> Iterator[Metric]:
        family = counter(_REQUESTS)
        for labels, count in self._server.request_counts():
            family.add_metric(list(labels), count)
        yield family
