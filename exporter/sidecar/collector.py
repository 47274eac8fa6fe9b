"""The sidecar's own series: its build, and the reloads of its settings file."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from allocator_ext.protocol.version import PACKAGE_VERSION, PROTOCOL_MAJOR, PROTOCOL_MINOR
from exporter.sidecar.reload import ConfigWatcher


class SidecarCollector(Collector):
    """The sidecar itself: its build, and the reloads of its settings file where one is
    watched."""

    def __init__(self, watcher: ConfigWatcher | None):
        self._watcher = watcher

    def collect(self) -> Iterator[Metric]:
        build = InfoMetricFamily("allocwatch_build", "The sidecar's version",
                                 labels=["version", "protocol"])
        build.add_metric([PACKAGE_VERSION, f"{PROTOCOL_MAJOR}.{PROTOCOL_MINOR}"], {})
        yield build
        if self._watcher is None:
            return
        totals, last_successful = self._watcher.counts()
        family = CounterMetricFamily(
            "allocwatch_config_reloads", "Settings file changes seen, by result (ok, partial: "
            "some fields need a restart, invalid: refused, unreadable)", labels=["result"])
        for result, count in totals:
            family.add_metric([result], count)
        yield family
        gauge = GaugeMetricFamily("allocwatch_config_last_reload_successful",
                                  "1 when the last settings file seen was accepted")
        gauge.add_metric([], 1.0 if last_successful else 0.0)
        yield gauge
