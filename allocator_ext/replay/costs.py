"""Pricing device calls: each kind costs a fixed part plus a part per byte.

The table lives in one place, ``allocator_ext/data/device_costs.json``, written by
``bench/native/device_call_costs`` on an H200 (its command and date are in the file). A replay
counts the simulated device's calls and prices them with it, so settings that fragment less but call
the device more pay for it in the report.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

# Simulated device counters -> cost table kinds. Event records and queries are left out: the
# call share measures what a setting asks of the driver to get memory, and PyTorch's rules make
# the same events for record_stream under every setting. alias_pages makes more (one at each
# free of memory that changes stream), host time this share does not show (docs/benchmarks.md,
# "Aliased pages").
COUNTER_TO_KIND = {
    "malloc": "segment_alloc",
    "free": "segment_free",
    "create": "create",
    "map": "map",
    "map_only": "map_only",
    "set_access": "set_access",
    "unmap": "unmap",
    "release": "release",
    "reserve": "reserve",
    "address_free": "address_free",
    "synchronize": "synchronize",
    "stream_synchronize": "synchronize",
    "event_synchronize": "synchronize",
    "stream_wait_event": "stream_wait_event",
}
# Calls made off the allocating thread (the unmaps of moved pages' old places, on the
# allocator's own thread: unmap_off_thread), priced as their kind but apart: the share measures
# the host time the training loop spends, and these cost it none.
OFF_THREAD = {"unmap_off_thread": "unmap"}


@dataclass(frozen=True)
class CallCost:
    fixed_s: float
    per_byte_s: float

    def price(self, count: int, nbytes: int) -> float:
        return count * self.fixed_s + nbytes * self.per_byte_s


@dataclass(frozen=True)
class CostTable:
    calls: dict[str, CallCost]
    source: str

    def price(self, counters: dict[str, dict[str, int]]) -> tuple[float, dict[str, dict[str, Any]]]:
        """Returns the estimate in seconds of the allocating thread's calls and, per kind,
        count, bytes and seconds; the calls made off that thread (OFF_THREAD) under their own
        names, outside the estimate."""
        by_kind: dict[str, dict[str, Any]] = {}
        for table in (COUNTER_TO_KIND, OFF_THREAD):
            for counter, kind in table.items():
                c = counters.get(counter)
                if not c:
                    continue
                name = counter if table is OFF_THREAD else kind
                entry = by_kind.setdefault(name, {"count": 0, "bytes": 0, "seconds": 0.0})
                entry["count"] += c["count"]
                entry["bytes"] += c["bytes"]
                cost = self.calls.get(kind)
                if cost is not None:
                    entry["seconds"] += cost.price(c["count"], c["bytes"])
        return sum(e["seconds"] for k, e in by_kind.items() if k not in OFF_THREAD), by_kind


def load_cost_table(path: str | Path | None = None) -> CostTable:
    if path is None:
        text = resources.files("allocator_ext").joinpath("data/device_costs.json").read_text()
        source = "allocator_ext/data/device_costs.json"
    else:
        text = Path(path).read_text()
        source = str(path)
    data = json.loads(text)
    calls = {
        kind: CallCost(float(v["fixed_s"]), float(v["per_byte_s"]))
        for kind, v in data["calls"].items()
    }
    return CostTable(calls, f"{source} ({data.get('device', '?')}, {data.get('measured_on', '?')})")
