"""Properties that hold after any sequence of operations under any settings.

Hypothesis drives random programs (allocate, free, use on another stream, complete streams,
empty the cache, change settings, collect garbage) against the core on a capped simulated
device; after every step the allocator recounts itself (check_invariants): blocks in use never
overlap, every reserved byte belongs to exactly one block, free neighbours are coalesced, and
every statistic equals a recount.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import allocator_ext as ae

KiB, MiB = 1 << 10, 1 << 20

CONFIGS = st.sampled_from([
    None,
    "native",
    "native,expandable_segments:True",
    "native,max_split_size_mb:40",
    "native,garbage_collection_threshold:0.6",
    "native,roundup_power2_divisions:4",
    "expandable_large_page_mb:2",
    "expandable_grow_mb:20,reuse_free_pages:True",
    "expandable_large_page_mb:2,expandable_chunk_mb:20",
    "expandable_large_page_mb:2,expandable_chunk_mb:10",
    "alias_pages:True",
    "alias_pages:True,expandable_chunk_mb:2",
    "alias_pages:True,expandable_chunk_mb:4",
])
SIZES = st.one_of(
    st.integers(1, 64 * KiB),
    st.integers(64 * KiB, 2 * MiB),
    st.integers(2 * MiB, 12 * MiB),
    st.integers(12 * MiB, 90 * MiB),
)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("malloc"), SIZES, st.integers(0, 2)),
        st.tuples(st.just("free"), st.integers(0, 10**6), st.just(0)),
        st.tuples(st.just("record"), st.integers(0, 10**6), st.integers(0, 3)),
        st.tuples(st.just("complete"), st.integers(0, 3), st.just(0)),
        st.tuples(st.just("empty_cache"), st.just(0), st.just(0)),
        st.tuples(st.just("gc"), st.just(0), st.just(0)),
        st.tuples(st.just("set_config"), st.sampled_from([
            "expandable_segments:True", "expandable_segments:False", "max_split_size_mb:64",
            "garbage_collection_threshold:0.5", "alias_pages:True", "alias_pages:False"]),
            st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=CONFIGS, ops=OPS, capacity=st.sampled_from([0, 256 * MiB, 600 * MiB]))
def test_invariants_hold_after_every_operation(config, ops, capacity) -> None:
    dev = ae.SimDevice(capacity=capacity)
    a = ae.Allocator(dev, config)
    if capacity:
        a.set_memory_fraction(0.9)
    live: list[tuple[int, int, int]] = []    # (ptr, size, stream)
    for op, x, y in ops:
        if op == "malloc":
            try:
                p = a.malloc(x, y)
            except ae.OutOfMemoryError as e:
                assert "Tried to allocate" in str(e)
                assert e.requested == x
            else:
                assert a.block_size(p) >= x
                live.append((p, x, y))
        elif op == "free" and live:
            p, _, _ = live.pop(x % len(live))
            a.free(p)
        elif op == "record" and live:
            p, _, s = live[x % len(live)]
            a.record_stream(p, 100 + y)
        elif op == "complete":
            dev.complete_stream(100 + x)
            a.process_events()
        elif op == "empty_cache":
            a.empty_cache()
        elif op == "gc":
            a.garbage_collect()
        elif op == "set_config":
            a.set_config(x)
        assert a.check_invariants() == "", (op, x, y)
        # Blocks in use never overlap one another.
        spans = sorted((p, p + a.block_size(p)) for p, _, _ in live)
        assert all(e1 <= s2 for (_, e1), (s2, _) in zip(spans, spans[1:], strict=False))
    s = a.stats()
    assert s["allocation.all.current"] == len(live)
    assert s["requested_bytes.all.current"] >= sum(n for _, n, _ in live)
    # After freeing everything and emptying the cache, nothing stays reserved.
    for p, _, _ in live:
        a.free(p)
    a.empty_cache()
    s = a.stats()
    assert s["reserved_bytes.all.current"] == 0 and dev.used == 0
    assert s["pending_events"] == 0 and a.check_invariants() == ""


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(1, 30 * MiB), min_size=1, max_size=20),
       other=st.integers(1, 3))
def test_a_pending_block_is_reused_only_after_its_events_complete(sizes, other) -> None:
    dev = ae.SimDevice()
    a = ae.Allocator(dev, "native")
    ptrs = [a.malloc(n) for n in sizes]
    victim = ptrs[0]
    a.record_stream(victim, other)
    for p in ptrs:
        a.free(p)
    reused = [a.malloc(n) for n in sizes]
    assert victim not in reused          # still pending: the other stream may be using it
    for p in reused:
        a.free(p)
    states = {b["address"]: b["state"] for seg in a.snapshot()["segments"] for b in seg["blocks"]}
    assert states[victim] == "active_pending_free"
    dev.complete_stream(other)
    a.process_events()
    states = {b["address"]: b["state"] for seg in a.snapshot()["segments"] for b in seg["blocks"]}
    assert states[victim] == "inactive"  # back in the cache, free to be reused
