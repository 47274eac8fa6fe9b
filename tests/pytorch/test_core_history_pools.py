"""What the native back end needs of the core, on the simulated device: contexts and observers
of the history, private pools for torch.cuda.MemPool (use counts, plain segments, no-split,
releasing a pool's cache), CUDA graph trees' checkpoints and live-allocation checks, and which
allocation a pointer belongs to. Each test checks the core's own invariants at the end."""

from __future__ import annotations

import pytest

import allocator_ext as ae
from allocator_ext import _core

MiB = 1 << 20
POOL = (0, 7)


def allocator(config: str = "native", capacity: int = 0) -> ae.Allocator:
    return ae.Allocator(ae.SimDevice(capacity=capacity), config)


def pool_segments(a: ae.Allocator, pool: tuple[int, int]) -> list[dict]:
    return [s for s in a.snapshot()["segments"] if tuple(s["segment_pool_id"]) == pool]


def layout(a: ae.Allocator, pool: tuple[int, int]) -> list[tuple[int, int, list[tuple[int, str]]]]:
    return [(s["address"], s["total_size"], [(b["size"], b["state"]) for b in s["blocks"]])
            for s in pool_segments(a, pool)]


def in_pool(a: ae.Allocator, pool: tuple[int, int], *sizes: int) -> list[int]:
    """Allocations in a private pool, as a CUDA graph's capture makes them (the pool is made
    with one use, the graph's, if it does not exist yet)."""
    a.begin_allocate_to_pool(pool, 0)
    try:
        return [a.malloc(size) for size in sizes]
    finally:
        a.end_allocate_to_pool(pool)


def in_mempool(a: ae.Allocator, pool: tuple[int, int], *sizes: int) -> list[int]:
    """The same under torch.cuda.use_mem_pool: its use ends with the block."""
    try:
        return in_pool(a, pool, *sizes)
    finally:
        a.release_pool(pool)


# --- history ---------------------------------------------------------------------------------

def test_a_calls_context_goes_with_every_entry_it_records() -> None:
    a = allocator()
    a.record_history(True)
    p = a.malloc(4 * MiB, context="step 1")
    a.free(p, context="step 2")
    entries = [(e["action"], e.get("context")) for e in a.trace()]
    assert entries == [("segment_alloc", "step 1"), ("alloc", "step 1"),
                       ("free_requested", "step 2"), ("free_completed", "step 2")]
    a.malloc(4 * MiB)  # no context: none recorded, and the last one does not linger
    assert "context" not in a.trace()[-1]
    assert a.check_invariants() == ""


def test_observers_see_every_event_whether_recorded_or_not() -> None:
    a = allocator()
    seen: list[tuple[str, int]] = []
    a.add_trace_observer(lambda e: seen.append((e["action"], e["size"])))
    p = a.malloc(3 * MiB)
    assert seen == [("segment_alloc", 20 * MiB), ("alloc", 3 * MiB)]
    assert a.trace() == []  # recording is off: observers only
    a.free(p)
    a.empty_cache()
    assert [action for action, _ in seen[2:]] == ["free_requested", "free_completed",
                                                  "segment_free"]


def test_an_observer_that_fails_breaks_nothing() -> None:
    a = allocator()

    def broken(entry: dict) -> None:
        raise RuntimeError("observer bug")

    a.add_trace_observer(broken)
    p = a.malloc(MiB)
    a.free(p)
    assert a.stats()["allocated_bytes.all.current"] == 0
    assert a.check_invariants() == ""


def test_skipped_actions_stay_out_of_the_history_but_reach_observers() -> None:
    a = allocator()
    seen: list[str] = []
    a.add_trace_observer(lambda e: seen.append(e["action"]))
    a.record_history(True)
    a.set_trace_skipped(["alloc", "free_requested"])
    a.free(a.malloc(MiB))
    assert [e["action"] for e in a.trace()] == ["segment_alloc", "free_completed"]
    assert seen == ["segment_alloc", "alloc", "free_requested", "free_completed"]
    with pytest.raises(ValueError, match="unknown trace action"):
        a.set_trace_skipped(["allocate"])


def test_clear_history_keeps_recording() -> None:
    a = allocator()
    a.record_history(True)
    a.malloc(MiB)
    a.clear_history()
    assert a.trace() == []
    a.malloc(MiB)
    assert [e["action"] for e in a.trace()] == ["alloc"]


# --- private pools for torch.cuda.MemPool ----------------------------------------------------

