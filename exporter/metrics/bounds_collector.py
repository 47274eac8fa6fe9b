"""The sidecar's bounds at work: what it refused or dropped to keep what agents make it hold and
serve within its limits (exporter.agents.screening, the registry's bounds)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from exporter.shared.registry import Registry


class BoundsCollector(Collector):
    """allocwatch_departed_agents_dropped_total, allocwatch_series_dropped_total,
    allocwatch_agents_refused_total{reason},
    allocwatch_figures_dropped_total{reason}."""

    def __init__(self, registry: Registry):
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        counts = self._registry.bound_counters()
        departed = CounterMetricFamily(
            "allocwatch_departed_agents_dropped",
            "Departed agents forgotten before their expiry, oldest first, to keep within "
            "agents.max_departed_agents")
        departed.add_metric([], counts.departed_dropped)
        yield departed
        series = CounterMetricFamily(
            "allocwatch_series_dropped",
            "Series left out of /metrics to keep within agents.max_series: departed agents' "
            "(oldest first), then the devices of a report that did not fit")
        series.add_metric([], counts.series_dropped)
        yield series
        refused = CounterMetricFamily("allocwatch_agents_refused",
                                      "Agents' hellos refused, by reason", labels=["reason"])
        for reason, count in sorted(counts.refused.items()):
            refused.add_metric([reason], count)
        yield refused
        figures = CounterMetricFamily(
            "allocwatch_figures_dropped",
            "Figures from agents never exported, by reason (non_finite, out_of_range, "
            "inconsistent): the device entry holding one is left out of the report kept",
            labels=["reason"])
        for reason, count in sorted(counts.figures_dropped.items()):
            figures.add_metric([reason], count)
        yield figures
