"""Which labels each agent's series go under, and what happens when two agents' coincide.

An agent's series are labelled rank, local_rank, cuda_device, gpu_uuid (DESIGN.md, "Metric
names"). Two live processes can share all four: two scripts without a rank in one pod, on one
GPU. Both are accepted; the second (and any later one) gets a label of its own,
`agent_slot="2"` (then "3", ...), so that neither hides the other and `sum()` counts both. The
first keeps the plain labels, so a job without clashes never sees the label. Each agent placed
beside a rival is counted once (allocwatch_agent_series_collisions_total) and logged with a few
of its rivals' keys; the info series carries the same agent_slot, so `pid` and `host` tell them
apart.

A departed agent (not yet expired) holds no slot against a connected one: a restarted
process takes over its predecessor's labels, as it should, and is not a collision.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable

from allocator_ext.protocol import metrics
from allocator_ext.protocol.proto.allocwatch.v1 import agent_pb2 as pb
from exporter.shared.logs import RateLimitedLog

log = logging.getLogger("exporter.registry")

SERIES_LABELS = list(metrics.SERIES_LABELS)
SLOT_LABEL = "agent_slot"

Labels = tuple[str, str, str, str]


def label_value(value: int) -> str:
    """An integer label: empty where unknown (-1)."""
    return str(value) if value >= 0 else ""


def agent_labels(identity: pb.Identity) -> Labels:
    """The labels of an agent's own series (last report, drops): its primary device."""
    return (label_value(identity.rank), label_value(identity.local_rank),
            label_value(identity.cuda_device), identity.gpu_uuid)


def device_labels(identity: pb.Identity, device: pb.DeviceReport) -> Labels:
    """The labels of one reported device's allocator series."""
    return (label_value(identity.rank), label_value(identity.local_rank),
            label_value(device.cuda_device), device.gpu_uuid)


def labels_of(identity: pb.Identity, report: pb.Report | None) -> frozenset[Labels]:
    devices = report.devices if report is not None else []
    return frozenset([agent_labels(identity), *(device_labels(identity, d) for d in devices)])


def with_slot(labels: Iterable[str], slot: int) -> dict[str, str]:
    """A series' label set: the four labels, and agent_slot where it is not the first."""
    named = dict(zip(SERIES_LABELS, labels, strict=True))
    if slot > 1:
        named[SLOT_LABEL] = str(slot)
    return named


@dataclasses.dataclass
class _Placement:
    labels: frozenset[Labels]
    slot: int
    live: bool  # connected: holds its slot in the groups of its label sets


class _Group:
    """The connected agents showing one label set: their slots, and a bit set of them (bit
    n - 1 for slot n)."""

    __slots__ = ("slots", "taken")

    def __init__(self) -> None:
        self.slots: dict[str, int] = {}  # agent key -> slot, in the order they were placed
        self.taken = 0


class SeriesSlots:
    """Slots of the agents (by key), given each one's label sets. Not thread-safe: the
    registry calls it under its lock, and tells it when an agent departs and when it expires.

    For each label set, the connected agents showing it and a bit set of the slots they hold:
    placing an agent joins the bit sets of its label sets (one per device it reports) and takes
    the lowest free slot, keeping the one it had where that is free. That costs the same for the
    thousandth agent of a label set as for the second (a few operations on bit sets of at most
    as many bits as there are agents, done in C): no pass over the rivals. A collision is
    counted once per agent placed beside a rival (not once per pair: a thousand agents of one
    label set are 999 collisions, not 499,500), and its warning, rate-limited, names a few of
    the rivals and how many there are (worked out only for the lines that go out)."""

    SHOWN_RIVALS = 3

    def __init__(self) -> None:
        self._placed: dict[str, _Placement] = {}
        self._groups: dict[Labels, _Group] = {}
        self._counted: set[str] = set()  # agents already counted as colliding
        self.collisions_total = 0
        self._lines = RateLimitedLog()

    def slot(self, key: str) -> int:
        placed = self._placed.get(key)
        return placed.slot if placed is not None else 1

    def place(self, key: str, labels: frozenset[Labels]) -> int:
        """The slot of connected agent `key` whose series carry `labels`. Changes only when
        the agent's labels change (a first report, a device used for the first time) or it
        comes back after departing and its slot was taken meanwhile."""
        placed = self._placed.get(key)
        if placed is not None and placed.live:
            if placed.labels == labels:
                return placed.slot
            self._release(key, placed)
        taken = 0
        for label_set in labels:
            group = self._groups.get(label_set)
            if group is not None:
                taken |= group.taken
        slot = placed.slot if placed is not None else 1
        if taken >> (slot - 1) & 1:
            slot = (~taken & (taken + 1)).bit_length()  # the lowest free
        for label_set in labels:
            group = self._groups.get(label_set)
            if group is None:
                group = self._groups[label_set] = _Group()
            group.slots[key] = slot
            group.taken |= 1 << (slot - 1)
        self._placed[key] = _Placement(labels, slot, live=True)
        if taken and key not in self._counted:
            self._counted.add(key)
            self.collisions_total += 1
            self._lines.log("series_collision", log, "agents' series labels coincide: both "
                            "accepted, told apart by agent_slot",
                            lambda: self._collision_fields(key, labels, slot))
        return slot

    def _collision_fields(self, key: str, labels: frozenset[Labels], slot: int
                          ) -> dict[str, object]:
        shared = sorted(label_set for label_set in labels
                        if len(self._groups[label_set].slots) > 1)
        rivals = {other for label_set in shared for other in self._groups[label_set].slots
                  if other != key}
        return {"agent": key, "others": sorted(rivals)[:self.SHOWN_RIVALS],
                "rivals": len(rivals), "agent_slot": slot,
                "labels": [dict(zip(SERIES_LABELS, s, strict=True))
                           for s in shared[:self.SHOWN_RIVALS]]}

    def _release(self, key: str, placed: _Placement) -> None:
        for label_set in placed.labels:
            group = self._groups[label_set]
            del group.slots[key]
            group.taken &= ~(1 << (placed.slot - 1))
            if not group.slots:
                del self._groups[label_set]
        placed.live = False

    def departed(self, key: str) -> None:
        """The agent disconnected: its slot is free for a connected agent (a restarted
        process takes over its predecessor's labels); it keeps it for its own series until
        it expires, and again when it comes back, where no other took it meanwhile."""
        placed = self._placed.get(key)
        if placed is not None and placed.live:
            self._release(key, placed)

    def forget(self, key: str) -> None:
        """The agent expired: its slot is free."""
        placed = self._placed.pop(key, None)
        if placed is not None and placed.live:
            self._release(key, placed)
        self._counted.discard(key)
