"""What the admin API's endpoints do, independent of HTTP (exporter.admin.http_server serves
them).

    GET  /v1/agents?rank=&host=&job=&agent=      the agents and their live figures
    POST /v1/settings     {"settings": "...", selectors}
    POST /v1/reclaim      {"mode": "gc"|"all", selectors}
    POST /v1/snapshot     {"frames": false, selectors}   -> path, bytes, download URL
    GET  /v1/snapshots/NAME                         a file of the snapshot directory, by name
    POST /v1/reset-peaks  {selectors}
    POST /v1/record-history {"enabled": true|false, "max_entries": N, selectors}

A bad request (unknown field, invalid settings, no agent selected) is refused with a message and
sends nothing: `CommandRequest.parse` validates it whole before anything is sent. Commands are
awaited on the sidecar's event loop, so waiting for agents never holds up the gRPC server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import Callable, Container, Mapping
from typing import Any

from allocator_ext.protocol.proto.allocwatch.v1 import agent_pb2 as pb
from allocator_ext.protocol.service import DEFAULT_HISTORY_ENTRIES, MAX_HISTORY_ENTRIES
from exporter.admin.snapshots import MAX_SNAPSHOT_BYTES, SnapshotUnavailable, open_snapshot
from exporter.admin.views import agent_view, result_view
from exporter.shared.config import shown
from exporter.shared.registry import AgentState, Outcome, Registry, send_command
from exporter.shared.settings import validate_settings

SELECTOR_FIELDS = ("rank", "host", "job", "agent")
# A command's reply holds at most about this much of what the agents answered; past it, the
# results that do not fit carry their status alone.
MAX_REPLY_BYTES = 4 << 20


def reply_cost(outcome: Outcome) -> int:
    """An upper bound on what one agent's result adds to a reply, from its wire size: a
    result's strings hold no control character (screening), so JSON writes each character of
    them in at most two bytes; each device entry adds its keys."""
    if isinstance(outcome, str):
        return 256
    return 512 + 2 * outcome.ByteSize() + 256 * len(outcome.settings_in_force)


class AdminError(Exception):
    """A request refused: `status` is the HTTP status it is answered with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


_RANK = re.compile(r"-?[0-9]{1,10}")


