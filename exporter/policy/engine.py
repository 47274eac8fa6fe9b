"""The policy engine: rules over each agent's figures decide reclaims and settings changes.

Synchronous, no I/O, a clock passed in: per (rule, agent, CUDA device) a small state machine —
ok → pending (fire level crossed) → firing (held for `for`) → ok (back past the clear level:
hysteresis). A firing rule acts, then waits out its cooldown, and never acts more than
max_actions_per_hour times in any hour. Every transition and decision is logged. The engine only
decides; exporter.policy.runner sends what it decided.

Counted in allocwatch_policy_actions_total{rule, action, result} (result: ok, invalid_argument,
unsupported, failed, timeout, disconnected, dry_run) and
allocwatch_policy_suppressed_total{rule, reason} (cooldown, max_actions_per_hour).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from typing import Any

from allocator_ext.protocol.proto.allocwatch.v1 import agent_pb2 as pb
from exporter.policy.config import PolicyConfig, Rule
from exporter.shared.figures import device_peak_fragmentation_ratio, fragmentation_ratio
from exporter.shared.registry import AgentState

log = logging.getLogger("exporter.policy")

HOUR = 3600.0


def device_figures(device: pb.DeviceReport, timestamp: float,
                   previous: tuple[float, int] | None) -> dict[str, float]:
    """What a rule can watch, from one device's report. `previous` is (timestamp, retries) of
    the device's preceding report (for the retry rate). Figures that need NVML are absent
    without it."""
    stats = device.allocator
    reserved, allocated = stats.all.reserved_bytes, stats.all.allocated_bytes
    figures = {
        "fragmentation_ratio": fragmentation_ratio(reserved, allocated),
        "peak_fragmentation_ratio": device_peak_fragmentation_ratio(device),
        "reserved_bytes": float(reserved),
        "pending_events": float(stats.pending_events),
    }
    if previous is not None and timestamp > previous[0]:
        retries = max(0, stats.alloc_retries - previous[1])  # 0 after an agent restart
        figures["retry_rate"] = retries / (timestamp - previous[0])
    if device.HasField("device_memory") and device.device_memory.total_bytes > 0:
        total = device.device_memory.total_bytes
        free = max(0, total - device.device_memory.used_bytes)
        figures["reserved_share"] = reserved / total
        figures["nvml_free_bytes"] = float(free)
        figures["nvml_free_ratio"] = free / total
    return figures


def command_for(rule: Rule, cuda_device: int) -> pb.Command:
    if rule.action == "set_config":
        return pb.Command(cuda_device=-1, set_config=pb.SetConfig(settings=rule.settings))
    mode = pb.Reclaim.EMPTY_CACHE if rule.mode == "all" else pb.Reclaim.GARBAGE_COLLECT
    return pb.Command(cuda_device=cuda_device, reclaim=pb.Reclaim(mode=mode))


@dataclasses.dataclass
class _RuleState:
    phase: str = "ok"                 # ok | pending | firing
    since: float = 0.0                # when the fire level was crossed
    last_action: float | None = None
    suppressed: str | None = None     # the suppression already logged, to log it once


@dataclasses.dataclass(frozen=True)
class Decision:
    rule: Rule
    agent_key: str
    cuda_device: int
    value: float
    dry_run: bool

    @property
    def command(self) -> pb.Command:
        return command_for(self.rule, self.cuda_device)


class PolicyEngine:
    """Decides; never sends. Thread-safe counters for the collector."""

    def __init__(self, config: PolicyConfig):
        self.config = config
        self._states: dict[tuple[str, str, int], _RuleState] = {}
        # Action times per (rule name, agent, device): kept across reloads, so that reloading
        # the file cannot reset the hourly cap.
        self._history: dict[tuple[str, str, int], collections.deque[float]] = {}
        self._seen_sequence: dict[str, int] = {}
        self._previous: dict[tuple[str, int], tuple[float, int]] = {}
        self._in_flight: set[str] = set()
        self._firing: dict[str, int] = {}
        self._lock = threading.Lock()
        self.actions_total: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self.suppressed_total: collections.Counter[tuple[str, str]] = collections.Counter()

    def reconfigure(self, config: PolicyConfig) -> None:
        """Take new rules; a rule whose definition changed starts again from `ok`."""
        old = {r.name: r for r in self.config.rules}
        kept = {r.name for r in config.rules if old.get(r.name) == r}
        self._states = {k: s for k, s in self._states.items() if k[0] in kept}
        self.config = config

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, agents: list[AgentState], now: float) -> list[Decision]:
        """Decisions for the reports that arrived since the last call (`now`: monotonic)."""
        decisions: list[Decision] = []
        present = set()
        for agent in agents:
            present.add(agent.key)
            report = agent.last_report
            if not agent.connected or report is None:
                continue
            if self._seen_sequence.get(agent.key) == report.sequence:
                continue  # nothing new from this agent
            self._seen_sequence[agent.key] = report.sequence
            for device in report.devices:
                previous = self._previous.get((agent.key, device.cuda_device))
                figures = device_figures(device, report.timestamp_seconds, previous)
                self._previous[(agent.key, device.cuda_device)] = (
                    report.timestamp_seconds, device.allocator.alloc_retries)
                for rule in self.config.rules:
                    value = figures.get(rule.metric)
                    if value is None:
                        continue
                    decision = self._step(rule, agent.key, device.cuda_device, value, now)
                    if decision is not None:
                        decisions.append(decision)
        self._forget_departed(present)
        firing: collections.Counter[str] = collections.Counter(
            rule for (rule, _, _), state in self._states.items() if state.phase == "firing")
        self._firing = dict(firing)  # one reference swap: the collector reads it from a thread
        return decisions

    def _step(self, rule: Rule, agent: str, device: int, value: float,
              now: float) -> Decision | None:
        key = (rule.name, agent, device)
        state = self._states.setdefault(key, _RuleState())
        fields = {"rule": rule.name, "agent": agent, "cuda_device": device,
                  "metric": rule.metric, "value": value}
        if state.phase != "ok" and rule.cleared(value):
            log.info("policy rule cleared", extra={**fields, "decision": "cleared",
                                                   "was": state.phase})
            state.phase, state.suppressed = "ok", None
            return None
        if state.phase == "ok":
            if not rule.breached(value):
                return None
            state.phase, state.since = "pending", now
            log.info("policy rule pending", extra={**fields, "decision": "pending",
                                                   "for_seconds": rule.for_seconds})
        if state.phase == "pending":
            if now - state.since < rule.for_seconds:
                return None
            state.phase = "firing"
            log.info("policy rule firing", extra={**fields, "decision": "firing"})
        if agent in self._in_flight:
            return None  # one policy command at a time per agent
        if state.last_action is not None and now - state.last_action < rule.cooldown_seconds:
            self._suppress(state, rule, "cooldown", fields)
            return None
        history = self._history.setdefault(key, collections.deque())
        while history and now - history[0] >= HOUR:
            history.popleft()
        if len(history) >= rule.max_actions_per_hour:
            self._suppress(state, rule, "max_actions_per_hour", fields)
            return None
        history.append(now)
        state.last_action, state.suppressed = now, None
        dry_run = self.config.dry_run
        if not dry_run:
            self._in_flight.add(agent)
        log.info("policy action", extra={
            **fields, "decision": "dry_run" if dry_run else "act", "action": rule.action,
            "mode": rule.mode if rule.action == "reclaim" else None,
            "settings": rule.settings or None, "actions_last_hour": len(history)})
        return Decision(rule, agent, device, value, dry_run)

    def _suppress(self, state: _RuleState, rule: Rule, reason: str,
                  fields: dict[str, Any]) -> None:
        if state.suppressed == reason:
            return  # logged and counted once per episode, not once per evaluation
        state.suppressed = reason
        with self._lock:
            self.suppressed_total[(rule.name, reason)] += 1
        log.info("policy action suppressed", extra={**fields, "decision": "suppressed",
                                                    "reason": reason, "action": rule.action})

    def _forget_departed(self, present: set[str]) -> None:
        for agent in [a for a in self._seen_sequence if a not in present]:
            del self._seen_sequence[agent]
            self._states = {k: s for k, s in self._states.items() if k[1] != agent}
            self._history = {k: h for k, h in self._history.items() if k[1] != agent}
            self._previous = {k: p for k, p in self._previous.items() if k[0] != agent}

    # ------------------------------------------------------------------ outcomes and metrics

    def finished(self, decision: Decision, result: str) -> None:
        self._in_flight.discard(decision.agent_key)
        self.count(decision.rule.name, decision.rule.action, result)

    def count(self, rule: str, action: str, result: str) -> None:
        with self._lock:
            self.actions_total[(rule, action, result)] += 1

    def firing(self) -> dict[str, int]:
        """Agent devices on which each rule was firing at the last evaluation."""
        return self._firing

    def counts(self) -> tuple[list[tuple[tuple[str, str, str], int]],
                              list[tuple[tuple[str, str], int]]]:
        """(actions by rule, action and result; suppressions by rule and reason), for the
        collector."""
        with self._lock:
            return sorted(self.actions_total.items()), sorted(self.suppressed_total.items())