def test_a_pool_is_shared_and_released_by_use_counts() -> None:
    a = allocator()
    assert a.pool_use_count(POOL) == 0
    a.create_or_incref_pool(POOL)           # torch.cuda.MemPool()
    a.begin_allocate_to_pool(POOL, 0)       # use_mem_pool: enter
    assert a.pool_use_count(POOL) == 2
    a.end_allocate_to_pool(POOL)
    a.release_pool(POOL)                    # use_mem_pool: exit
    assert a.pool_use_count(POOL) == 1
    a.release_pool(POOL)                    # the MemPool is deleted
    assert a.pool_use_count(POOL) == 0
    with pytest.raises(RuntimeError, match="already released"):
        a.create_or_incref_pool(POOL)


def test_a_mempool_has_plain_segments_even_with_expandable_segments() -> None:
    a = allocator(config="")  # allocwatch's defaults: expandable segments
    a.create_or_incref_pool(POOL, plain_segments=True)
    in_mempool(a, POOL, 80 * MiB, 80 * MiB)
    segments = pool_segments(a, POOL)
    assert [s["total_size"] for s in segments] == [80 * MiB, 80 * MiB]  # one device allocation each
    assert not any(s["is_expandable"] for s in segments)
    # Outside the pool, expandable segments as configured.
    a.malloc(80 * MiB)
    assert [s["is_expandable"] for s in pool_segments(a, (0, 0))] == [True]
    assert a.check_invariants() == ""


def test_a_no_split_pool_gives_each_request_a_segment_of_its_own() -> None:
    a = allocator()
    a.create_or_incref_pool((0, 1), plain_segments=True)
    a.create_or_incref_pool((0, 2), plain_segments=True)
    a.set_pool_no_split((0, 2))
    in_mempool(a, (0, 1), 4 * MiB, 4 * MiB)
    in_mempool(a, (0, 2), 4 * MiB, 4 * MiB)
    assert [len(s["blocks"]) for s in pool_segments(a, (0, 1))] == [3]   # split: 4 + 4 + 12 MiB
    assert [len(s["blocks"]) for s in pool_segments(a, (0, 2))] == [1, 1]
    with pytest.raises(ValueError, match="no private pool"):
        a.set_pool_no_split((0, 99))
    assert a.check_invariants() == ""


def test_empty_pool_cache_releases_only_a_pool_nothing_uses() -> None:
    a = allocator()
    a.create_or_incref_pool(POOL, plain_segments=True)
    (p,) = in_mempool(a, POOL, 30 * MiB)
    a.free(p)
    assert a.empty_pool_cache(POOL) == 0          # still in use: kept
    assert len(pool_segments(a, POOL)) == 1
    a.release_pool(POOL)
    assert a.empty_pool_cache(POOL) == 30 * MiB   # as torch.cuda.MemPool's destructor does
    assert pool_segments(a, POOL) == []
    assert a.pool_use_count(POOL) == 0            # the pool is gone
    assert a.check_invariants() == ""


def test_a_pool_with_an_allocator_of_its_own_takes_its_segments_from_it_and_gives_them_back(
) -> None:
    # torch.cuda.MemPool(allocator=...): here the pool's allocator is a second simulated
    # device, in an address range of its own, whose counters show what it was asked.
    gpu, users = ae.SimDevice(), ae.SimDevice(index=5)
    a = ae.Allocator(gpu, "")  # allocwatch's defaults: expandable segments elsewhere
    a.create_or_incref_pool(POOL, segments=users)
    small, large = in_mempool(a, POOL, MiB, 30 * MiB)
    assert users.counters()["malloc"] == {"count": 2, "bytes": 2 * MiB + 30 * MiB}
    assert "malloc" not in gpu.counters()
    segments = pool_segments(a, POOL)
    assert sorted(s["total_size"] for s in segments) == [2 * MiB, 30 * MiB]
    assert not any(s["is_expandable"] for s in segments)
    assert {s["address"] for s in segments} == {small, large}
    # Counted as PyTorch counts them: reserved memory of this device.
    assert a.stats()["reserved_bytes.all.current"] == 32 * MiB
    a.free(small)
    a.free(large)
    a.empty_cache()  # the pool is in use: its cache stays
    assert "free" not in users.counters()
    a.release_pool(POOL)        # torch.cuda.MemPool's destructor
    a.empty_pool_cache(POOL)
    assert users.counters()["free"] == {"count": 2, "bytes": 32 * MiB}
    assert "free" not in gpu.counters() and a.pool_use_count(POOL) == 0
    assert a.stats()["reserved_bytes.all.current"] == 0
    assert a.check_invariants() == ""


