"""The sidecar's own series: its build, and the reloads of its settings file."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from allocator_ext.protocol.version import PACKAGE_VERSION, PROTOCOL_MAJOR, PROTOCOL_MINOR
from exporter.shared.families import counter, info, named
from exporter.shared.families import gauge as gauge_family
from exporter.sidecar.reload import ConfigWatcher

_BUILD, _RELOADS, _LAST_RELOAD = named("allocwatch_build_info", "allocwatch_config_reloads_total",
                                       "allocwatch_config_last_reload_successful")


class SidecarCollector(Collector):
    """The sidecar itself: its build, and the reloads of its settings file where one is
    watched."""

    def __init__(self, watcher: ConfigWatcher | None):
        self._watcher = watcher

    def collect(self) -> Iterator[Metric]:
        build = info(_BUILD)
        build.add_metric([PACKAGE_VERSION, f"{PROTOCOL_MAJOR}.{PROTOCOL_MINOR}"], {})
        yield build
        if self._watcher is None:
            return
        totals, last_successful = self._watcher.counts()
        family = counter(_RELOADS)
        for result, count in totals:
            family.add_metric([result], count)
        yield family
        gauge = gauge_family(_LAST_RELOAD)
        gauge.add_metric([], 1.0 if last_successful else 0.0)
        yield gauge
