"""The sidecar's view of its agents: who is connected, their latest report, their command queue.

Written by the gRPC server (event loop thread), read by the collectors and the landing page (the
exposition's worker thread): every access goes through one lock, held only to swap references.
Reports are immutable once stored (the server never mutates a received message), so readers get
consistent figures without copying them.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hmac
import itertools
import logging
import secrets
import threading
import time
from collections import Counter

from allocator_ext.protocol import metrics
from allocator_ext.protocol.proto.allocwatch.v1 import agent_pb2 as pb
from exporter.shared.series import SeriesSlots, labels_of

log = logging.getLogger("exporter.registry")


class AgentRefusedError(Exception):
    """A hello the registry turns down; `reason` labels allocwatch_agents_refused_total."""

    reason = "refused"


class AgentLimitError(AgentRefusedError):
    reason = "too_many_agents"


class SeriesLimitError(AgentRefusedError):
    reason = "series_limit"


class IdentityInUseError(AgentRefusedError):
    """A hello for an agent instance that is connected: never a takeover of its stream."""

    reason = "identity_in_use"


class AgentGoneError(Exception):
    pass


# What one agent puts in the exposition, for the series bound, counted from the metric table:
# each reported device's series (allocator, info, GPU), and the agent's own.
SERIES_PER_DEVICE = metrics.series_per_device()
SERIES_PER_AGENT = metrics.series_per_agent()


def series_of(report: pb.Report | None) -> int:
    """The series an agent with this report shows (one device before it reports: the hello's)."""
    devices = len(report.devices) if report is not None else 0
    return SERIES_PER_AGENT + SERIES_PER_DEVICE * max(1, devices)


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
    # 1, or the agent_slot telling it apart from a live agent with the same labels (series.py).
    series_slot: int = 1
    # Commands to this agent: set by the server while a stream is open.
    session: AgentSession | None = None
    series_count: int = 0  # what it counts against agents.max_series (series_of its report)


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


@dataclasses.dataclass(frozen=True)
class BoundCounters:
    """What the registry refused or dropped to stay within its bounds."""

    departed_dropped: int
    series_dropped: int  # of departed agents forgotten early, of devices left out
    refused: dict[str, int]  # hellos turned down, by reason
    figures_dropped: dict[str, int]  # implausible figures left out, by reason


class Registry:
    """The agents by key: connected ones, and departed ones until they expire or, past
    `max_departed`, until newer departures push them out (oldest first, counted).

    The series all agents show stay within `max_series`: a new agent or a report with more
    devices first takes the room of departed agents (oldest first); where that is not enough,
    the new agent is refused and a report's extra devices are left out, each counted."""

    def __init__(self, expiry_seconds: float, max_agents: int, max_departed: int = 256,
                 max_series: int = 50_000):
        self.expiry_seconds = expiry_seconds
        self.max_agents = max_agents
        self.max_departed = max_departed
        self.max_series = max_series
        self._series_count = 0
        self.series_dropped_total = 0
        self._lock = threading.Lock()
        self._agents: dict[str, AgentState] = {}
        self._connected = 0  # of the agents, those connected
        self._departed: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.reports_received_total = 0
        self.commands_total: Counter[tuple[str, str]] = Counter()
        self.stream_errors_total: Counter[str] = Counter()
        self.departed_dropped_total = 0
        self.refused_total: Counter[str] = Counter()
        self.figures_dropped_total: Counter[str] = Counter()
        self._key_secret = secrets.token_bytes(16)
        self.series = SeriesSlots()
        self.ever_connected = False
        self._started = time.monotonic()
        # When the last connected agent left (monotonic); None while any is connected.
        self.all_gone_since: float | None = None

    def key_for(self, identity: pb.Identity) -> str:
        """host/pid/rank/tag, the tag a keyed digest of the instance id: what the key shows
        (on `/`, in logs) tells nothing of the instance id, so that no hello can be made to
        match another agent's key."""
        rank = f"rank{identity.rank}" if identity.rank >= 0 else "norank"
        tag = hmac.new(self._key_secret, identity.instance_id.encode(), "sha256").hexdigest()
        return f"{identity.host}/{identity.pid}/{rank}/{tag[:8]}"

    def connect(self, identity: pb.Identity, protocol: str, peer: str) -> AgentState:
        """The state of a newly connected agent; AgentRefusedError (counted) when it cannot be
        served. A hello for a departed agent's instance resumes its figures (its stream broke
        and it reconnected); one for a connected agent's instance is refused."""
        key = self.key_for(identity)
        with self._lock:
            try:
                state = self._admit_locked(key, identity, protocol, peer)
            except AgentRefusedError as err:
                self.refused_total[err.reason] += 1
                raise
            self._agents[key] = state
            self._connected += 1
            self.ever_connected = True
            self.all_gone_since = None
            return state

    def _admit_locked(self, key: str, identity: pb.Identity, protocol: str, peer: str
                      ) -> AgentState:
        self._expire_locked(time.monotonic())
        old = self._agents.get(key)
        if old is not None and old.connected:
            raise IdentityInUseError(f"agent {key} is connected already: a second stream for "
                                     "one agent instance is refused")
        if old is None and self._connected >= self.max_agents:
            raise AgentLimitError(
                f"the sidecar already serves {self._connected} agents (agents.max_agents)")
        state = AgentState(key=key, identity=identity, protocol=protocol, peer=peer)
        resumed = old is not None and old.identity.instance_id == identity.instance_id
        if old is not None and resumed:
            # The same agent instance reconnecting (its previous stream broke): keep its report
            # and its series' labels.
            state.last_report, state.last_report_time = old.last_report, old.last_report_time
            state.reports_received = old.reports_received
            state.series_slot = old.series_slot
        state.series_count = series_of(state.last_report)
        freed = old.series_count if old is not None else 0
        if not self._make_room_locked(state.series_count - freed, spare=key):
            raise SeriesLimitError(
                f"the sidecar shows {self._series_count} series, near agents.max_series "
                f"({self.max_series}), and no departed agent is left to make room")
        if old is not None:
            self._forget_locked(key, keep_slot=resumed)
        self._series_count += state.series_count
        return state

    def _make_room_locked(self, extra: int, spare: str = "") -> bool:
        """Room for `extra` more series, forgetting departed agents (oldest first, never
        `spare`) as needed; False, forgetting nobody, when even all of them would not do."""
        if self._series_count + extra <= self.max_series:
            return True
        departed = [k for k in self._departed if k != spare]
        held = sum(self._agents[k].series_count for k in departed)
        if self._series_count + extra - held > self.max_series:
            return False
        for key in departed:
            if self._series_count + extra <= self.max_series:
                break
            self._drop_for_series_locked(key)
        return True

    def _drop_for_series_locked(self, key: str) -> None:
        self.series_dropped_total += self._agents[key].series_count
        self._forget_locked(key)
        log.info("departed agent dropped before its expiry (agents.max_series)",
                 extra={"agent": key})

    def _forget_locked(self, key: str, keep_slot: bool = False) -> None:
        self._series_count -= self._agents.pop(key).series_count
        self._departed.pop(key, None)
        if not keep_slot:
            self.series.forget(key)

    def record_report(self, state: AgentState, report: pb.Report) -> bool:
        """Store a report; False (ignored) when it is older than the one already held."""
        with self._lock:
            self.reports_received_total += 1
            state.reports_received += 1
            if state.last_report is not None and report.sequence <= state.last_report.sequence:
                self.stream_errors_total["out_of_order_report"] += 1
                return False
            if self._agents.get(state.key) is state:  # not forgotten meanwhile
                report = self._fit_locked(state, report)
                state.series_slot = self.series.place(state.key,
                                                      labels_of(state.identity, report))
            state.last_report = report
            state.last_report_time = time.time()
            return True

    def _fit_locked(self, state: AgentState, report: pb.Report) -> pb.Report:
        """The report as the series bound lets it be kept (its devices that fit), its series
        counted on the agent."""
        wanted = series_of(report)
        if not self._make_room_locked(wanted - state.series_count, spare=state.key):
            for key in [k for k in self._departed if k != state.key]:  # all the room there is
                self._drop_for_series_locked(key)
            others = self._series_count - state.series_count
            room = self.max_series - others - SERIES_PER_AGENT
            fits = max(0, room // SERIES_PER_DEVICE)
            self.series_dropped_total += (len(report.devices) - fits) * SERIES_PER_DEVICE
            log.warning("report devices left out (agents.max_series)", extra={
                "agent": state.key, "devices": len(report.devices), "kept": fits})
            kept = pb.Report()
            kept.CopyFrom(report)
            del kept.devices[fits:]
            report, wanted = kept, series_of(kept)
        self._series_count += wanted - state.series_count
        state.series_count = wanted
        return report

    def disconnect(self, state: AgentState) -> None:
        with self._lock:
            if self._agents.get(state.key) is state and state.connected:
                state.connected = False
                self._connected -= 1
                state.disconnected_monotonic = time.monotonic()
                self.series.departed(state.key)
                self._departed[state.key] = None
                self._drop_departed_locked(self.max_departed)
            if not self._connected:
                self.all_gone_since = time.monotonic()
            if state.session is not None:
                state.session.close()
                state.session = None

    def count_command(self, command: str, result: str) -> None:
        with self._lock:
            self.commands_total[(command, result)] += 1

    def count_figures_dropped(self, reasons: list[str]) -> None:
        """Figures left out of what an agent sent (exporter.agents.screening), by reason."""
        if reasons:
            with self._lock:
                self.figures_dropped_total.update(reasons)

    def count_refused(self, reason: str) -> None:
        """A hello refused before it reached the registry (e.g. unauthenticated)."""
        with self._lock:
            self.refused_total[reason] += 1

    def count_stream_error(self, reason: str) -> None:
        with self._lock:
            self.stream_errors_total[reason] += 1

    def _expire_locked(self, now: float) -> None:
        for key in list(self._departed):  # in order of departure: stop at the first kept
            gone = self._agents[key].disconnected_monotonic
            if gone is not None and now - gone < self.expiry_seconds:
                break
            self._forget_locked(key)
            log.info("agent expired", extra={"agent": key})

    def _drop_departed_locked(self, keep: int) -> int:
        """Forget departed agents, oldest first, until `keep` remain; how many went."""
        dropped = 0
        while len(self._departed) > keep:
            key = next(iter(self._departed))
            self._forget_locked(key)
            dropped += 1
            log.info("departed agent dropped before its expiry (agents.max_departed_agents)",
                     extra={"agent": key})
        self.departed_dropped_total += dropped
        return dropped

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

    def series_count(self) -> int:
        """The series the agents held count against agents.max_series."""
        with self._lock:
            return self._series_count

    def bound_counters(self) -> BoundCounters:
        with self._lock:
            return BoundCounters(departed_dropped=self.departed_dropped_total,
                                 series_dropped=self.series_dropped_total,
                                 refused=dict(self.refused_total),
                                 figures_dropped=dict(self.figures_dropped_total))

    def series_collisions(self) -> int:
        """Agents accepted whose series labels coincided with a live agent's, each counted
        once (series.py)."""
        with self._lock:
            return self.series.collisions_total

    def counters(self) -> tuple[int, dict[tuple[str, str], int], dict[str, int]]:
        with self._lock:
            return (
                self.reports_received_total,
                dict(self.commands_total),
                dict(self.stream_errors_total),
            )
