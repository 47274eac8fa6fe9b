"""The sidecar's bounds at work: what it refused or dropped to keep what agents make it hold and
serve within its limits (exporter.agents.screening, the registry's bounds)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from exporter.shared.families import counter, named
from exporter.shared.refusals import Refusals
from exporter.shared.registry import Registry

_ROWS = named("allocwatch_departed_agents_dropped_total", "allocwatch_series_dropped_total",
              "allocwatch_agents_refused_total", "allocwatch_figures_dropped_total")
_REFUSED = named("allocwatch_refused_total")[0]


class BoundsCollector(Collector):
    """allocwatch_departed_agents_dropped_total, allocwatch_series_dropped_total,
    allocwatch_agents_refused_total{reason},
    allocwatch_figures_dropped_total{reason}, allocwatch_refused_total{reason}."""

    def __init__(self, registry: Registry, refusals: Refusals | None = None):
        self._registry = registry
        self._refusals = refusals

    def collect(self) -> Iterator[Metric]:
        counts = self._registry.bound_counters()
        departed, series, refused, figures = (counter(row) for row in _ROWS)
        departed.add_metric([], counts.departed_dropped)
        yield departed
        series.add_metric([], counts.series_dropped)
        yield series
        for reason, count in sorted(counts.refused.items()):
            refused.add_metric([reason], count)
        yield refused
        for reason, count in sorted(counts.figures_dropped.items()):
            figures.add_metric([reason], count)
        yield figures
        if self._refusals is not None:
            refused_clients = counter(_REFUSED)
            for reason, count in self._refusals.counts():
                refused_clients.add_metric([reason], count)
            yield refused_clients
