"""prometheus_client families made from the metric table (allocator_ext.protocol.metrics), so
that each collector takes a metric's name, help and labels from there, and a name missing from
the table fails when the collector's module is imported."""

from __future__ import annotations

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
)
from prometheus_client.metrics_core import Metric as Family

from allocator_ext.protocol.metrics import Metric, metric

_CLASSES = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily, "info": InfoMetricFamily}


def named(*names: str) -> tuple[Metric, ...]:
    """The table's rows for `names` (KeyError naming one that is not there)."""
    return tuple(metric(name) for name in names)


def new_family(row: Metric) -> Family:
    """An empty family for `row`, built afresh on each scrape; its label names are the row's,
    in order (add_metric takes values in that order)."""
    family: Family = _CLASSES[row.type](row.family, row.help, labels=list(row.all_labels))
    return family


def _checked(row: Metric, kind: str) -> Metric:
    if row.type != kind:
        raise TypeError(f"{row.name} is a {row.type} in the metric table, not a {kind}")
    return row


def gauge(row: Metric) -> GaugeMetricFamily:
    return GaugeMetricFamily(_checked(row, "gauge").family, row.help, labels=list(row.all_labels))


def counter(row: Metric) -> CounterMetricFamily:
    return CounterMetricFamily(_checked(row, "counter").family, row.help,
                               labels=list(row.all_labels))


def info(row: Metric) -> InfoMetricFamily:
    return InfoMetricFamily(_checked(row, "info").family, row.help, labels=list(row.all_labels))
