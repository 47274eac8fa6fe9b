"""The sidecar's view of its agents: who is connected, their latest report, their command queue.

Written by the gRPC server (event loop thread), read by the collector (HTTP threads) and the
landing page: every access goes through one lock, held only to swap references. Reports are
immutable once stored (the server never mutates a received message), so readers get consistent
figures without copying them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
from collections import Counter

from exporter.protocol.proto.allocwatch.v1 import agent_pb2 as pb
from exporter.sidecar.series import SeriesSlots, labels_of

log = logging.getLogger("exporter.registry")


class AgentLimitError(Exception):
    pass


class AgentGoneError(Exception):
    pass


@dataclasses.dataclass
class AgentState:
    key: str
    identity: pb.Identity
    protocol: str
    peer: str
    connected: bool = True
    connected_at: float = dataclasses.field(default_factory=time.time)
    disconnected_monotonic: float | None = None
    last_report: pb.Report | None = None
    last_report_time: float | None = None  # unix time the sidecar received it
    reports_received: int = 0
    last_result: pb.CommandResult | None = None
    # 1, or the agent_slot telling it apart from a live agent with the same labels (series.py).
    series_slot: int = 1
    # Commands to this agent: set by the server while a stream is open.
    session: AgentSession | None = None


class AgentSession:
    """The sending half of one agent's stream: queue a command, await its result."""

    def __init__(self, loop: asyncio.AbstractEventLoop, registry: Registry, key: str):
        self.loop = loop
        self.outgoing: asyncio.Queue[pb.Command] = asyncio.Queue()
        self._pending: dict[int, asyncio.Future[pb.CommandResult]] = {}
        self._ids = itertools.count(1)
        self._registry = registry
        self._key = key
        self.closed = False

    async def send(self, command: pb.Command, timeout: float = 30.0) -> pb.CommandResult:
        """Send a command (its id is assigned here) and wait for the agent's result."""
        if self.closed:
            raise AgentGoneError(f"agent {self._key} is not connected")
        command.id = next(self._ids)
        future: asyncio.Future[pb.CommandResult] = self.loop.create_future()
        self._pending[command.id] = future
        await self.outgoing.put(command)
        name = command.WhichOneof("action") or "unknown"
        try:
            result = await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            self._registry.count_command(name, "timeout")
            raise
        except AgentGoneError:
            self._registry.count_command(name, "disconnected")
            raise
        finally:
            self._pending.pop(command.id, None)
        self._registry.count_command(name, outcome_name(result))
        return result

    def resolve(self, result: pb.CommandResult) -> bool:
        future = self._pending.get(result.command_id)
        if future is None or future.done():
            return False
        future.set_result(result)
        return True

    def close(self) -> None:
        self.closed = True
        for future in self._pending.values():
            if not future.done():
                future.set_exception(AgentGoneError(f"agent {self._key} disconnected"))


Outcome = pb.CommandResult | str  # the agent's result, or why there is none


def outcome_name(outcome: Outcome) -> str:
    """A command's outcome as a label: the result's status (ok, invalid_argument, unsupported,
    failed), or "timeout" / "disconnected" where the agent gave none."""
    if isinstance(outcome, str):
        return outcome
    return pb.CommandResult.Status.Name(outcome.status).lower()


async def send_command(session: AgentSession | None, command: pb.Command,
                       timeout: float) -> Outcome:
    """Send a copy of `command` (each send assigns its own id) and wait for the agent's result;
    "timeout" or "disconnected" instead of raising, so that one agent's silence is an outcome
    among others."""
    if session is None:
        return "disconnected"
    copy = pb.Command()
    copy.CopyFrom(command)
    try:
        return await session.send(copy, timeout)
    except asyncio.TimeoutError:
        return "timeout"
    except AgentGoneError:
        return "disconnected"