def test_a_deleted_pools_segment_goes_back_to_its_allocator_once_its_tensor_is_freed() -> None:
    # PyTorch's test_mempool_empty_cache_inactive: the pool is deleted while a tensor made in
    # it lives; freeing the tensor then emptying the cache frees the segment through the pool's
    # allocator.
    users = ae.SimDevice(index=5)
    a = ae.Allocator(ae.SimDevice(), "native")
    a.create_or_incref_pool(POOL, segments=users)
    (x,) = in_mempool(a, POOL, 8 * MiB)
    a.release_pool(POOL)
    assert a.empty_pool_cache(POOL) == 0 and "free" not in users.counters()
    a.free(x)
    a.empty_cache()
    assert users.counters()["free"] == {"count": 1, "bytes": 20 * MiB}  # its 20 MiB segment
    assert a.pool_use_count(POOL) == 0
    with pytest.raises(RuntimeError, match="cannot be chosen again"):
        a.create_or_incref_pool((0, 8), segments=users)
        a.create_or_incref_pool((0, 8), segments=users)
    assert a.check_invariants() == ""


def test_a_request_about_to_run_out_takes_a_free_block_of_a_use_on_oom_pool() -> None:
    # PyTorch's test_mempool_limited_memory_with_allocator and
    # test_deleted_mempool_not_used_on_oom, under a memory fraction of 80 MiB.
    users = ae.SimDevice(index=5)
    a = ae.Allocator(ae.SimDevice(capacity=1 << 30), "native")
    a.set_memory_fraction(80 * MiB / (1 << 30))
    do_not_use, use = (0, 1), (0, 2)
    a.create_or_incref_pool(do_not_use, segments=users)
    a.create_or_incref_pool(use, segments=users)
    a.set_pool_use_on_oom(use, True)
    (first,) = in_mempool(a, do_not_use, 40 * MiB)
    (second,) = in_mempool(a, use, 40 * MiB)
    with pytest.raises(ae.OutOfMemoryError):
        a.malloc(40 * MiB)
    a.free(first)
    a.free(second)
    c = a.malloc(30 * MiB)  # from the use_on_oom pool's free block
    assert c == second
    with pytest.raises(ae.OutOfMemoryError):
        a.malloc(30 * MiB)  # not from the other pool
    a.free(c)
    (e,) = in_mempool(a, use, 20 * MiB)  # c went back to its pool
    assert e == second
    a.free(e)
    a.set_pool_use_on_oom(use, False)
    with pytest.raises(ae.OutOfMemoryError):
        a.malloc(30 * MiB)
    # A pool marked use_on_oom and then deleted is never used again; one made after it is.
    a.set_pool_use_on_oom(use, True)
    for pool in (do_not_use, use):
        a.release_pool(pool)
        a.empty_pool_cache(pool)
    assert users.counters()["free"]["count"] == 2
    fresh = (0, 3)
    a.create_or_incref_pool(fresh, segments=users)
    a.set_pool_use_on_oom(fresh, True)
    (whole,) = in_mempool(a, fresh, 80 * MiB)
    a.free(whole)
    b, c = a.malloc(20 * MiB), a.malloc(20 * MiB)
    assert {b, c} == {whole, whole + 20 * MiB}
    with pytest.raises(ValueError, match="no private pool"):
        a.set_pool_use_on_oom((0, 99), True)
    assert a.check_invariants() == ""


def test_live_allocations_of_a_pool_are_checked_exactly() -> None:
    a = allocator()
    x, y = in_pool(a, POOL, MiB, 2 * MiB)
    outside = a.malloc(MiB)
    assert a.check_pool_live_allocations(POOL, [x, y])
    assert not a.check_pool_live_allocations(POOL, [x])             # y is alive too
    assert not a.check_pool_live_allocations(POOL, [x, y, outside])  # not the pool's
    a.free(y)
    assert a.check_pool_live_allocations(POOL, [x])
    with pytest.raises(ValueError, match="no private pool"):
        a.check_pool_live_allocations((5, 0), [])


# --- checkpoints (CUDA graph trees) ----------------------------------------------------------

@pytest.mark.parametrize("config", ["native", ""], ids=["plain", "expandable"])
def test_restoring_a_checkpoint_brings_the_layout_and_addresses_back(config: str) -> None:
    a = allocator(config=config)
    kept = in_pool(a, POOL, 512, 4096, 512, 3 * MiB, 512)
    for p in kept[1::2]:
        a.free(p)
    before = layout(a, POOL)
    checkpoint = a.checkpoint_pool(POOL)
    assert [len(s["blocks"]) for s in checkpoint.segments] == [len(s[2]) for s in before]
    # The pool changes: its blocks are freed, others allocated where they were.
    for p in kept[0::2]:
        a.free(p)
    later = in_pool(a, POOL, 2048, 2 * MiB)  # within the pool's segments
    restored = a.restore_pool(checkpoint)
    assert sorted(restored["freed"]) == sorted(later)
    assert [p for p, _ in restored["allocated"]] == sorted(kept[0::2])
    assert layout(a, POOL)[: len(before)] == before
    assert a.check_pool_live_allocations(POOL, kept[0::2])
    for p, _ in restored["allocated"]:  # the caller owns them now
        a.free(p)
    assert a.check_invariants() == ""


