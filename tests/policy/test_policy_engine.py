"""The policy engine's decisions, step by step on a controlled clock: `for`, hysteresis, cooldown,
the hourly cap, dry run, reloads; and the `policy:` section's validation.

No mocks: real engine, real protocol messages; only time is driven by the test.
"""

from __future__ import annotations

import logging

import pytest

from allocator_ext.protocol.proto.allocwatch.v1 import agent_pb2 as pb
from exporter.policy.config import PolicyConfig
from exporter.policy.engine import PolicyEngine, device_figures
from exporter.shared.config import ConfigError
from exporter.shared.registry import AgentState
from exporter.sidecar.config import parse_config

MiB = 1 << 20


class FakeAgent:
    """One agent's state as the registry holds it, with reports the test writes."""

    def __init__(self, key: str = "host/1/rank0/abcd"):
        self.state = AgentState(key=key, identity=pb.Identity(rank=0, host="host"),
                                protocol="1.0", peer="test")
        self.sequence = 0

    def report(self, *, reserved: int, allocated: int, retries: int = 0, at: float = 0.0,
               total: int = 0, used: int = 0, pending_events: int = 0) -> list[AgentState]:
        self.sequence += 1
        report = pb.Report(sequence=self.sequence, timestamp_seconds=at)
        device = report.devices.add(cuda_device=0)
        device.allocator.all.reserved_bytes = reserved
        device.allocator.all.allocated_bytes = allocated
        device.allocator.alloc_retries = retries
        device.allocator.pending_events = pending_events
        if total:
            device.device_memory.total_bytes, device.device_memory.used_bytes = total, used
        self.state.last_report = report
        return [self.state]


def policy(**rule: object) -> PolicyConfig:
    base = {"name": "frag", "metric": "fragmentation_ratio", "above": 0.5, "clear": 0.3,
            "for": 10, "cooldown": 60, "max_actions_per_hour": 3, "action": "reclaim",
            "mode": "all"}
    dry_run = bool(rule.pop("dry_run", False))
    return PolicyConfig.parse({"dry_run": dry_run, "rules": [{**base, **rule}]}, "policy")


def frag(value: float) -> dict[str, int]:
    """Reserved and allocated bytes with the given fragmentation ratio."""
    return {"reserved": 100 * MiB, "allocated": int(100 * MiB * (1 - value))}


def test_for_duration_then_action_then_cooldown() -> None:
    engine, agent = PolicyEngine(policy()), FakeAgent()
    assert engine.evaluate(agent.report(**frag(0.6)), now=0.0) == []      # pending
    assert engine.evaluate(agent.report(**frag(0.6)), now=9.9) == []      # not long enough
    (decision,) = engine.evaluate(agent.report(**frag(0.6)), now=10.0)
    assert decision.rule.name == "frag" and decision.cuda_device == 0
    assert decision.command.reclaim.mode == pb.Reclaim.EMPTY_CACHE
    engine.finished(decision, "ok")
    # Still firing, but in cooldown: nothing until 60 s after the action.
    assert engine.evaluate(agent.report(**frag(0.6)), now=30.0) == []
    assert engine.suppressed_total[("frag", "cooldown")] == 1
    assert engine.evaluate(agent.report(**frag(0.6)), now=69.0) == []
    assert engine.suppressed_total[("frag", "cooldown")] == 1  # counted once per episode
    assert len(engine.evaluate(agent.report(**frag(0.6)), now=70.0)) == 1
    assert engine.firing() == {"frag": 1}


def test_a_dip_shorter_than_for_restarts_the_clock() -> None:
    engine, agent = PolicyEngine(policy(clear=0.5)), FakeAgent()
    engine.evaluate(agent.report(**frag(0.6)), now=0.0)
    engine.evaluate(agent.report(**frag(0.4)), now=5.0)   # cleared (clear == fire level)
    assert engine.evaluate(agent.report(**frag(0.6)), now=10.0) == []  # pending again from 10
    assert engine.evaluate(agent.report(**frag(0.6)), now=19.0) == []
    assert len(engine.evaluate(agent.report(**frag(0.6)), now=20.0)) == 1