def _rank(value: Any) -> int | None:
    """A rank from JSON (an integer) or a query string (its digits); a float is no rank, not
    even 1.0 (int() would take 0.9 for rank 0)."""
    if value is None or value == "":
        return None
    if isinstance(value, str) and _RANK.fullmatch(value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not -1 <= value < 2**31:
        raise AdminError(400, f"rank: expected an integer, got {shown(value)}")
    return value


@dataclasses.dataclass(frozen=True)
class Selector:
    rank: int | None = None
    host: str | None = None
    job: str | None = None
    agent: str | None = None

    @classmethod
    def parse(cls, values: Mapping[str, Any]) -> Selector:
        strings = {}
        for name in ("host", "job", "agent"):
            value = values.get(name)
            if value is not None and not isinstance(value, str):
                raise AdminError(400, f"{name}: expected a string, got {shown(value)}")
            strings[name] = value or None
        return cls(rank=_rank(values.get("rank")), **strings)

    def matches(self, state: AgentState) -> bool:
        ident = state.identity
        return ((self.rank is None or ident.rank == self.rank)
                and (self.host is None or ident.host == self.host)
                and (self.job is None or ident.training_job == self.job)
                and (self.agent is None or state.key == self.agent))

    def describe(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclasses.dataclass(frozen=True)
class _Endpoint:
    command: str                 # pb.Command's action, for logs and results
    fields: frozenset[str]       # body fields besides the selectors


ENDPOINTS = {
    "/v1/settings": _Endpoint("set_config", frozenset({"settings"})),
    "/v1/reclaim": _Endpoint("reclaim", frozenset({"mode"})),
    "/v1/snapshot": _Endpoint("snapshot", frozenset({"frames", "max_bytes"})),
    "/v1/reset-peaks": _Endpoint("reset_peaks", frozenset()),
    "/v1/record-history": _Endpoint("record_history", frozenset({"enabled", "max_entries"})),
}


def _settings(text: Any) -> str:
    if not isinstance(text, str) or not text.strip():
        raise AdminError(400, "settings: expected a non-empty settings string "
                              "(e.g. garbage_collection_threshold:0.8)")
    try:
        return validate_settings(text)
    except ValueError as err:
        raise AdminError(400, f"settings: {err}") from None


def build_command(endpoint: _Endpoint, body: Mapping[str, Any]) -> pb.Command:
    """The command for a request body, validated before anything is sent."""
    if endpoint.command == "set_config":
        return pb.Command(cuda_device=-1, set_config=pb.SetConfig(
            settings=_settings(body.get("settings"))))
    if endpoint.command == "reclaim":
        mode = body.get("mode", "gc")
        if mode not in ("gc", "all"):
            raise AdminError(400, f"mode: must be gc or all, got {shown(mode)}")
        return pb.Command(cuda_device=-1, reclaim=pb.Reclaim(
            mode=pb.Reclaim.EMPTY_CACHE if mode == "all" else pb.Reclaim.GARBAGE_COLLECT))
    if endpoint.command == "snapshot":
        frames, max_bytes = body.get("frames", False), body.get("max_bytes", 0)
        if not isinstance(frames, bool):
            raise AdminError(400, f"frames: expected true or false, got {shown(frames)}")
        if (isinstance(max_bytes, bool) or not isinstance(max_bytes, int)
                or not 0 <= max_bytes <= MAX_SNAPSHOT_BYTES):
            raise AdminError(400, f"max_bytes: expected a byte count from 0 (the agent's cap) "
                                  f"to {MAX_SNAPSHOT_BYTES}, got {shown(max_bytes)}")
        return pb.Command(cuda_device=-1, snapshot=pb.Snapshot(include_frames=frames,
                                                               max_bytes=max_bytes))
    if endpoint.command == "record_history":
        enabled, entries = body.get("enabled"), body.get("max_entries", 0)
        if not isinstance(enabled, bool):
            raise AdminError(400, f"enabled: expected true or false, got {enabled!r}")
        if (isinstance(entries, bool) or not isinstance(entries, int)
                or not 0 <= entries <= MAX_HISTORY_ENTRIES):
            raise AdminError(400, f"max_entries: expected 0 (the agent's default, "
                                  f"{DEFAULT_HISTORY_ENTRIES}) to {MAX_HISTORY_ENTRIES}, "
                                  f"got {entries!r}")
        return pb.Command(cuda_device=-1, record_history=pb.RecordHistory(
            enabled=enabled, max_entries=entries))
    return pb.Command(cuda_device=-1, reset_peaks=pb.ResetPeaks())


@dataclasses.dataclass(frozen=True)
class CommandRequest:
    """A command endpoint's request, validated: nothing is sent before this exists."""

    endpoint: _Endpoint
    selector: Selector
    command: pb.Command

    @classmethod
    def parse(cls, path: str, body: Mapping[str, Any]) -> CommandRequest:
        """AdminError (400) naming the first bad field."""
        endpoint = ENDPOINTS[path]
        unknown = set(body) - set(SELECTOR_FIELDS) - endpoint.fields
        if unknown:
            known = sorted(set(SELECTOR_FIELDS) | endpoint.fields)
            raise AdminError(400, f"unknown field {shown(sorted(unknown)[0])} (known: "
                                  f"{', '.join(known)})")
        return cls(endpoint, Selector.parse(body), build_command(endpoint, body))


class AdminService:
    """What the endpoints do, independent of HTTP."""

    def __init__(self, registry: Registry, timeout: Callable[[], float], snapshot_dir: str = "",
                 snapshot_owners: Callable[[], Container[int]] | None = None):
        self.registry = registry
        self.timeout = timeout
        self.snapshot_dir = snapshot_dir
        # The users whose snapshot files are served (None: any).
        self.snapshot_owners = snapshot_owners

    def list_agents(self, selector: Selector) -> dict[str, Any]:
        agents = [agent_view(a) for a in self.registry.agents() if selector.matches(a)]
        return {"agents": agents}

    async def run(self, request: CommandRequest) -> dict[str, Any]:
        """Send a validated request's command to the agents it selects (on the event loop:
        waiting for them holds up nothing else) and gather their results."""
        selector, command = request.selector, request.command
        targets = [a for a in self.registry.agents()
                   if a.connected and a.session is not None and selector.matches(a)]
        if not targets:
            raise AdminError(404, f"no connected agent matches {selector.describe() or 'any'}")
        outcomes = await self._dispatch(targets, command, self.timeout())
        results, room = [], MAX_REPLY_BYTES
        for state, outcome in outcomes:
            view = self._result_view(state, outcome)
            cost = reply_cost(outcome)
            if cost > room:  # the agents' texts left out: the reply's size is bounded
                view = {key: view[key] for key in ("agent", "rank", "host", "status")}
                view["message"] = (f"left out: the reply reached its limit of "
                                   f"{MAX_REPLY_BYTES} bytes")
            else:
                room -= cost
            results.append(view)
        return {"command": request.endpoint.command, "selector": selector.describe(),
                "selected": len(targets), "ok": all(r["status"] == "ok" for r in results),
                "results": results}

    async def _dispatch(self, targets: list[AgentState], command: pb.Command, timeout: float
                        ) -> list[tuple[AgentState, Outcome]]:
        outcomes = await asyncio.gather(*(send_command(s.session, command, timeout)
                                          for s in targets))
        return list(zip(targets, outcomes, strict=True))

    def _result_view(self, state: AgentState, outcome: Outcome) -> dict[str, Any]:
        return result_view(state, outcome)

    def open_snapshot(self, name: str) -> tuple[int, int]:
        """(descriptor, size) of the snapshot file `name` of the snapshot directory
        (exporter.admin.snapshots: no other file is ever served); the caller closes it."""
        if not self.snapshot_dir:
            raise AdminError(404, "this sidecar has no snapshot directory (admin.snapshot_dir)")
        try:
            owners = self.snapshot_owners() if self.snapshot_owners is not None else None
            return open_snapshot(self.snapshot_dir, name, owners)
        except SnapshotUnavailable as err:
            raise AdminError(err.status, str(err)) from None