class Registry:
    def __init__(self, expiry_seconds: float, max_agents: int):
        self.expiry_seconds = expiry_seconds
        self.max_agents = max_agents
        self._lock = threading.Lock()
        self._agents: dict[str, AgentState] = {}
        self.reports_received_total = 0
        self.commands_total: Counter[tuple[str, str]] = Counter()
        self.stream_errors_total: Counter[str] = Counter()
        self.series = SeriesSlots()
        self.ever_connected = False
        self._started = time.monotonic()
        # When the last connected agent left (monotonic); None while any is connected.
        self.all_gone_since: float | None = None

    @staticmethod
    def key_for(identity: pb.Identity) -> str:
        rank = f"rank{identity.rank}" if identity.rank >= 0 else "norank"
        return f"{identity.host}/{identity.pid}/{rank}/{identity.instance_id[:8]}"

    def connect(self, identity: pb.Identity, protocol: str, peer: str) -> AgentState:
        key = self.key_for(identity)
        with self._lock:
            self._expire_locked(time.monotonic())
            old = self._agents.get(key)
            connected = sum(1 for a in self._agents.values() if a.connected)
            if old is None and connected >= self.max_agents:
                raise AgentLimitError(
                    f"the sidecar already serves {connected} agents (agents.max_agents)")
            state = AgentState(key=key, identity=identity, protocol=protocol, peer=peer)
            if old is not None:
                # The same agent instance reconnecting (its previous stream broke): keep its report.
                state.last_report, state.last_report_time = old.last_report, old.last_report_time
                state.reports_received = old.reports_received
                state.series_slot = old.series_slot
                if old.session is not None:
                    old.session.close()
            self._agents[key] = state
            self.ever_connected = True
            self.all_gone_since = None
            return state

    def record_report(self, state: AgentState, report: pb.Report) -> bool:
        """Store a report; False (ignored) when it is older than the one already held."""
        with self._lock:
            self.reports_received_total += 1
            state.reports_received += 1
            if state.last_report is not None and report.sequence <= state.last_report.sequence:
                self.stream_errors_total["out_of_order_report"] += 1
                return False
            state.last_report = report
            state.last_report_time = time.time()
            state.series_slot = self.series.place(
                state.key, labels_of(state.identity, report),
                {key: agent.connected for key, agent in self._agents.items()})
            return True

    def disconnect(self, state: AgentState) -> None:
        with self._lock:
            if self._agents.get(state.key) is state:
                state.connected = False
                state.disconnected_monotonic = time.monotonic()
            if not any(a.connected for a in self._agents.values()):
                self.all_gone_since = time.monotonic()
            if state.session is not None:
                state.session.close()
                state.session = None

    def count_command(self, command: str, result: str) -> None:
        with self._lock:
            self.commands_total[(command, result)] += 1

    def count_stream_error(self, reason: str) -> None:
        with self._lock:
            self.stream_errors_total[reason] += 1

    def _expire_locked(self, now: float) -> None:
        for key, state in list(self._agents.items()):
            gone = state.disconnected_monotonic
            if not state.connected and gone is not None and now - gone >= self.expiry_seconds:
                del self._agents[key]
                self.series.forget(key)
                log.info("agent expired", extra={"agent": key})

    def seconds_without_any_agent(self) -> float:
        """How long the sidecar has waited for its first agent; 0 once one has connected."""
        with self._lock:
            return 0.0 if self.ever_connected else time.monotonic() - self._started

    def agents(self) -> list[AgentState]:
        """Current agents (connected, or departed but not yet expired), oldest first."""
        with self._lock:
            self._expire_locked(time.monotonic())
            return list(self._agents.values())

    def get(self, key: str) -> AgentState | None:
        with self._lock:
            return self._agents.get(key)

    def series_collisions(self) -> int:
        """Agents accepted whose series labels coincided with a live agent's (series.py)."""
        with self._lock:
            return self.series.collisions_total

    def counters(self) -> tuple[int, dict[tuple[str, str], int], dict[str, int]]:
        with self._lock:
            return (
                self.reports_received_total,
                dict(self.commands_total),
                dict(self.stream_errors_total),
            )
