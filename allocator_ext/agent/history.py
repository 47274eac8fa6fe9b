"""A snapshot whose memory history began with memory in use, made to begin from an empty
allocator.

History switched on in a running job (`allocwatch ctl record-history start`), or a ring buffer
that wrapped, starts with segments already mapped and blocks already allocated; a replay of
such a trace cannot know them (`allocwatch replay` refuses it). The snapshot holds the state at
its end, though, and the trace says what changed since the history began: undoing the trace
from the end state, newest entry first, gives the state at the first entry. That state goes in
front of the trace as entries of its own, at the first entry's time, marked in `user_metadata`:
one segment allocation (or mapping, for expandable segments) per mapped range, then one
allocation per live block (and the free request of a block whose free was pending). PyTorch's
memory viewer reads it as before, with those allocations at the start.
"""

from __future__ import annotations

import dataclasses
from typing import Any

PROLOGUE = "allocwatch: in use when the history began"
MAPS = ("segment_alloc", "segment_map")
UNMAPS = ("segment_free", "segment_unmap")


@dataclasses.dataclass
class _Range:
    lo: int
    hi: int
    stream: int
    expandable: bool


class _Mapped:
    """Mapped address ranges, with the stream and kind of the segment each belongs to."""

    def __init__(self) -> None:
        self.ranges: list[_Range] = []

    def add(self, lo: int, hi: int, stream: int, expandable: bool) -> None:
        self.remove(lo, hi)
        self.ranges.append(_Range(lo, hi, stream, expandable))

    def remove(self, lo: int, hi: int) -> None:
        kept: list[_Range] = []
        for r in self.ranges:
            if r.hi <= lo or r.lo >= hi:
                kept.append(r)
                continue
            if r.lo < lo:
                kept.append(dataclasses.replace(r, hi=lo))
            if r.hi > hi:
                kept.append(dataclasses.replace(r, lo=hi))
        self.ranges = kept

    def merged(self) -> list[_Range]:
        """In address order; adjacent mapped ranges of expandable segments joined (a segment
        of fixed size stays one allocation of its own, as the driver gave it)."""
        out: list[_Range] = []
        for r in sorted(self.ranges, key=lambda r: r.lo):
            last = out[-1] if out else None
            if (last is not None and last.hi == r.lo and last.stream == r.stream
                    and last.expandable and r.expandable):
                last.hi = r.hi
            else:
                out.append(dataclasses.replace(r))
        return out


def _state_at_start(segments: list[dict[str, Any]], trace: list[dict[str, Any]]
                    ) -> tuple[_Mapped, dict[int, tuple[int, int]], dict[int, tuple[int, int]]]:
    mapped = _Mapped()
    live: dict[int, tuple[int, int]] = {}      # address -> (size, stream): allocated
    pending: dict[int, tuple[int, int]] = {}   # freed, waiting for its stream's events
    for seg in segments:
        stream = int(seg.get("stream", 0))
        mapped.add(seg["address"], seg["address"] + seg["total_size"], stream,
                   bool(seg.get("is_expandable", False)))
        for block in seg.get("blocks", []):
            # A trace entry's size is what was asked for (a replay asks for it again).
            asked = block.get("requested_size") or block["size"]
            if block["state"] == "active_allocated":
                live[block["address"]] = (asked, stream)
            elif block["state"] == "active_pending_free":
                pending[block["address"]] = (asked, stream)
    for entry in reversed(trace):
        action, addr, size = entry.get("action"), entry.get("addr", 0), entry.get("size", 0)
        stream = int(entry.get("stream", 0))
        if action in MAPS:
            mapped.remove(addr, addr + size)
        elif action in UNMAPS:
            mapped.add(addr, addr + size, stream, action == "segment_unmap")
        elif action == "alloc":
            live.pop(addr, None)
        elif action == "free_requested":
            pending.pop(addr, None)
            live[addr] = (size, stream)
        elif action == "free_completed":
            pending[addr] = (size, stream)
    return mapped, live, pending


def _entry(action: str, addr: int, size: int, stream: int, time_us: int) -> dict[str, Any]:
    return {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": time_us,
            "frames": [], "user_metadata": PROLOGUE}


def prologue(segments: list[dict[str, Any]], trace: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The entries that bring an empty allocator to the state where `trace` begins."""
    if not trace:
        return []
    mapped, live, pending = _state_at_start(segments, trace)
    when = int(trace[0].get("time_us", 0))
    entries = [_entry("segment_map" if r.expandable else "segment_alloc", r.lo, r.hi - r.lo,
                      r.stream, when) for r in mapped.merged()]
    for addr, (size, stream) in sorted({**live, **pending}.items()):
        entries.append(_entry("alloc", addr, size, stream, when))
    for addr, (size, stream) in sorted(pending.items()):
        entries.append(_entry("free_requested", addr, size, stream, when))
    return entries


def with_starting_state(snapshot: dict[str, Any]) -> dict[str, Any]:
    """The snapshot with each device's history preceded by the state it began from (a copy;
    unchanged where a history began from an empty allocator or there is no history)."""
    traces = snapshot.get("device_traces") or []
    if not any(traces):
        return snapshot
    out = dict(snapshot)
    out["device_traces"] = []
    for device, trace in enumerate(traces):
        # One allocator's snapshot has one trace whatever its device's index; PyTorch's has one
        # per device, in device order.
        segments = [s for s in snapshot.get("segments", [])
                    if len(traces) == 1 or s.get("device", 0) == device]
        out["device_traces"].append(prologue(segments, list(trace)) + list(trace))
    return out
