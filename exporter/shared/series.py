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

import logging
from collections.abc import Callable, Iterable

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


class SeriesSlots:
    """Slots of the agents (by key), given each one's label sets. Not thread-safe: the
    registry calls it under its lock.

    An index from each label set to the agents showing it finds an agent's rivals without
    looking at the others; a collision is counted once per agent placed beside a rival (not
    once per pair: a thousand agents of one label set are 999 collisions, not 499,500), and
    its warning (rate-limited) names a few of the rivals and how many there are."""

    SHOWN_RIVALS = 3

    def __init__(self) -> None:
        self._slot: dict[str, int] = {}
        self._labels: dict[str, frozenset[Labels]] = {}
        self._holders: dict[Labels, set[str]] = {}  # label set -> agents showing it
        self._counted: set[str] = set()  # agents already counted as colliding
        self.collisions_total = 0
        self._lines = RateLimitedLog()

    def slot(self, key: str) -> int:
        return self._slot.get(key, 1)

    def place(self, key: str, labels: frozenset[Labels],
              connected: Callable[[str], bool]) -> int:
        """The slot of agent `key` whose series carry `labels`; `connected(other)`: whether the
        registry's agent `other` is connected. Changes only when the agent's labels change (a
        first report, a device used for the first time)."""
        if self._labels.get(key) == labels and key in self._slot:
            return self._slot[key]
        self._unindex(key)
        self._labels[key] = labels
        rivals: set[str] = set()
        for label_set in labels:
            holders = self._holders.setdefault(label_set, set())
            rivals.update(other for other in holders if connected(other))
            holders.add(key)
        taken = {self._slot[other] for other in rivals if other in self._slot}
        slot = next(n for n in range(1, len(taken) + 2) if n not in taken)
        if rivals and key not in self._counted:
            self._counted.add(key)
            self.collisions_total += 1
            shown = sorted(rivals)[:self.SHOWN_RIVALS]
            shared = sorted(label_set for label_set in labels
                            if self._holders[label_set] & rivals)[:self.SHOWN_RIVALS]
            self._lines.log("series_collision", log, "agents' series labels coincide: both "
                            "accepted, told apart by agent_slot", {
                                "agent": key, "others": shown, "rivals": len(rivals),
                                "agent_slot": slot,
                                "labels": [dict(zip(SERIES_LABELS, s, strict=True))
                                           for s in shared]})
        self._slot[key] = slot
        return slot

    def _unindex(self, key: str) -> None:
        for label_set in self._labels.get(key, ()):
            holders = self._holders.get(label_set)
            if holders is not None:
                holders.discard(key)
                if not holders:
                    del self._holders[label_set]

    def forget(self, key: str) -> None:
        """The agent expired: its slot is free."""
        self._unindex(key)
        self._slot.pop(key, None)
        self._labels.pop(key, None)
        self._counted.discard(key)