def test_a_checkpoint_restores_over_pages_mapped_since() -> None:
    a = allocator(config="")  # expandable: growth after the checkpoint extends the range
    (x,) = in_pool(a, POOL, 4 * MiB)
    checkpoint = a.checkpoint_pool(POOL)
    grown = in_pool(a, POOL, 6 * MiB)
    restored = a.restore_pool(checkpoint)
    assert restored["freed"] == [x] + grown
    assert restored["allocated"] == [(x, 4 * MiB)]
    assert a.check_pool_live_allocations(POOL, [x])
    assert a.check_invariants() == ""


def test_a_checkpoint_cannot_be_restored_over_a_segment_that_is_gone() -> None:
    a = allocator()
    a.create_or_incref_pool(POOL, plain_segments=True)
    (x,) = in_mempool(a, POOL, 30 * MiB)
    checkpoint = a.checkpoint_pool(POOL)
    a.free(x)
    a.release_pool(POOL)
    a.create_or_incref_pool((0, 8), plain_segments=True)
    a.empty_pool_cache(POOL)
    with pytest.raises(ValueError, match="no private pool"):
        a.restore_pool(checkpoint)
    # Same pool, segment released: say which segment.
    a2 = allocator()
    (y,) = in_pool(a2, POOL, 30 * MiB)
    checkpoint2 = a2.checkpoint_pool(POOL)
    a2.free(y)
    a2.release_pool(POOL)
    a2.empty_cache()  # the pool's memory goes back to the device
    a2.begin_allocate_to_pool(POOL, 0)  # a new pool of the same id
    a2.end_allocate_to_pool(POOL)
    with pytest.raises(RuntimeError, match="no longer one free range"):
        a2.restore_pool(checkpoint2)


def test_a_block_waiting_for_another_stream_cannot_be_checkpointed() -> None:
    dev = ae.SimDevice()
    a = ae.Allocator(dev, "native")
    (x,) = in_pool(a, POOL, MiB)
    a.record_stream(x, 9)
    a.free(x)  # pending until stream 9's work is done
    with pytest.raises(RuntimeError, match="waits for another stream"):
        a.checkpoint_pool(POOL)
    dev.complete_stream(9)
    assert a.checkpoint_pool(POOL).segments[0]["blocks"][0][3] is False


# --- what a pointer belongs to ---------------------------------------------------------------

def test_segment_of_is_the_whole_plain_segment_or_the_expandable_block() -> None:
    a = allocator()
    x, y = a.malloc(2 * MiB), a.malloc(3 * MiB)  # both carved from one 20 MiB segment
    assert a.segment_of(y) == (x, 20 * MiB, False)
    e = allocator(config="")
    z = e.malloc(3 * MiB)
    assert e.segment_of(z) == (z, 3 * MiB, True)
    assert a.segment_of(x + 512) == (0, 0, False)  # not a block's address


# --- settings from PyTorch -------------------------------------------------------------------

def test_pytorch_settings_split_into_ours_and_pytorchs_own() -> None:
    known, others = _core.known_settings(
        "expandable_segments:True,per_process_memory_fraction:0.5,"
        "roundup_power2_divisions:[256:1,>:4],graph_capture_record_stream_reuse:True")
    assert known == "expandable_segments:True,roundup_power2_divisions:[256:1,>:4]"
    assert others == [("per_process_memory_fraction", "0.5"),
                      ("graph_capture_record_stream_reuse", "True")]
    assert ae.parse_config(known)["expandable_segments"] is True


def test_a_segment_free_reaches_observers_while_the_segment_still_exists() -> None:
    """NCCL's trace tracker deregisters a segment from its communicators on SEGMENT_FREE, so
    the entry comes before the device frees the memory, as PyTorch records it before cudaFree."""
    device = ae.SimDevice()
    a = ae.Allocator(device, "native")
    used_at_free: list[int] = []
    a.add_trace_observer(
        lambda e: used_at_free.append(device.used) if e["action"] == "segment_free" else None)
    a.free(a.malloc(3 * MiB))
    held = device.used
    a.empty_cache()
    assert held >= 20 * MiB and used_at_free == [held]
    assert device.used == held - 20 * MiB