def test_hysteresis_holds_between_the_levels() -> None:
    engine, agent = PolicyEngine(policy(cooldown=0)), FakeAgent()
    engine.evaluate(agent.report(**frag(0.6)), now=0.0)
    # 0.4 is below the fire level but above the clear level: the rule stays active.
    (first,) = engine.evaluate(agent.report(**frag(0.4)), now=10.0)
    engine.finished(first, "ok")
    engine.finished(engine.evaluate(agent.report(**frag(0.4)), now=11.0)[0], "ok")
    assert engine.firing() == {"frag": 1}
    assert engine.evaluate(agent.report(**frag(0.2)), now=12.0) == []  # below clear: reset
    assert engine.firing() == {}
    assert engine.evaluate(agent.report(**frag(0.4)), now=13.0) == []  # not above fire: stays ok
    assert engine.evaluate(agent.report(**frag(0.4)), now=40.0) == []


def test_the_hourly_cap_stops_a_storm() -> None:
    engine, agent = PolicyEngine(policy(cooldown=0, **{"for": 0})), FakeAgent()
    acted = []
    for second in range(0, 600):  # a figure stuck high, a report every second for 10 minutes
        for decision in engine.evaluate(agent.report(**frag(0.9)), now=float(second)):
            acted.append(second)
            engine.finished(decision, "ok")
    assert acted == [0, 1, 2]
    assert engine.suppressed_total[("frag", "max_actions_per_hour")] == 1
    # An hour after the first action, one more is allowed.
    assert len(engine.evaluate(agent.report(**frag(0.9)), now=3600.0)) == 1
    assert engine.actions_total[("frag", "reclaim", "ok")] == 3


def test_one_command_in_flight_per_agent() -> None:
    engine, agent = PolicyEngine(policy(cooldown=0, **{"for": 0})), FakeAgent()
    (decision,) = engine.evaluate(agent.report(**frag(0.9)), now=0.0)
    assert engine.evaluate(agent.report(**frag(0.9)), now=1.0) == []  # previous not answered
    engine.finished(decision, "timeout")
    assert len(engine.evaluate(agent.report(**frag(0.9)), now=2.0)) == 1


def test_only_new_reports_are_evaluated() -> None:
    engine, agent = PolicyEngine(policy(**{"for": 0}, cooldown=0)), FakeAgent()
    agents = agent.report(**frag(0.9))
    assert len(engine.evaluate(agents, now=0.0)) == 1
    assert engine.evaluate(agents, now=100.0) == []  # the same report again: no new decision


def test_dry_run_decides_the_same_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    engine, agent = PolicyEngine(policy(dry_run=True, **{"for": 0})), FakeAgent()
    with caplog.at_level(logging.INFO, logger="exporter.policy"):
        (decision,) = engine.evaluate(agent.report(**frag(0.9)), now=0.0)
    assert decision.dry_run
    entry = next(r for r in caplog.records if r.getMessage() == "policy action")
    assert entry.decision == "dry_run" and entry.rule == "frag"  # type: ignore[attr-defined]
    assert entry.value == pytest.approx(0.9, abs=0.01)  # type: ignore[attr-defined]


def test_reload_keeps_the_hourly_history() -> None:
    engine, agent = PolicyEngine(policy(cooldown=0, **{"for": 0})), FakeAgent()
    for t in range(3):
        engine.finished(engine.evaluate(agent.report(**frag(0.9)), now=float(t))[0], "ok")
    # A changed definition of the same rule: its state restarts, its action history does not.
    engine.reconfigure(policy(cooldown=0, **{"for": 0}, above=0.8))
    assert engine.evaluate(agent.report(**frag(0.9)), now=10.0) == []
    assert engine.suppressed_total[("frag", "max_actions_per_hour")] == 1


