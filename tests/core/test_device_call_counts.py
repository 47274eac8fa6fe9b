"""num_device_calls.*: every call the allocator makes of its device, by kind (counted_device.h).

PyTorch's num_device_alloc and num_device_free count mappings; a page move maps and unmaps each
of its pages, so the calls are what says what moving cost the host. Checked against the
simulated device's own counters, which see every call whoever makes it."""

from __future__ import annotations

import pytest
from support.paths import RECORDED_TRACES

import allocator_ext as ae
from allocator_ext.replay import load_trace
from allocator_ext.replay.replayer import Replayer

MiB = 1 << 20
H200 = 143771566080


def expected(sim: dict[str, dict[str, int]]) -> dict[str, int]:
    """The allocator's counts as the simulated device counts them: its `map` maps and grants
    access in one call, `map_only` maps one allocation of a range, `set_access` grants a range."""
    n = {k: v["count"] for k, v in sim.items()}
    return {
        "segment_alloc": n.get("malloc", 0), "segment_free": n.get("free", 0),
        "reserve": n.get("reserve", 0), "address_free": n.get("address_free", 0),
        "create": n.get("create", 0), "release": n.get("release", 0),
        "map": n.get("map", 0) + n.get("map_only", 0),
        "set_access": n.get("map", 0) + n.get("set_access", 0),
        "unmap": n.get("unmap", 0) + n.get("unmap_off_thread", 0),  # either thread's
        "event_record": n.get("event_record", 0), "event_query": n.get("event_query", 0),
    }


def counted(a: ae.Allocator) -> dict[str, int]:
    prefix = "num_device_calls."
    return {k.removeprefix(prefix): v for k, v in a.stats().items() if k.startswith(prefix)}


@pytest.mark.parametrize("config, fraction", [
    (None, None),                     # page moves between two streams, in chunks and pages
    (None, 1.5),                      # under a fraction: single pages, each moved one by one
    ("native", None),                 # PyTorch's rules: plain segments, cudaMalloc and cudaFree
    ("alias_pages:True", None),       # events at frees of pages that change stream
])
def test_every_call_the_device_gets_is_counted_by_kind(config: str | None,
                                                       fraction: float | None) -> None:
    trace = load_trace(RECORDED_TRACES / "stream_pipeline__default_lockstep.pickle.gz")
    r = Replayer(trace, config=config, device_memory=H200 if fraction else 0,
                 memory_fraction=None if fraction is None else
                 int(fraction * 80 * MiB) / H200)
    r.run_pass(release=True)
    r.allocator.empty_cache()
    assert counted(r.allocator) == expected(r.device.counters())
    assert sum(counted(r.allocator).values()) > 0


def test_a_page_move_is_a_call_a_page_where_the_mapping_counts_are_one() -> None:
    # 40 MiB freed on one stream, taken by another stream's 40 MiB growth under a fraction that
    # leaves no room to create: one mapping each way, twenty pages mapped and unmapped.
    dev = ae.SimDevice(capacity=1 << 30)
    a = ae.Allocator(dev)
    a.set_memory_fraction(48 * MiB / (1 << 30))
    x = a.malloc(40 * MiB, stream=0)
    a.free(x)
    before = a.stats()
    a.malloc(40 * MiB, stream=1)
    dev.synchronize()
    a.process_events()                                 # the old mapping goes once it is safe
    after = a.stats()
    delta = {k: after[k] - before[k] for k in after if k.startswith("num_device")}
    assert delta["num_device_alloc"] == delta["num_device_free"] == 1
    assert delta["num_device_calls.map"] == delta["num_device_calls.unmap"] == 20
    assert delta["num_device_calls.create"] == 0


def test_reset_accumulated_stats_starts_the_counts_again() -> None:
    a = ae.Allocator(ae.SimDevice())
    a.free(a.malloc(3 * MiB))
    assert counted(a)["create"] > 0
    a.reset_accumulated_stats()
    assert set(counted(a).values()) == {0}
