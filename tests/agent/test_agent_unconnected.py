"""A job whose agent never reaches the sidecar is said loudly: in the training process's own log
(the agent warns once, after a bounded time, naming the target and the reason, even where the
program configured no logging), and as a metric of the sidecar, which counts how long it has
waited for its first agent (AllocwatchNoAgentConnected reads it)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support.paths import REPO
from support.sidecar import FakeSource, start_sidecar, values
from support.waiting import wait_for

from allocator_ext.agent import start_agent

pytestmark = pytest.mark.timeout(90)

TRAINER = textwrap.dedent("""
    import time
    import allocator_ext as ae
    from allocator_ext.agent import maybe_start_from_env

    alloc = ae.Allocator(ae.SimDevice(capacity=1 << 30))
    agent = maybe_start_from_env(source=alloc)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not agent.warned_unconnected:
        alloc.free(alloc.malloc(1 << 20, stream=0))
        time.sleep(0.05)
    time.sleep(1.0)  # time enough for a second warning, were there one
    print("trained", flush=True)
""")


def test_the_trainer_log_says_once_where_the_agent_could_not_reach(tmp_path: Path) -> None:
    target = f"unix://{tmp_path}/nobody-listens.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ALLOCWATCH_")}
    env.update(ALLOCWATCH_TARGET=target, ALLOCWATCH_INTERVAL="0.1",
               ALLOCWATCH_WARN_UNCONNECTED_SECONDS="0.5", ALLOCWATCH_AGENT_NVML="0")
    out = subprocess.run([sys.executable, "-c", TRAINER], capture_output=True, text=True,
                         env=env, cwd=REPO, timeout=60)
    assert out.returncode == 0 and "trained" in out.stdout, out.stderr
    warnings = [line for line in out.stderr.splitlines() if "has not reached its sidecar" in line]
    assert len(warnings) == 1, out.stderr
    assert target in warnings[0] and "UNAVAILABLE" in warnings[0]
    assert "not published" in warnings[0]


def test_an_agent_that_connects_does_not_warn(tmp_path: Path) -> None:
    sidecar = start_sidecar(tmp_path)
    agent = start_agent(sidecar.sidecar.agent_targets[0], interval=0.05,
                        source=FakeSource(), nvml=False, stop_at_exit=False,
                        warn_unconnected_after=0.3)
    try:
        wait_for(lambda: agent.connected.is_set(), what="the agent's connection")
        wait_for(lambda: agent.sequence > 20, what="samples past the warning's bound")
        assert not agent.warned_unconnected
    finally:
        agent.stop()
        sidecar.stop()


def test_the_sidecar_counts_its_wait_for_a_first_agent(tmp_path: Path) -> None:
    sidecar = start_sidecar(tmp_path)
    url = sidecar.sidecar.metrics_url
    try:
        first = wait_for(lambda: values(url, "allocwatch_agent_wait_seconds"), what="the gauge")
        later = wait_for(lambda: [v for v in values(url, "allocwatch_agent_wait_seconds")
                                  if v > first[0]], what="the wait to grow")
        assert later[0] > first[0] > 0
        agent = start_agent(sidecar.sidecar.agent_targets[0], interval=0.1,
                            source=FakeSource(), nvml=False, stop_at_exit=False)
        wait_for(lambda: values(url, "allocwatch_agent_wait_seconds") == [0.0],
                 what="0 once an agent connected")
        agent.stop()
        wait_for(lambda: values(url, "allocwatch_agents_connected") == [0.0], what="departure")
        # The agent left: that is AllocwatchAgentGone's case; the wait stays over.
        assert values(url, "allocwatch_agent_wait_seconds") == [0.0]
    finally:
        sidecar.stop()