def test_below_rules_and_figures_from_nvml_and_retries() -> None:
    engine = PolicyEngine(PolicyConfig.parse({"rules": [
        {"name": "low-free", "metric": "nvml_free_ratio", "below": 0.1, "clear": 0.2,
         "action": "set_config", "settings": "garbage_collection_threshold:0.6"},
        {"name": "retrying", "metric": "retry_rate", "above": 1.0, "action": "reclaim"}]},
        "policy"))
    agent = FakeAgent()
    (low,) = engine.evaluate(agent.report(reserved=80, allocated=70, total=1000, used=950,
                                          retries=0, at=100.0), now=0.0)
    assert low.rule.name == "low-free" and low.command.set_config.settings == \
        "garbage_collection_threshold:0.6"
    engine.finished(low, "ok")
    # 30 retries in 10 s: 3/s, above 1/s.
    decisions = engine.evaluate(agent.report(reserved=80, allocated=70, total=1000, used=950,
                                             retries=30, at=110.0), now=1.0)
    assert [d.rule.name for d in decisions] == ["retrying"]
    assert decisions[0].command.reclaim.mode == pb.Reclaim.GARBAGE_COLLECT


def test_device_figures() -> None:
    device = pb.DeviceReport(cuda_device=1)
    device.allocator.all.reserved_bytes, device.allocator.all.allocated_bytes = 400, 100
    device.allocator.alloc_retries = 7
    figures = device_figures(device, 10.0, (8.0, 3))
    assert figures["fragmentation_ratio"] == 0.75 and figures["retry_rate"] == 2.0
    assert "reserved_share" not in figures  # no NVML, no share
    device.device_memory.total_bytes, device.device_memory.used_bytes = 1000, 600
    figures = device_figures(device, 10.0, None)
    assert figures["reserved_share"] == 0.4 and figures["nvml_free_bytes"] == 400
    assert "retry_rate" not in figures


@pytest.mark.parametrize("rule, message", [
    ({"metric": "fragmentation_ratio", "above": 0.5}, "policy.rules[0].name: expected a string"),
    ({"name": "x", "metric": "frag", "above": 0.5}, "policy.rules[0].metric: must be one of"),
    ({"name": "x", "metric": "pending_events"}, "give exactly one of above"),
    ({"name": "x", "metric": "pending_events", "above": 5, "clear": 9},
     "policy.rules[0].clear: must be at or below the fire level 5"),
    ({"name": "x", "metric": "pending_events", "above": 5, "for": "soon"},
     "policy.rules[0].for: expected a duration"),
    ({"name": "x", "metric": "pending_events", "above": 5, "action": "reboot"},
     "policy.rules[0].action: must be one of reclaim, set_config"),
    ({"name": "x", "metric": "pending_events", "above": 5, "action": "set_config"},
     "policy.rules[0].settings: required"),
    ({"name": "x", "metric": "pending_events", "above": 5, "action": "set_config",
      "settings": "garbage_collection_threshold:7"},
     "policy.rules[0].settings: invalid allocator setting garbage_collection_threshold"),
    ({"name": "x", "metric": "pending_events", "above": 5, "max_actions_per_hour": 0},
     "policy.rules[0].max_actions_per_hour"),
    ({"name": "x", "metric": "pending_events", "above": 5, "mode": "some"},
     "policy.rules[0].mode: must be one of gc, all"),
    ({"name": "x", "metric": "pending_events", "above": 5, "typo": 1},
     "policy.rules[0].typo: unknown setting"),
])
def test_bad_rules_are_refused_naming_the_field(rule: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"policy": {"rules": [rule]}})
    assert message in str(err.value)


def test_policy_section_values() -> None:
    config = parse_config({"policy": {"dry_run": True, "interval": "500ms",
                                      "initial_settings": "expandable_segments:True",
                                      "rules": [{"name": "p", "metric": "pending_events",
                                                 "above": 50, "for": "2m", "cooldown": "1h"}]}})
    section = config.policy
    assert section.dry_run and section.interval_seconds == 0.5
    (rule,) = section.rules
    assert (rule.for_seconds, rule.cooldown_seconds, rule.clear) == (120.0, 3600.0, 50.0)
    with pytest.raises(ConfigError, match="policy.initial_settings: invalid allocator setting"):
        parse_config({"policy": {"initial_settings": "expandable_segments:maybe"}})
    with pytest.raises(ConfigError, match="'p' is used twice"):
        parse_config({"policy": {"rules": [{"name": "p", "metric": "pending_events", "above": 1},
                                           {"name": "p", "metric": "pending_events",
                                            "above": 2}]}})
