"""The policy engine end to end: real sidecar, real agent, our allocator core on the simulated
device. A fragmenting workload makes a rule fire, the reclaim reaches the agent, and reserved
bytes measured in the same run fall; dry run changes nothing; cooldown and the hourly cap bound
the commands that reach an agent; initial settings reach every agent that connects."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
from support.control import connect_agent, metric, start_control_sidecar
from support.sidecar import FakeSource, MiB, values
from support.waiting import wait_for

ae = pytest.importorskip("allocator_ext._core", reason="the allocator core is not built")

pytestmark = pytest.mark.timeout(60)

FRAGMENTED_RULE = {"name": "fragmented", "metric": "fragmentation_ratio", "above": 0.5,
                   "clear": 0.2, "for": 0.3, "cooldown": 60, "max_actions_per_hour": 2,
                   "action": "reclaim", "mode": "all"}


def fragment(allocator) -> tuple[list[int], int]:
    """Eight 40 MiB blocks, six freed: 320 MiB reserved for 80 MiB in use (ratio 0.75)."""
    blocks = [allocator.malloc(40 * MiB) for _ in range(8)]
    for block in blocks[2:]:
        allocator.free(block)
    stats = allocator.stats()
    assert stats["reserved_bytes.all.current"] == 320 * MiB
    return blocks[:2], stats["reserved_bytes.all.current"]


def test_fragmenting_workload_fires_a_reclaim_and_reserved_falls(tmp_path: Path) -> None:
    running = start_control_sidecar(tmp_path, policy={"interval": 0.05,
                                                      "rules": [FRAGMENTED_RULE]})
    allocator = ae.Allocator(ae.SimDevice(capacity=0), "native")
    agent = connect_agent(running, tmp_path, {0: allocator})
    try:
        url = running.sidecar.metrics_url
        # Before the fragmentation: the agent may sample it (and the rule's `for` begin) as
        # soon as it happens, before any line after it runs.
        started = time.monotonic()
        kept, reserved_before = fragment(allocator)
        wait_for(lambda: values(url, "torch_cuda_allocator_reserved_bytes") == [
            float(reserved_before)], what="the fragmented figures on /metrics")
        # The reclaim reaches the agent: reserved falls to what is in use, in this same run.
        wait_for(lambda: allocator.stats()["reserved_bytes.all.current"] == 80 * MiB,
                 timeout=10, what="the policy's reclaim")
        assert time.monotonic() - started >= 0.3  # not before the rule's `for`
        stats = allocator.stats()
        assert stats["num_empty_cache_calls"] == 1  # mode all: empty_cache, once
        wait_for(lambda: values(url, "torch_cuda_allocator_reserved_bytes") == [80.0 * MiB],
                 what="reserved to fall on /metrics")
        wait_for(lambda: metric(running, "allocwatch_policy_actions_total", rule="fragmented",
                                action="reclaim", result="ok") == 1.0, what="the action counted")
        assert metric(running, "allocwatch_commands_total", command="reclaim", result="ok") == 1.0
        # Fragmentation is gone: the rule cleared and does not act again.
        time.sleep(0.5)
        assert allocator.stats()["num_empty_cache_calls"] == 1
        for block in kept:
            allocator.free(block)
    finally:
        agent.stop()
        running.stop()


def test_gc_mode_reclaims_down_to_the_threshold(tmp_path: Path) -> None:
    rule = {**FRAGMENTED_RULE, "mode": "gc", "for": 0}
    running = start_control_sidecar(tmp_path, policy={"interval": 0.05, "rules": [rule]})
    allocator = ae.Allocator(ae.SimDevice(capacity=1 << 30),
                             "native,garbage_collection_threshold:0.2")
    allocator.set_memory_fraction(1.0)  # PyTorch's rule: GC acts only with a fraction set
    agent = connect_agent(running, tmp_path, {0: allocator})
    try:
        _, reserved_before = fragment(allocator)
        wait_for(lambda: allocator.stats()["reserved_bytes.all.current"] < reserved_before,
                 what="the policy's garbage collection")
        stats = allocator.stats()
        assert stats["num_empty_cache_calls"] == 0 and stats["num_gc_reclaims"] >= 1
    finally:
        agent.stop()
        running.stop()


def test_dry_run_decides_but_changes_nothing(tmp_path: Path) -> None:
    running = start_control_sidecar(tmp_path, policy={
        "interval": 0.05, "dry_run": True, "initial_settings": "garbage_collection_threshold:0.5",
        "rules": [{**FRAGMENTED_RULE, "for": 0}]})
    allocator = ae.Allocator(ae.SimDevice(capacity=0), "native")
    agent = connect_agent(running, tmp_path, {0: allocator})
    try:
        _, reserved_before = fragment(allocator)
        wait_for(lambda: metric(running, "allocwatch_policy_actions_total", rule="fragmented",
                                result="dry_run") >= 1.0, what="a dry-run decision")
        time.sleep(0.3)  # several more evaluations
        stats = allocator.stats()
        assert stats["reserved_bytes.all.current"] == reserved_before
        assert stats["num_empty_cache_calls"] == 0
        assert allocator.config()["garbage_collection_threshold"] == 0.0  # initial not pushed
        assert metric(running, "allocwatch_policy_actions_total", rule="initial_settings",
                      result="dry_run") == 1.0
        assert metric(running, "allocwatch_commands_total") == 0.0  # nothing was sent
    finally:
        agent.stop()
        running.stop()


def test_cooldown_and_hourly_cap_bound_the_commands(tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A figure stuck above the fire level (pending events a reclaim cannot clear): the rule
    stays firing, yet only `max_actions_per_hour` commands reach the agent, decided cooldown
    apart (timed where they are decided: their delivery to the agent may lag by any amount)."""
    caplog.set_level(logging.INFO, logger="exporter.policy")
    running = start_control_sidecar(tmp_path, policy={"interval": 0.02, "rules": [
        {"name": "stuck", "metric": "pending_events", "above": 100, "for": 0,
         "cooldown": 0.25, "max_actions_per_hour": 3, "action": "reclaim"}]})
    source = FakeSource()
    source.bump(0, pending_events=500)
    agent = connect_agent(running, tmp_path, source, interval=0.02)
    try:
        # The cap reached: a fourth action was due (its cooldown over) and held back.
        wait_for(lambda: metric(running, "allocwatch_policy_suppressed_total", rule="stuck",
                                reason="max_actions_per_hour") == 1.0,
                 what="the hourly cap holding back a fourth action")
        # The three delivered (on a loaded machine, maybe after the decisions), then two more
        # cooldowns, in which no further command may arrive.
        wait_for(lambda: len([c for c in source.calls if c[0] == "reclaim"]) >= 3,
                 what="the three commands delivered")
        time.sleep(0.5)
        seen = len([c for c in source.calls if c[0] == "reclaim"])
        assert seen == 3, source.calls
        times = [r.created for r in caplog.records
                 if r.getMessage() == "policy action" and getattr(r, "rule", None) == "stuck"]
        assert len(times) == 3
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        assert all(gap >= 0.2 for gap in gaps), gaps  # cooldown apart (0.25 s)
        assert metric(running, "allocwatch_policy_actions_total", rule="stuck",
                      result="ok") == 3.0
        assert metric(running, "allocwatch_policy_suppressed_total", rule="stuck",
                      reason="max_actions_per_hour") == 1.0
        assert metric(running, "allocwatch_policy_rule_firing", rule="stuck") == 1.0
    finally:
        agent.stop()
        running.stop()


def test_initial_settings_reach_every_agent_that_connects(tmp_path: Path) -> None:
    running = start_control_sidecar(tmp_path, policy={
        "interval": 0.05, "initial_settings": "garbage_collection_threshold:0.7"})
    allocators = [ae.Allocator(ae.SimDevice(capacity=0), "native") for _ in range(2)]
    agents = []
    try:
        for rank, allocator in enumerate(allocators):
            agents.append(connect_agent(running, tmp_path, {0: allocator}, rank=rank))
        for allocator in allocators:
            wait_for(lambda a=allocator: a.config()["garbage_collection_threshold"] == 0.7,
                     what="the initial settings")
            assert allocator.config()["expandable_segments"] is False  # only the named key
        wait_for(lambda: metric(running, "allocwatch_policy_actions_total",
                                rule="initial_settings", result="ok") == 2.0,
                 what="both pushes counted")
    finally:
        for agent in agents:
            agent.stop()
        running.stop()
