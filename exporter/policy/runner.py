"""The policy engine on the sidecar's event loop: evaluates on a timer and sends the decided
commands as tasks, so that neither evaluation nor a slow agent ever holds up the gRPC server.
It also pushes the policy's `initial_settings` to each agent that connects."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from allocator_ext.protocol.proto.allocwatch.v1 import agent_pb2 as pb
from exporter.policy.config import PolicyConfig
from exporter.policy.engine import Decision, PolicyEngine
from exporter.shared.registry import AgentState, Registry, outcome_name, send_command

log = logging.getLogger("exporter.policy")

INITIAL_RULE = "initial_settings"  # the rule label of initial-settings pushes


class PolicyRunner:
    """Runs the engine on the sidecar's event loop."""

    def __init__(self, engine: PolicyEngine, registry: Registry):
        self.engine = engine
        self.registry = registry
        self._greeted: dict[str, Any] = {}  # agent key -> the session given initial settings
        self._tasks: set[asyncio.Task] = set()

    async def run(self) -> None:
        while True:
            try:
                self.tick(time.monotonic())
            except Exception:  # a bug here must not end the loop, nor the sidecar
                log.exception("policy evaluation failed")
            await asyncio.sleep(self.engine.config.interval_seconds)

    def tick(self, now: float) -> None:
        agents = self.registry.agents()
        self._push_initial_settings(agents)
        for decision in self.engine.evaluate(agents, now):
            if decision.dry_run:
                self.engine.finished(decision, "dry_run")
                continue
            self._spawn(self._act(decision))

    def reconfigure(self, config: PolicyConfig) -> None:
        changed = config.initial_settings != self.engine.config.initial_settings
        self.engine.reconfigure(config)
        if changed:  # the new initial settings go to the agents already connected too
            self._greeted.clear()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _push_initial_settings(self, agents: list[AgentState]) -> None:
        live = {a.key for a in agents if a.connected}
        for key in [k for k in self._greeted if k not in live]:
            del self._greeted[key]
        settings = self.engine.config.initial_settings
        if not settings:
            return
        for agent in agents:
            session = agent.session
            if not agent.connected or session is None or self._greeted.get(agent.key) is session:
                continue
            self._greeted[agent.key] = session
            if self.engine.config.dry_run:
                log.info("policy initial settings", extra={
                    "agent": agent.key, "settings": settings, "decision": "dry_run"})
                self.engine.count(INITIAL_RULE, "set_config", "dry_run")
                continue
            self._spawn(self._send_initial(agent.key, session, settings))

    async def _send_initial(self, key: str, session: Any, settings: str) -> None:
        command = pb.Command(cuda_device=-1, set_config=pb.SetConfig(settings=settings))
        result = await send_command(session, command, self.engine.config.command_timeout_seconds)
        self.engine.count(INITIAL_RULE, "set_config", outcome_name(result))
        log.info("policy initial settings", extra={
            "agent": key, "settings": settings, "decision": "sent",
            "result": outcome_name(result),
            "detail": None if isinstance(result, str) else result.message})

    async def _act(self, decision: Decision) -> None:
        state = self.registry.get(decision.agent_key)
        session = state.session if state is not None else None
        outcome: str | pb.CommandResult = "disconnected"
        try:
            outcome = await send_command(session, decision.command,
                                         self.engine.config.command_timeout_seconds)
        finally:
            name = outcome_name(outcome)
            self.engine.finished(decision, name)
        fields: dict[str, Any] = {"rule": decision.rule.name, "agent": decision.agent_key,
                                  "cuda_device": decision.cuda_device,
                                  "action": decision.rule.action, "result": name,
                                  "decision": "result"}
        if not isinstance(outcome, str):
            fields.update(detail=outcome.message, bytes_released=outcome.bytes_released,
                          sync_seconds=round(outcome.sync_seconds, 6))
        log.info("policy action result", extra=fields)
