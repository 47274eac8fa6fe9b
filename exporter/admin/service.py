"""What the admin API's endpoints do, independent of HTTP (exporter.admin.http_server serves
them).

    GET  /v1/agents?rank=&host=&job=&agent=      the agents and their live figures
    POST /v1/settings     {"settings": "...", selectors}
    POST /v1/reclaim      {"mode": "gc"|"all", selectors}
    POST /v1/snapshot     {"frames": false, selectors}   -> path, bytes, download URL
    GET  /v1/snapshots/NAME                         the snapshot file's bytes
    POST /v1/reset-peaks  {selectors}
    POST /v1/record-history {"enabled": true|false, "max_entries": N, selectors}

A bad request (unknown field, invalid settings, no agent selected) is refused with a message and
sends nothing. Commands are handed to the sidecar's event loop and awaited from the request's
own thread, so waiting for agents never holds up the gRPC server.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import os
import stat
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from exporter.admin.views import agent_view, result_view
from exporter.protocol.proto.allocwatch.v1 import agent_pb2 as pb
from exporter.protocol.service import DEFAULT_HISTORY_ENTRIES, MAX_HISTORY_ENTRIES
from exporter.protocol.settings import validate_settings
from exporter.sidecar.registry import AgentState, Outcome, Registry, send_command

MAX_SNAPSHOT_BYTES = 256 << 20
SNAPSHOTS_KEPT = 64
SELECTOR_FIELDS = ("rank", "host", "job", "agent")


class AdminError(Exception):
    """A request refused: `status` is the HTTP status it is answered with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclasses.dataclass(frozen=True)
class Selector:
    rank: int | None = None
    host: str | None = None
    job: str | None = None
    agent: str | None = None

    @classmethod
    def parse(cls, values: Mapping[str, Any]) -> Selector:
        rank = values.get("rank")
        if rank is not None and rank != "":
            if isinstance(rank, bool):
                raise AdminError(400, f"rank: expected an integer, got {rank!r}")
            try:
                rank = int(rank)
            except (TypeError, ValueError):
                raise AdminError(400, f"rank: expected an integer, got {rank!r}") from None
        else:
            rank = None
        strings = {}
        for name in ("host", "job", "agent"):
            value = values.get(name)
            if value is not None and not isinstance(value, str):
                raise AdminError(400, f"{name}: expected a string, got {value!r}")
            strings[name] = value or None
        return cls(rank=rank, **strings)

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
            raise AdminError(400, f"mode: must be gc or all, got {mode!r}")
        return pb.Command(cuda_device=-1, reclaim=pb.Reclaim(
            mode=pb.Reclaim.EMPTY_CACHE if mode == "all" else pb.Reclaim.GARBAGE_COLLECT))
    if endpoint.command == "snapshot":
        frames, max_bytes = body.get("frames", False), body.get("max_bytes", 0)
        if not isinstance(frames, bool):
            raise AdminError(400, f"frames: expected true or false, got {frames!r}")
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise AdminError(400, f"max_bytes: expected a byte count, got {max_bytes!r}")
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


class AdminService:
    """What the endpoints do, independent of HTTP."""

    def __init__(self, registry: Registry, loop: asyncio.AbstractEventLoop,
                 timeout: Callable[[], float]):
        self.registry = registry
        self.loop = loop
        self.timeout = timeout
        self._snapshots: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._lock = threading.Lock()

    def list_agents(self, selector: Selector) -> dict[str, Any]:
        agents = [agent_view(a) for a in self.registry.agents() if selector.matches(a)]
        return {"agents": agents}

    def run(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        endpoint = ENDPOINTS[path]
        unknown = set(body) - set(SELECTOR_FIELDS) - endpoint.fields
        if unknown:
            known = sorted(set(SELECTOR_FIELDS) | endpoint.fields)
            raise AdminError(400, f"unknown field {sorted(unknown)[0]!r} (known: "
                                  f"{', '.join(known)})")
        selector = Selector.parse(body)
        command = build_command(endpoint, body)
        targets = [a for a in self.registry.agents()
                   if a.connected and a.session is not None and selector.matches(a)]
        if not targets:
            raise AdminError(404, f"no connected agent matches {selector.describe() or 'any'}")
        timeout = self.timeout()
        future = asyncio.run_coroutine_threadsafe(self._dispatch(targets, command, timeout),
                                                  self.loop)
        outcomes = future.result(timeout + 5.0)
        results = [self._result_view(state, outcome) for state, outcome in outcomes]
        return {"command": endpoint.command, "selector": selector.describe(),
                "selected": len(targets), "ok": all(r["status"] == "ok" for r in results),
                "results": results}

    async def _dispatch(self, targets: list[AgentState], command: pb.Command, timeout: float
                        ) -> list[tuple[AgentState, Outcome]]:
        outcomes = await asyncio.gather(*(send_command(s.session, command, timeout)
                                          for s in targets))
        return list(zip(targets, outcomes, strict=True))

    def _result_view(self, state: AgentState, outcome: Outcome) -> dict[str, Any]:
        if not isinstance(outcome, str) and outcome.snapshot_path:
            # Only files an agent reported through this API are ever served.
            with self._lock:
                self._snapshots[Path(outcome.snapshot_path).name] = outcome.snapshot_path
                while len(self._snapshots) > SNAPSHOTS_KEPT:
                    self._snapshots.popitem(last=False)
        return result_view(state, outcome)

    def snapshot_bytes(self, name: str) -> bytes:
        """A snapshot an agent reported through this API (no other file is ever served)."""
        with self._lock:
            path = self._snapshots.get(name)
        if path is None:
            raise AdminError(404, f"no snapshot named {name!r} was taken through this sidecar")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as err:
            raise AdminError(409, f"cannot read {path}: {err.strerror} (the sidecar needs read "
                                  "access to the agents' snapshot directory)") from None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_SNAPSHOT_BYTES:
                raise AdminError(409, f"{path} is not a regular file of at most "
                                      f"{MAX_SNAPSHOT_BYTES} bytes")
            return f.read(MAX_SNAPSHOT_BYTES)
