"""Helpers for the policy, admin, ctl and reload tests: a sidecar with the control sections
(policy, admin, reload) set, and agents with chosen identities."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from allocator_ext.agent import Agent, start_agent
from exporter.sidecar.app import SidecarThread
from exporter.sidecar.config import parse_config
from support.sidecar import sidecar_config, values
from support.waiting import wait_for


def control_config(tmp_path: Path, *, policy: dict[str, Any] | None = None,
                   admin: dict[str, Any] | None = None, reload: dict[str, Any] | None = None,
                   **kwargs: Any):
    """The fixtures' sidecar settings plus the control sections, parsed as from YAML."""
    parsed = parse_config({"policy": policy, "admin": admin, "reload": reload})
    return dataclasses.replace(sidecar_config(tmp_path, nvml=False, **kwargs),
                               policy=parsed.policy, admin=parsed.admin, reload=parsed.reload)


def start_control_sidecar(tmp_path: Path, config_path: Path | None = None,
                          **kwargs: Any) -> SidecarThread:
    return SidecarThread(control_config(tmp_path, **kwargs), config_path=config_path).start()


def connect_agent(running: SidecarThread, tmp_path: Path, source: Any, *, rank: int = 0,
                  host: str = "node-a", job: str = "job-a", interval: float = 0.05) -> Agent:
    agent = start_agent(running.sidecar.agent_targets[0], interval=interval, source=source,
                        identity={"rank": rank, "host": host, "training_job": job},
                        snapshot_dir=tmp_path / "run" / "snapshots", nvml=False,
                        stop_at_exit=False)
    wait_for(lambda: agent.agent_key is not None and any(
        a.key == agent.agent_key and a.last_report is not None
        for a in running.sidecar.registry.agents()), what=f"agent rank {rank} connected")
    return agent


def metric(running: SidecarThread, name: str, **labels: str) -> float:
    """Sum of the samples of `name` with these labels (0 when none)."""
    return sum(values(running.sidecar.metrics_url, name, **labels))


@contextlib.contextmanager
def two_agents_running(tmp_path: Path) -> Iterator[tuple[SidecarThread, str, list[Any]]]:
    """A sidecar with two agents on different ranks, hosts and jobs; yields the sidecar, its
    admin address and the agents' (fake) sources."""
    from support.sidecar import FakeSource

    running = start_control_sidecar(tmp_path)
    sources = [FakeSource(), FakeSource()]
    agents = [connect_agent(running, tmp_path, sources[0], rank=0, host="node-a", job="j1"),
              connect_agent(running, tmp_path, sources[1], rank=1, host="node-b", job="j2")]
    (address,) = running.sidecar.admin.addresses()
    try:
        yield running, address, sources
    finally:
        for agent in agents:
            agent.stop()
        running.stop()
