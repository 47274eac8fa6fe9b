"""The policy engine's Prometheus families, built fresh on each scrape."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from exporter.policy.engine import PolicyEngine


class PolicyCollector(Collector):
    """allocwatch_policy_actions_total, allocwatch_policy_suppressed_total and
    allocwatch_policy_rule_firing."""

    def __init__(self, engine: PolicyEngine):
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        actions, suppressed = self._engine.counts()
        family = CounterMetricFamily(
            "allocwatch_policy_actions", "Actions decided by the policy engine, by result "
            "(dry_run: decided, not sent)", labels=["rule", "action", "result"])
        for labels, count in actions:
            family.add_metric(list(labels), count)
        yield family
        family = CounterMetricFamily(
            "allocwatch_policy_suppressed", "Actions a firing rule did not take, by reason",
            labels=["rule", "reason"])
        for reasons, count in suppressed:
            family.add_metric(list(reasons), count)
        yield family
        gauge = GaugeMetricFamily("allocwatch_policy_rule_firing",
                                  "Agent devices on which the rule is firing", labels=["rule"])
        firing = self._engine.firing()
        for rule in self._engine.config.rules:
            gauge.add_metric([rule.name], firing.get(rule.name, 0))
        yield gauge
