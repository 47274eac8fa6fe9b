"""The policy engine's Prometheus families, built fresh on each scrape."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from exporter.policy.engine import PolicyEngine
from exporter.shared.families import counter, gauge, named

_ACTIONS, _SUPPRESSED, _FIRING = named("allocwatch_policy_actions_total",
                                       "allocwatch_policy_suppressed_total",
                                       "allocwatch_policy_rule_firing")


class PolicyCollector(Collector):
    """allocwatch_policy_actions_total, allocwatch_policy_suppressed_total and
    allocwatch_policy_rule_firing."""

    def __init__(self, engine: PolicyEngine):
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        actions, suppressed = self._engine.counts()
        family = counter(_ACTIONS)
        for labels, count in actions:
            family.add_metric(list(labels), count)
        yield family
        family = counter(_SUPPRESSED)
        for reasons, count in suppressed:
            family.add_metric(list(reasons), count)
        yield family
        firing_family = gauge(_FIRING)
        firing = self._engine.firing()
        for rule in self._engine.config.rules:
            firing_family.add_metric([rule.name], firing.get(rule.name, 0))
        yield firing_family
