"""The allocator's rules, one behaviour per test, on the simulated device.

Settings "native" are PyTorch's defaults: these tests pin down that the core behaves as
PyTorch's CUDA caching allocator does (c10/cuda/CUDACachingAllocator.cpp).
"""

from __future__ import annotations

import threading
import time

import pytest
from support.page_steps import MOVING, STEP_AMONG_HOLES, calls, host_waits, looped_step_page_calls

import allocator_ext as ae

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def native(capacity: int = 0, config: str = "native") -> tuple[ae.SimDevice, ae.Allocator]:
    dev = ae.SimDevice(capacity=capacity)
    return dev, ae.Allocator(dev, config)


# --- sizes and pools -------------------------------------------------------------------------

@pytest.mark.parametrize("request_size,rounded", [
    (1, 512), (512, 512), (513, 1024), (1000, 1024), (1 * MiB + 1, 1 * MiB + 512),
])
def test_requests_round_up_to_512_bytes(request_size: int, rounded: int) -> None:
    assert ae.round_size(request_size) == rounded
    _, a = native()
    p = a.malloc(request_size)
    assert a.block_size(p) == rounded


@pytest.mark.parametrize("request_size", [(1 << 64) - 1, (1 << 64) - 512, (1 << 63) + 1])
def test_a_request_beyond_any_device_is_refused_not_wrapped(request_size: int) -> None:
    # Rounded up, it would wrap past 2**64 to a small size: a huge request, a tiny block.
    with pytest.raises(ValueError, match=f"a request of {request_size} bytes is larger than"):
        ae.round_size(request_size)
    dev, a = native(config="native,roundup_power2_divisions:4")
    with pytest.raises(ValueError, match="larger than any device"):
        a.malloc(request_size)
    assert a.stats()["allocation.all.allocated"] == 0 and calls(dev, "malloc") == 0
    assert ae.round_size(1 << 63) == 1 << 63  # the largest served


def test_roundup_power2_divisions_rounds_to_the_next_division() -> None:
    # 1.2 GiB lies between 1 and 2 GiB; 4 divisions step by 256 MiB: 1.25 GiB.
    _, a = native(config="native,roundup_power2_divisions:4")
    p = a.malloc(int(1.2 * GiB))
    assert a.block_size(p) == GiB + 256 * MiB


@pytest.mark.parametrize("request_size,segment", [
    (512, 2 * MiB),            # small pool: 2 MiB segments
    (1 * MiB, 2 * MiB),        # 1 MiB is still small
    (1 * MiB + 512, 20 * MiB),  # 1-10 MiB: carved from 20 MiB segments
    (9 * MiB, 20 * MiB),
    (10 * MiB, 10 * MiB),      # from 10 MiB on: own segment, rounded to 2 MiB
    (11 * MiB, 12 * MiB),
])
def test_segment_sizes_by_request(request_size: int, segment: int) -> None:
    dev, a = native()
    a.malloc(request_size)
    s = a.stats()
    assert s["reserved_bytes.all.current"] == segment == a.reserved_bytes
    assert s["num_device_alloc"] == 1
    pool = "small_pool" if request_size <= MiB else "large_pool"
    assert s[f"reserved_bytes.{pool}.current"] == segment


def test_small_requests_share_a_segment() -> None:
    dev, a = native()
    for _ in range(4):
        a.malloc(256 * KiB)
    assert calls(dev, "malloc") == 1
    assert a.stats()["allocated_bytes.small_pool.current"] == 1 * MiB


# --- best fit, streams, split ----------------------------------------------------------------

def test_best_fit_takes_the_smallest_cached_block_that_fits() -> None:
    _, a = native()
    big, small = a.malloc(40 * MiB), a.malloc(30 * MiB)
    a.free(big)
    a.free(small)
    p = a.malloc(25 * MiB)
    assert p == small  # the 30 MiB block, not the 40 MiB one


def test_a_cached_block_is_reused_only_on_its_own_stream() -> None:
    dev, a = native()
    p = a.malloc(30 * MiB, stream=1)
    a.free(p)
    q = a.malloc(30 * MiB, stream=2)
    assert q != p
    assert calls(dev, "malloc") == 2
    assert a.malloc(30 * MiB, stream=1) == p


def test_large_blocks_split_only_when_the_remainder_exceeds_1_MiB() -> None:
    _, a = native()
    p = a.malloc(12 * MiB)            # 12 MiB segment
    a.free(p)
    q = a.malloc(11 * MiB)            # remainder 1 MiB: not split
    assert a.block_size(q) == 12 * MiB
    a.free(q)
    r = a.malloc(10 * MiB)            # remainder 2 MiB: split
    assert a.block_size(r) == 10 * MiB
    assert a.stats()["inactive_split_bytes.large_pool.current"] == 2 * MiB


def test_small_blocks_split_down_to_512_bytes() -> None:
    _, a = native()
    p = a.malloc(512)
    assert a.block_size(p) == 512
    assert a.stats()["inactive_split_bytes.small_pool.current"] == 2 * MiB - 512


def test_max_split_size_keeps_oversize_blocks_whole_and_away_from_small_requests() -> None:
    dev, a = native(config="native,max_split_size_mb:64")
    big = a.malloc(100 * MiB)
    a.free(big)
    small = a.malloc(30 * MiB)        # below max_split_size: never takes the 100 MiB block
    assert small != big
    assert calls(dev, "malloc") == 2
    a.free(small)
    near = a.malloc(90 * MiB)         # oversize request within 20 MiB of the block: takes it
    assert near == big
    assert a.block_size(near) == 100 * MiB  # and does not split it
    a.free(near)
    far = a.malloc(70 * MiB)          # oversize but 30 MiB smaller: max_non_split_rounding says no
    assert far != big


def test_max_non_split_rounding_widens_the_oversize_match() -> None:
    _, a = native(config="native,max_split_size_mb:64,max_non_split_rounding_mb:40")
    big = a.malloc(100 * MiB)
    a.free(big)
    assert a.malloc(70 * MiB) == big


def test_freed_neighbours_coalesce_into_one_block() -> None:
    _, a = native()
    blocks = [a.malloc(4 * MiB) for _ in range(5)]   # five blocks of one 20 MiB segment
    for p in blocks[::2] + blocks[1::2]:
        a.free(p)
    segs = a.snapshot()["segments"]
    assert len(segs) == 1
    assert [b["state"] for b in segs[0]["blocks"]] == ["inactive"]
    assert a.stats()["inactive_split_bytes.all.current"] == 0
    assert a.check_invariants() == ""


def test_segments_carry_the_order_they_were_created_in() -> None:
    # PyTorch's snapshot numbers segments as they are created (registration_counter), and NCCL
    # registers a pool's segments in that order, the same on every rank: a segment released
    # leaves a gap, one created later comes after all.
    _, a = native()
    first, middle, last = (a.malloc(100 * MiB) for _ in range(3))
    a.free(middle)
    a.empty_cache()
    later = a.malloc(100 * MiB)
    order = {s["address"]: s["registration_counter"] for s in a.snapshot()["segments"]}
    assert order == {first: 0, last: 2, later: 3}


def test_an_expandable_segments_ranges_share_its_place_in_the_order() -> None:
    dev = ae.SimDevice(capacity=GiB)
    a = ae.Allocator(dev)                         # allocwatch's defaults: expandable segments
    small = a.malloc(512)
    kept = [a.malloc(8 * MiB) for _ in range(3)]
    a.free(kept[1])
    a.empty_cache()                               # the middle pages go: two mapped ranges
    segments = a.snapshot()["segments"]
    large = [s["registration_counter"] for s in segments if s["segment_type"] == "large"]
    [small_order] = [s["registration_counter"] for s in segments if s["segment_type"] == "small"]
    assert len(large) == 2 and len(set(large)) == 1
    assert sorted([small_order, large[0]]) == [0, 1]
    a.free(small)


def test_a_split_block_and_its_merge_keep_best_fit_order() -> None:
    # The hot path changes a cached block in place when its new size still sorts where it is;
    # here it does not, and best fit must still see the true sizes.
    _, a = native()
    c = a.malloc(5 * MiB)             # one 20 MiB segment: c | guard | b | guard
    guard1 = a.malloc(2 * MiB)
    b = a.malloc(8 * MiB)
    guard2 = a.malloc(5 * MiB)
    a.free(c)
    a.free(b)                         # cached: 5 MiB (c), 8 MiB (b)
    front = a.malloc(6 * MiB)         # best fit: b, split; its 2 MiB rest sorts before c's 5
    assert front == b
    assert a.check_invariants() == ""
    rest = a.malloc(2 * MiB)          # best fit: the 2 MiB rest, not c
    assert rest == b + 6 * MiB
    a.free(rest)
    a.free(front)                     # merged back to 8 MiB: now sorts after c's 5
    assert a.check_invariants() == ""
    assert a.malloc(7 * MiB) == b     # only the merged 8 MiB block fits
    assert a.malloc(5 * MiB) == c
    assert a.check_invariants() == ""
    assert guard1 and guard2


def test_a_repeated_alloc_free_pair_reuses_one_block_and_keeps_counts() -> None:
    _, a = native(config="native,expandable_segments:True")
    first = a.malloc(64 * KiB)
    a.free(first)
    for _ in range(1000):
        p = a.malloc(64 * KiB)
        assert p == first
        a.free(p)
    s = a.stats()
    assert s["allocation.all.allocated"] == s["allocation.all.freed"] == 1001
    assert s["allocated_bytes.all.current"] == 0
    assert a.check_invariants() == ""


# --- cross-stream use ------------------------------------------------------------------------

def test_record_stream_keeps_a_block_pending_until_the_other_stream_is_done() -> None:
    dev, a = native()
    p = a.malloc(30 * MiB, stream=0)
    a.record_stream(p, 7)
    a.free(p)
    s = a.stats()
    assert s["pending_events"] == 1 and s["pending_free_bytes"] == 30 * MiB
    assert s["active_bytes.all.current"] == 30 * MiB   # still active: stream 7 may use it
    assert a.malloc(30 * MiB, stream=0) != p            # not reused yet
    dev.complete_stream(7)
    a.process_events()
    assert a.stats()["pending_events"] == 0
    assert a.malloc(30 * MiB, stream=0) == p
    assert a.check_invariants() == ""


def test_a_use_recorded_during_an_old_capture_does_not_excuse_a_later_block() -> None:
    # Uses recorded during a capture are remembered per block until its free; once that
    # capture is over they are ordinary uses. A record left behind for a freed block passed to
    # the next block made at its address, and that block, freed during another capture, went
    # back to the cache without waiting for its stream (found by a review's fuzzer).
    dev = ae.SimDevice(capacity=GiB)
    a = ae.Allocator(dev, "native")
    side = 5
    first = a.malloc(1000, 0)
    a.begin_allocate_to_pool((0, 1), 7)
    a.record_stream(first, side)               # recorded during a capture
    a.end_allocate_to_pool((0, 1))
    a.release_pool((0, 1))
    a.free(first)                              # freed after it: an ordinary event
    dev.complete_stream(side)
    a.process_events()
    second = a.malloc(1000, 0)
    a.record_stream(second, side)              # a new use, outside any capture
    a.begin_allocate_to_pool((0, 2), 7)
    a.free(second)                             # freed during a capture: its event comes later
    a.end_allocate_to_pool((0, 2))
    a.release_pool((0, 2))
    assert a.malloc(1000, 0) != second         # still in use on the side stream
    assert a.stats()["pending_events"] == 1
    assert a.check_invariants() == ""


def test_record_stream_on_the_allocation_stream_adds_nothing() -> None:
    _, a = native()
    p = a.malloc(MiB, stream=3)
    a.record_stream(p, 3)
    a.free(p)
    assert a.stats()["pending_events"] == 0


def test_empty_cache_waits_for_pending_blocks_and_releases_them() -> None:
    dev, a = native()
    p = a.malloc(30 * MiB)
    a.record_stream(p, 5)
    a.free(p)
    released = a.empty_cache()
    assert released == 30 * MiB
    s = a.stats()
    assert s["reserved_bytes.all.current"] == 0
    assert s["num_sync_all_streams"] == 1 and s["pending_events"] == 0


# --- out of memory ---------------------------------------------------------------------------

def test_out_of_memory_frees_cached_blocks_and_retries() -> None:
    dev, a = native(capacity=100 * MiB)
    p = a.malloc(60 * MiB)
    a.free(p)                         # cached, unsplit
    q = a.malloc(80 * MiB)            # does not fit beside it: release the cache, retry
    assert q
    s = a.stats()
    assert s["num_alloc_retries"] == 1 and s["num_ooms"] == 0
    assert s["reserved_bytes.all.current"] == 80 * MiB
    assert s["num_device_free"] == 1


def test_out_of_memory_error_explains_and_leaves_the_allocator_consistent() -> None:
    dev, a = native(capacity=100 * MiB)
    keep = a.malloc(60 * MiB)
    with pytest.raises(ae.OutOfMemoryError) as err:
        a.malloc(50 * MiB)
    msg = str(err.value)
    assert "Tried to allocate 50.00 MiB" in msg
    assert "total capacity of 100.00 MiB" in msg and "40.00 MiB is free" in msg
    assert "60.00 MiB is allocated" in msg
    assert isinstance(err.value, MemoryError)
    assert err.value.requested == 50 * MiB and err.value.reserved == 60 * MiB
    assert a.stats()["num_ooms"] == 1
    assert a.check_invariants() == ""
    a.free(keep)
    assert a.malloc(50 * MiB)  # and it carries on


# --- garbage collection ----------------------------------------------------------------------

def test_gc_needs_a_memory_fraction() -> None:
    dev, a = native(capacity=GiB, config="native,garbage_collection_threshold:0.5")
    for _ in range(3):
        a.free(a.malloc(300 * MiB))
        a.malloc(200 * MiB)
    assert a.stats()["num_gc_reclaims"] == 0


def test_gc_releases_aged_unsplit_large_blocks_once_reserved_passes_the_threshold() -> None:
    dev, a = native(capacity=GiB, config="native,garbage_collection_threshold:0.5")
    a.set_memory_fraction(1.0)        # allowed: 1 GiB, GC threshold: 512 MiB
    old = a.malloc(100 * MiB)
    a.free(old)                       # cached; ages with every lookup from now on
    a.malloc(300 * MiB)               # reserved 400 MiB: under the threshold, no GC
    young = a.malloc(200 * MiB)       # reserved 600 MiB
    a.free(young)                     # cached two lookups after `old`
    a.malloc(250 * MiB)               # no cached block fits: GC runs before the new segment
    s = a.stats()
    # Mean age is between the two; only `old` is at or above it, and releasing it is enough.
    assert s["num_gc_reclaims"] == 1
    assert s["gc_reclaimed_bytes"] == 100 * MiB
    assert s["reserved_bytes.all.current"] == (300 + 200 + 250) * MiB
    assert s["num_alloc_retries"] == 0
    assert a.check_invariants() == ""


def test_gc_never_touches_the_small_pool() -> None:
    dev, a = native(capacity=64 * MiB, config="native,garbage_collection_threshold:0.1")
    a.set_memory_fraction(1.0)
    smalls = [a.malloc(MiB) for _ in range(8)]
    for p in smalls:
        a.free(p)
    small_reserved = a.stats()["reserved_bytes.small_pool.current"]
    a.malloc(30 * MiB)
    assert a.stats()["reserved_bytes.small_pool.current"] == small_reserved


# --- empty_cache and expandable segments -----------------------------------------------------

@pytest.mark.parametrize("config", ["native", "native,expandable_segments:True", None])
def test_after_freeing_everything_empty_cache_brings_reserved_to_zero(config: str | None) -> None:
    dev = ae.SimDevice()
    a = ae.Allocator(dev, config)
    ptrs = [a.malloc(s) for s in (512, 3 * MiB, 50 * MiB, 700 * KiB, 25 * MiB)]
    for p in ptrs:
        a.free(p)
    a.empty_cache()
    assert a.stats()["reserved_bytes.all.current"] == 0
    assert dev.used == 0
    assert a.check_invariants() == ""


def test_expandable_segments_map_pages_on_demand_and_unmap_on_empty_cache() -> None:
    dev, a = native(config="native,expandable_segments:True")
    p = a.malloc(30 * MiB)
    q = a.malloc(30 * MiB)
    assert q == p + 30 * MiB           # one segment, grown in place
    assert calls(dev, "reserve") == 1
    assert a.stats()["reserved_bytes.all.current"] == 60 * MiB  # 20 MiB pages
    a.free(p)
    a.free(q)
    a.empty_cache()
    assert calls(dev, "unmap") >= 1 and calls(dev, "address_free") == 1
    assert dev.used == 0


# --- private pools (CUDA graphs) -------------------------------------------------------------

def test_allocations_during_capture_come_from_the_private_pool_and_stay_there() -> None:
    dev, a = native()
    outside = a.malloc(30 * MiB, stream=1)
    a.free(outside)
    a.begin_allocate_to_pool((1, 0), 1)
    captured = a.malloc(30 * MiB, stream=1)   # not the cached block of the general pool
    assert captured != outside
    a.free(captured)
    a.end_allocate_to_pool((1, 0))
    again = a.malloc(30 * MiB, stream=1)
    assert again == outside                    # the graph's block is not handed out
    a.free(again)
    snap = a.snapshot()
    assert {s["segment_pool_id"] for s in snap["segments"]} == {(0, 0), (1, 0)}
    a.release_pool((1, 0))
    a.empty_cache()
    assert a.stats()["reserved_bytes.all.current"] == 0


# --- misuse ----------------------------------------------------------------------------------

def test_freeing_an_unknown_pointer_is_refused_and_changes_nothing() -> None:
    _, a = native()
    p = a.malloc(MiB)
    before = a.stats()
    with pytest.raises(ValueError, match="did not hand out"):
        a.free(p + 512)
    a.free(p)
    with pytest.raises(ValueError, match="already freed"):
        a.free(p)
    assert a.stats()["allocation.all.current"] == 0
    assert before["allocation.all.current"] == 1


def test_an_explicit_reclaim_gives_back_free_pages_of_expandable_segments() -> None:
    dev = ae.SimDevice(capacity=GiB)
    a = ae.Allocator(dev, "garbage_collection_threshold:0.2")   # allocwatch's defaults + GC
    a.set_memory_fraction(1.0)
    ptrs = [a.malloc(100 * MiB) for _ in range(6)]
    for p in ptrs[1:]:
        a.free(p)                     # 500 MiB free in the expandable segment, 600 reserved
    released = a.garbage_collect()
    s = a.stats()
    assert released > 0 and s["num_gc_reclaims"] == 1
    assert s["reserved_bytes.all.current"] <= int(0.2 * GiB) + 20 * MiB   # down to the threshold
    assert s["allocated_bytes.all.current"] == 100 * MiB
    assert a.check_invariants() == ""


def test_largest_free_block_is_what_cudnn_may_use_for_its_workspace() -> None:
    _, a = native()
    assert a.largest_free_block() == 0                    # nothing cached yet
    big, small = a.malloc(50 * MiB), a.malloc(512 << 10)
    a.free(big)
    assert a.largest_free_block() == 50 * MiB
    a.free(small)                                          # small pool's blocks do not count
    assert a.largest_free_block() == 50 * MiB
    a.empty_cache()
    assert a.largest_free_block() == 0


def test_workspace_room_is_the_device_free_memory_or_the_largest_cached_block() -> None:
    # PyTorch's cacheInfo given no guess: cuDNN sizes its workspace by it for every
    # convolution it plans. Asked afresh every time (fresh_for 0) it is the device's answer.
    dev = ae.SimDevice(capacity=GiB)
    a = ae.Allocator(dev, "native")
    assert a.workspace_room(0.0) == GiB
    big = a.malloc(300 * MiB)
    assert a.workspace_room(0.0) == GiB - 300 * MiB
    a.free(big)                                        # cached: the device has 724 MiB free,
    dev.capacity = 400 * MiB                           # less now than the cached block
    assert a.workspace_room(0.0) == 300 * MiB


def test_workspace_room_asks_the_device_at_most_once_in_its_freshness_window() -> None:
    # Within the window the device's last answer stands, less what this allocator reserved
    # since and plus what it released; a change made by another process shows only once the
    # window has passed.
    dev = ae.SimDevice(capacity=GiB)
    a = ae.Allocator(dev, "native")
    assert a.workspace_room(3600.0) == GiB             # asks the device
    dev.capacity = 2 * GiB                             # another process freed memory
    p = a.malloc(200 * MiB)                            # this process reserves 200 MiB
    assert a.workspace_room(3600.0) == GiB - 200 * MiB
    a.free(p)
    a.empty_cache()                                    # ... and releases it
    assert a.workspace_room(3600.0) == GiB
    assert a.workspace_room(0.0) == 2 * GiB            # a fresh answer sees the other change


def test_growth_takes_back_wholly_free_pages_before_asking_the_device() -> None:
    # allocwatch's defaults: the small pool grows into pages the large pool no longer uses.
    dev = ae.SimDevice(capacity=GiB)
    a = ae.Allocator(dev)
    a.free(a.malloc(100 * MiB))               # 100 MiB of free large pages
    creates = dev.counters()["create"]["count"]
    smalls = [a.malloc(512 << 10) for _ in range(8)]
    s = a.stats()
    assert s["reserved_bytes.all.current"] < 100 * MiB   # large pages released for small ones
    assert dev.counters()["create"]["count"] - creates == 2
    assert a.check_invariants() == ""
    for p in smalls:
        a.free(p)


def test_pages_taken_from_another_streams_block_are_ordered_on_the_device() -> None:
    # Stream 1's free block gives its pages to stream 2 while stream 1 is still running: stream
    # 2 waits for stream 1 on the device (an event and cudaStreamWaitEvent); the host waits for
    # nothing, and the pages are mapped at their new place at once.
    dev = ae.SimDevice(capacity=GiB)
    a = ae.Allocator(dev)
    donor = a.malloc(60 * MiB, stream=1)
    live = a.malloc(40 * MiB, stream=2)
    a.free(donor)                                 # 60 MiB of free pages; the mark: 100
    grown = a.malloc(70 * MiB, stream=2)          # 60 of its 70 MiB moved from the donor
    s = a.stats()
    assert s["reserved_bytes.all.current"] == 110 * MiB
    assert host_waits(dev) == 0 and s["num_host_waits.device"] == 0
    assert s["num_host_waits.stream"] == s["num_host_waits.event"] == 0
    assert calls(dev, "stream_wait_event") == 1 and s["num_stream_waits"] == 1
    # Work stream 2 queues from now on runs after stream 1's: on the device, not the host.
    after_move = dev.record_event(2)
    dev.complete_stream(2)
    assert not dev.query_event(after_move)
    dev.complete_stream(1)
    dev.complete_stream(2)
    assert dev.query_event(after_move)
    a.free(grown)
    a.free(live)
    assert a.check_invariants() == ""


def test_moved_pages_are_unmapped_once_events_say_the_device_is_done() -> None:
    # The old mapping stays until events recorded at the move on every stream in use have
    # completed, found by polling on later allocations: never by waiting on the host.
    for donor_stream in (1, 2):
        dev = ae.SimDevice(capacity=GiB)
        a = ae.Allocator(dev)
        other = 3 - donor_stream
        a.malloc(512, stream=other)               # both streams have segments: both in use
        donor = a.malloc(60 * MiB, stream=donor_stream)
        live = a.malloc(40 * MiB, stream=2)
        a.free(donor)
        grown = a.malloc(70 * MiB, stream=2)
        assert calls(dev, "unmap") == 0, donor_stream
        assert a.stats()["pending_unmap_bytes"] == 60 * MiB, donor_stream
        a.process_events()                        # polls: the streams are still running
        assert calls(dev, "unmap") == 0, donor_stream
        assert a.check_invariants() == "", donor_stream
        dev.complete_stream(donor_stream)
        a.process_events()
        assert calls(dev, "unmap") == 0, donor_stream   # the other stream may still read it
        dev.complete_stream(other)
        a.process_events()
        assert calls(dev, "unmap") >= 1, donor_stream
        s = a.stats()
        assert s["pending_unmap_bytes"] == 0, donor_stream
        assert host_waits(dev) == 0, donor_stream
        assert s["reserved_bytes.all.current"] == 110 * MiB + 2 * MiB, donor_stream
        a.free(grown)
        a.free(live)
        assert a.check_invariants() == "", donor_stream


def move_80_mib_to_stream_2(a: ae.Allocator) -> int:
    """Stream 0's segment with 80 MiB free between blocks in use at its ends; a 100 MiB request
    of stream 2 moves those pages to its own segment (still mapped at stream 0's, until the
    device is done). Returns the request's address."""
    keep = a.malloc(20 * MiB)
    donor = a.malloc(60 * MiB)
    a.malloc(20 * MiB)                            # the segment's end stays in use
    a.free(donor)
    a.free(keep)
    return a.malloc(100 * MiB, stream=2)


def test_address_space_whose_pages_moved_is_not_reused_before_it_is_unmapped() -> None:
    # Until its old mapping goes, the range still shows the moved pages: growing into it then
    # would alias memory that another block now holds.
    a = ae.Allocator(ae.SimDevice(capacity=GiB))
    moved_to = move_80_mib_to_stream_2(a)
    assert a.stats()["pending_unmap_bytes"] > 0
    again = a.malloc(70 * MiB)                    # stream 0 grows: not into the pending range
    for p, size in ((moved_to, 100 * MiB), (again, 70 * MiB)):
        for q, other in ((moved_to, 100 * MiB), (again, 70 * MiB)):
            if p != q:
                assert p + size <= q or q + other <= p
    assert a.check_invariants() == ""


def test_a_moved_pages_old_place_is_unmapped_by_the_allocators_thread_not_the_allocating_one(
) -> None:
    # With a device that takes calls from any thread (CUDA's driver does), unmap_off_thread:True
    # hands the old place to the allocator's own thread once the events complete: the thread
    # that allocates never makes the unmap call, and the address space stays out of use until
    # that thread has made it.
    dev = ae.SimDevice(capacity=GiB)
    dev.set_unmap_thread("own")
    a = ae.Allocator(dev, "unmap_off_thread:True")
    moved_to = move_80_mib_to_stream_2(a)
    assert a.stats()["pending_unmap_bytes"] == 80 * MiB
    dev.hold_unmaps(True)                         # an unmap now blocks whoever makes it
    for stream in (0, 2):
        dev.complete_stream(stream)               # the device is done with the old place
    a.process_events()                            # hands it over; returns at once
    again = a.malloc(70 * MiB)                    # stream 0 grows, the unmap still held ...
    assert calls(dev, "unmap") == calls(dev, "unmap_off_thread") == 0
    assert a.stats()["pending_unmap_bytes"] == 80 * MiB
    assert moved_to + 100 * MiB <= again or again + 70 * MiB <= moved_to
    assert a.check_invariants() == ""
    dev.hold_unmaps(False)                        # ... and made by the other thread
    deadline = time.monotonic() + 10
    while a.stats()["pending_unmap_bytes"] and time.monotonic() < deadline:
        time.sleep(0.001)
        a.process_events()
    s = a.stats()
    assert s["pending_unmap_bytes"] == 0 and calls(dev, "unmap") == 0
    assert s["num_unmaps_off_thread"] == calls(dev, "unmap_off_thread") >= 1
    assert host_waits(dev) == 0
    assert a.check_invariants() == ""
    a.free(again)
    a.free(moved_to)


def test_an_explicit_reclaim_waits_for_the_unmapping_thread_and_counts_the_wait() -> None:
    # The memory of a moved page goes back to the device only once its old place is unmapped
    # too, so empty_cache waits for the allocator's thread where that unmap is still to come:
    # a host wait of the caller's like any other, counted apart.
    dev = ae.SimDevice(capacity=GiB)
    dev.set_unmap_thread("own")
    a = ae.Allocator(dev, "unmap_off_thread:True")
    moved_to = move_80_mib_to_stream_2(a)
    dev.hold_unmaps(True)                         # the thread's unmap blocks (2 s at most)
    for stream in (0, 2):
        dev.complete_stream(stream)
    a.process_events()                            # handed over, not yet made
    assert a.stats()["num_host_waits.unmap_thread"] == 0
    a.free(moved_to)
    release = threading.Timer(0.5, dev.hold_unmaps, args=(False,))
    release.start()
    a.empty_cache()                               # waits for the held unmap to be made
    release.join()
    s = a.stats()
    assert s["num_host_waits.unmap_thread"] == 1
    # Only the block at stream 0's segment end, still in use, stays reserved.
    assert s["pending_unmap_bytes"] == 0 and s["reserved_bytes.all.current"] == 20 * MiB
    assert calls(dev, "unmap_off_thread") >= 1
    assert a.check_invariants() == ""


@pytest.mark.parametrize(("where", "config", "off_thread"), [
    ("caller", "unmap_off_thread:True", False),   # a device that wants every call from one
    ("own", None, False),                         # off by default: inline anywhere
    ("own_in_lockstep", "unmap_off_thread:True", True),  # a replay's: in one order
])
def test_where_a_moved_pages_old_place_is_unmapped(where: str, config: str | None,
                                                   off_thread: bool) -> None:
    dev = ae.SimDevice(capacity=GiB)
    dev.set_unmap_thread(where)
    a = ae.Allocator(dev, config)
    donor = a.malloc(60 * MiB, stream=1)
    live = a.malloc(40 * MiB, stream=2)
    a.free(donor)
    grown = a.malloc(70 * MiB, stream=2)
    for stream in (1, 2):
        dev.complete_stream(stream)
    a.process_events()                            # unmapped when this returns, either way
    s = a.stats()
    made = calls(dev, "unmap_off_thread" if off_thread else "unmap")
    assert s["pending_unmap_bytes"] == 0 and made >= 1
    assert s["num_unmaps_off_thread"] == (made if off_thread else 0)
    assert calls(dev, "unmap" if off_thread else "unmap_off_thread") == 0
    assert host_waits(dev) == 0
    a.free(grown)
    a.free(live)
    with pytest.raises(ValueError, match="unmap thread 'elsewhere'"):
        dev.set_unmap_thread("elsewhere")


def test_empty_cache_finishes_pending_page_moves_by_waiting_and_counts_the_waits() -> None:
    dev = ae.SimDevice(capacity=GiB)
    a = ae.Allocator(dev)
    donor = a.malloc(60 * MiB, stream=1)
    live = a.malloc(40 * MiB, stream=2)
    a.free(donor)
    a.malloc(70 * MiB, stream=2)
    assert a.stats()["pending_unmap_bytes"] == 60 * MiB
    a.empty_cache()
    s = a.stats()
    assert s["pending_unmap_bytes"] == 0 and calls(dev, "unmap") >= 1
    assert s["num_host_waits.event"] + s["num_host_waits.stream"] >= 1
    assert s["num_host_waits.event"] == calls(dev, "event_synchronize")
    assert s["num_host_waits.stream"] == calls(dev, "stream_synchronize")
    a.free(live)
    assert a.check_invariants() == ""


def test_large_pool_takes_free_small_pages_but_leaves_the_small_pool_a_reserve() -> None:
    for large_page_mb, new_pages, reserved_mb in ((2, 0, 20), (20, 1, 24)):
        dev = ae.SimDevice(capacity=GiB)
        a = ae.Allocator(dev, "native,expandable_segments:True,reuse_free_pages:True,"
                              f"expandable_large_page_mb:{large_page_mb}")
        for p in [a.malloc(512 << 10) for _ in range(40)]:
            a.free(p)                         # 20 MiB of small pages, all free
        creates = dev.counters()["create"]["count"]
        a.malloc(16 * MiB)
        s = a.stats()
        # 2 MiB large pages: eight small pages move over as they are (no release, no create).
        # 20 MiB pages: one new page, for which eight small pages are released; either way the
        # small pool keeps two free pages, so that it does not re-create at once what it gave.
        assert dev.counters()["create"]["count"] - creates == new_pages, large_page_mb
        assert s["reserved_bytes.all.current"] == reserved_mb * MiB, large_page_mb
        assert s["reserved_bytes.small_pool.current"] == 4 * MiB, large_page_mb
        assert a.check_invariants() == ""


def test_below_the_high_water_mark_growth_creates_pages_instead_of_moving_them() -> None:
    # Moving a free page costs device calls; below the most ever reserved, a new page raises no
    # peak, so a repeating workload settles without moves.
    # In 20 MiB large pages (PyTorch's), where a small page must come from a released large one.
    dev = ae.SimDevice(capacity=GiB)
    a = ae.Allocator(dev, "expandable_large_page_mb:20,expandable_chunk_mb:0")
    a.free(a.malloc(200 * MiB))               # high-water mark: 200 MiB, all free
    small = [a.malloc(MiB) for _ in range(2)]  # the small pool's first page: a large page
    c = dev.counters()                           # released for it (200 + 2 would pass the mark)
    assert c["unmap"]["count"] == 1 and c["release"]["count"] == 1
    small.append(a.malloc(MiB))               # 182 + 2 MiB stays under the mark: a new page
    c = dev.counters()
    # A page released rather than moved (other page sizes) waits for the device, once.
    assert c["unmap"]["count"] == 1 and c["synchronize"]["count"] == 1
    assert a.stats()["num_host_waits.device"] == 1
    s = a.stats()
    assert s["reserved_bytes.large_pool.current"] == 180 * MiB   # left mapped, ready for reuse
    assert s["reserved_bytes.all.current"] == 184 * MiB
    # An explicit reclaim asks for less memory: the mark drops to what is left, and growth
    # moves free pages again before raising it.
    a.empty_cache()
    first = a.malloc(40 * MiB)
    a.malloc(40 * MiB)
    a.free(first)                             # 40 MiB free; the mark is now 84 MiB
    unmaps = dev.counters()["unmap"]["count"]
    a.malloc(60 * MiB)
    dev.synchronize()
    a.process_events()
    assert dev.counters()["unmap"]["count"] - unmaps == 2         # the free 40 MiB moved
    assert a.stats()["reserved_bytes.all.current"] == 104 * MiB
    assert a.check_invariants() == ""




def test_a_repeated_take_back_creates_pages_once_and_the_loop_settles() -> None:
    # Without settle_page_moves the step moves the same free pages to its growth and back in
    # every pass: an unmap (a wait for the stream) and a map each time, for ever. The defaults
    # (settle_page_moves) create them the second time, and from then on the step makes no
    # device call at all.
    moving = looped_step_page_calls(MOVING, 6)
    assert all(page_calls > 0 for _, page_calls in moving[2:])
    settled = looped_step_page_calls(None, 6)
    assert settled[0] == moving[0]                        # the first pass is unchanged
    assert [page_calls for _, page_calls in settled[2:]] == [0, 0, 0, 0]
    assert {peak for peak, _ in settled[1:]} == {140}     # flat from pass 2
    # Under a memory fraction that leaves no room to create, pages move as before.
    capped = looped_step_page_calls(None, 6, fraction=120 / 1024)
    assert all(peak <= 120 for peak, _ in capped)
    assert all(page_calls > 0 for _, page_calls in capped[2:])


def test_a_settled_growth_creates_its_pages_where_the_fewest_are_missing() -> None:
    # The second time a take-back recurs, the growth creates its pages beside the free memory
    # that leaves the fewest to create, not in the lowest hole where it fits: 6 MiB more than
    # the first pass, where the lowest hole took 30 MiB (and moved the next pass's requests
    # elsewhere). The loop is flat from pass 2 without a device call.
    moving = looped_step_page_calls(MOVING, 6, step=STEP_AMONG_HOLES)
    settled = looped_step_page_calls(None, 6, step=STEP_AMONG_HOLES)
    assert settled[0] == moving[0] and settled[0][0] == 124
    assert {peak for peak, _ in settled[1:]} == {130}
    assert [page_calls for _, page_calls in settled[2:]] == [0, 0, 0, 0]


def test_under_a_memory_fraction_growth_moves_free_pages_instead_of_retrying() -> None:
    # PyTorch checks reserved + the whole request against the fraction, and over it frees every
    # cached block and retries (a wait on every stream). allocwatch's defaults first take free
    # pages back and check only what is really added.
    def grow_under_cap(config: str | None) -> tuple[ae.Allocator, ae.SimDevice]:
        dev = ae.SimDevice(capacity=GiB)
        a = ae.Allocator(dev, config)
        a.set_memory_fraction(120 / 1024)    # 120 MiB allowed
        first = a.malloc(60 * MiB)
        a.malloc(40 * MiB)
        a.free(first)                        # 60 MiB free, not next to the growth
        a.malloc(80 * MiB)                   # 100 + 80 > 120: only with the free pages
        assert a.check_invariants() == ""
        return a, dev

    a, dev = grow_under_cap(None)
    assert a.stats()["num_alloc_retries"] == 0
    assert a.stats()["reserved_bytes.all.current"] == 120 * MiB
    dev.synchronize()
    a.process_events()
    c = dev.counters()
    assert c["unmap"]["bytes"] == 60 * MiB and "release" not in c   # the free pages moved
    a, _ = grow_under_cap("native,expandable_segments:True")
    assert a.stats()["num_alloc_retries"] == 1            # PyTorch's rule, kept for `native`


def test_no_page_is_taken_back_while_a_graph_is_captured() -> None:
    # Taking a page back unmaps it, and an unmap waits for its stream: a capture forbids that,
    # so growth during capture creates pages even where free ones could have moved.
    dev = ae.SimDevice(capacity=GiB)
    a = ae.Allocator(dev)
    a.begin_allocate_to_pool((1, 0), 1)      # stream 1 is being captured into a private pool
    first = a.malloc(60 * MiB, 1)
    a.malloc(40 * MiB, 1)
    a.free(first)                             # 60 MiB free in the private pool
    a.malloc(80 * MiB, 1)                     # over the high-water mark: would move pages
    c = dev.counters()
    assert "unmap" not in c and "stream_synchronize" not in c
    a.end_allocate_to_pool((1, 0))
    assert a.check_invariants() == ""


def test_native_expandable_segments_check_the_fraction_as_pytorch_does() -> None:
    # PyTorch checks reserved + the request (30 MiB) against the cap (35 MiB) and then maps
    # whole 20 MiB pages: 40 MiB reserved. Only allocwatch's defaults check after mapping.
    a = ae.Allocator(ae.SimDevice(capacity=GiB), "native,expandable_segments:True")
    a.set_memory_limit(35 * MiB)
    a.malloc(30 * MiB)
    assert a.stats()["reserved_bytes.all.current"] == 40 * MiB


def test_generous_growth_shrinks_to_what_the_fraction_leaves() -> None:
    a = ae.Allocator(ae.SimDevice(capacity=GiB), "native,expandable_segments:True,"
                     "reuse_free_pages:True,expandable_grow_mb:64")
    a.set_memory_limit(60 * MiB)
    a.malloc(2 * MiB)                         # would grow by 64 MiB: only 60 fit
    a.malloc(30 * MiB)
    assert a.stats()["reserved_bytes.all.current"] == 60 * MiB
    assert a.stats()["num_alloc_retries"] == 0 and a.check_invariants() == ""


def test_pages_taken_back_for_a_chunk_are_released_before_the_chunk_is_created() -> None:
    # A chunk is created whole; pages moved for it would otherwise hold their memory while it
    # is created, and the device (here nearly full) would send the request into the retry path.
    dev = ae.SimDevice(capacity=GiB)
    a = ae.Allocator(dev, "native,expandable_segments:True,reuse_free_pages:True,"
                          "expandable_chunk_mb:20,expandable_large_page_mb:2")
    small = [a.malloc(2 * MiB) for _ in range(10)]
    a.malloc(960 * MiB)
    for p in small[:-1]:
        a.free(p)
    a.malloc(60 * MiB)
    s = a.stats()
    assert s["num_alloc_retries"] == 0 and s["num_sync_all_streams"] == 0
    assert a.check_invariants() == ""


def test_a_released_private_pool_outlives_its_last_expandable_block() -> None:
    # One allocation may map several times and one unmap may cover several allocations: the
    # pool counts mapped bytes, so it is not dropped while a block of it is still alive.
    a = ae.Allocator(ae.SimDevice(capacity=GiB))
    a.begin_allocate_to_pool((1, 0), 1)
    a.free(a.malloc(40 * MiB, 1))
    alive = a.malloc(20 * MiB, 1)
    a.end_allocate_to_pool((1, 0))
    a.release_pool((1, 0))
    a.empty_cache()
    assert a.check_invariants() == ""
    a.free(alive)
    a.empty_cache()
    assert a.check_invariants() == "" and a.stats()["reserved_bytes.all.current"] == 0


def test_a_capture_on_one_device_holds_back_reclaims_on_every_device() -> None:
    # CUDA's default (global) capture mode forbids a stream synchronisation from any thread
    # while any stream captures.
    first = ae.Allocator(ae.SimDevice(capacity=GiB))
    second = ae.Allocator(ae.SimDevice(capacity=GiB))
    first.free(first.malloc(100 * MiB))
    second.begin_allocate_to_pool((1, 0), 3)
    assert first.capture_underway and first.empty_cache() == 0
    second.end_allocate_to_pool((1, 0))
    assert not first.capture_underway and first.empty_cache() == 100 * MiB


def test_lowering_max_split_size_at_run_time_never_releases_part_of_a_segment() -> None:
    # A free part of a segment split before max_split_size was lowered counts as oversize
    # afterwards; releasing it alone would free the middle of a segment (found by the core's
    # threaded stress test under sanitizers, which changes settings while it runs).
    a = ae.Allocator(ae.SimDevice(capacity=GiB), "native")
    a.free(a.malloc(200 * MiB))
    a.malloc(100 * MiB)                       # splits the cached 200 MiB segment
    a.set_config("max_split_size_mb:64")
    a.set_memory_limit(300 * MiB)
    with pytest.raises(ae.OutOfMemoryError):  # 200 + 150 > 300, and nothing whole to release
        a.malloc(150 * MiB)
    assert a.check_invariants() == ""
    a.set_memory_limit(400 * MiB)
    a.malloc(150 * MiB)
    assert a.check_invariants() == ""


def test_chunked_growth_maps_single_pages_at_both_ends_and_chunks_between() -> None:
    dev, a = native(config="native,expandable_segments:True,expandable_large_page_mb:2,"
                    "expandable_chunk_mb:20")
    p = a.malloc(46 * MiB)                # 1 page of 2 MiB, 2 chunks of 20 MiB, 2 pages
    c = dev.counters()
    assert c["create"]["count"] == 5
    assert c["map_only"]["count"] == 5 and c["set_access"]["count"] == 1
    assert a.stats()["reserved_bytes.all.current"] == 46 * MiB
    # The front page is a handle of its own: with a 2 MiB block left there, everything
    # behind it can be given back (chunks first would pin 18 MiB in the first chunk).
    a.free(p)
    assert a.malloc(2 * MiB) == p
    a.empty_cache()
    assert a.stats()["reserved_bytes.all.current"] == 2 * MiB
    assert a.check_invariants() == ""


def test_taken_back_chunks_are_mapped_again_whole_instead_of_released() -> None:
    # Moving a free 20 MiB chunk to where growth needs it costs an unmap and a map; releasing
    # it and creating anew would add a release and a create.
    dev, a = native(config="native,expandable_segments:True,reuse_free_pages:True,"
                    "expandable_large_page_mb:2,expandable_chunk_mb:20")
    first = a.malloc(40 * MiB)            # two chunks
    a.malloc(2 * MiB)                     # keeps the segment's end in use
    a.free(first)
    dev.reset_counters()
    a.malloc(80 * MiB)                    # grows past the high-water mark: moves both chunks
    dev.synchronize()
    a.process_events()                    # the device is done: their old mappings go
    c = dev.counters()
    assert c["unmap"]["count"] == 2
    assert "release" not in c
    assert c["create"]["count"] == 2      # only the 40 MiB not taken back, as two chunks
    assert a.stats()["reserved_bytes.all.current"] == 82 * MiB
    assert a.check_invariants() == ""


CHUNKED = "native,expandable_segments:True,reuse_free_pages:True,expandable_large_page_mb:2," \
          "expandable_chunk_mb:20"


def pinned_after_freeing_the_tail(a: ae.Allocator) -> int:
    """Reserved bytes left once the back 36 MiB of a 46 MiB growth are freed and the cache
    emptied, with its front 10 MiB still in use: what a partly used handle pins."""
    big = a.malloc(46 * MiB)
    a.free(big)
    head = a.malloc(10 * MiB)                 # the front of the same range
    tail = a.malloc(36 * MiB)
    assert tail == head + 10 * MiB
    a.free(tail)
    a.empty_cache()
    return a.stats()["reserved_bytes.all.current"]


def test_chunks_pin_the_free_pages_of_a_range_partly_in_use() -> None:
    # The trade chunks make: a handle goes back whole or not at all. 10 MiB in use inside the
    # first 20 MiB chunk keeps all of it.
    _, a = native(config=CHUNKED)
    assert pinned_after_freeing_the_tail(a) == 22 * MiB   # a 2 MiB page and a chunk
    assert a.check_invariants() == ""


SINGLE_PAGES = "native,expandable_segments:True,reuse_free_pages:True,expandable_large_page_mb:2," \
               "expandable_chunk_mb:2"


@pytest.mark.parametrize("aligned", [False, True])
def test_align_to_pages_starts_a_large_block_at_a_page_boundary_where_it_costs_no_page(
        aligned: bool) -> None:
    # A block of just under 16 pages that growth places 1 MiB into a page spans 17; once its
    # neighbour is gone, that partial page stays mapped for it alone. Aligned, it spans 16 and
    # the 1 MiB before it stays free in the neighbour's page (Note [page policy], alignment).
    _, a = native(config=SINGLE_PAGES + f",align_to_pages:{aligned}")
    neighbour = a.malloc(3 * MiB)
    kv = a.malloc(32 * MiB - 8 * KiB)
    assert kv == neighbour + (4 * MiB if aligned else 3 * MiB)
    assert a.stats()["reserved_bytes.all.current"] == 36 * MiB   # the same pages either way
    if aligned:
        # Only growth aligns: a cached block's pages exist already, shared with its neighbours,
        # and a gap there would serve nothing while both live.
        a.free(kv)
        again = a.malloc(32 * MiB - 8 * KiB)
        assert again == neighbour + 3 * MiB
        a.free(again)
        kv = a.malloc(64 * MiB)     # grows: from the first page that growth maps
        assert kv == neighbour + 4 * MiB
    a.free(neighbour)
    a.empty_cache()
    assert a.stats()["reserved_bytes.all.current"] == (64 if aligned else 34) * MiB
    assert a.check_invariants() == ""


def test_align_to_pages_acts_only_where_growth_maps_single_pages() -> None:
    # The defaults' chunks: growth stays where it starts. Under a memory fraction growth maps
    # single pages (Note [page policy], page size and chunks), and the block is aligned there.
    for fraction, offset in ((None, 3 * MiB), (0.5, 4 * MiB)):
        _, a = native(capacity=8 * GiB, config="align_to_pages:True")
        if fraction is not None:
            a.set_memory_fraction(fraction)
        neighbour = a.malloc(3 * MiB)
        block = a.malloc(32 * MiB - 8 * KiB)
        assert block == neighbour + offset, fraction
        assert a.check_invariants() == ""


def test_align_to_pages_leaves_a_block_in_place_where_starting_later_would_need_a_page() -> None:
    # 5 MiB from 3 MiB ends inside the fourth page; from 4 MiB it would need a fifth.
    _, a = native(config=SINGLE_PAGES + ",align_to_pages:True")
    neighbour = a.malloc(3 * MiB)
    block = a.malloc(5 * MiB)
    assert block == neighbour + 3 * MiB
    assert a.stats()["reserved_bytes.all.current"] == 8 * MiB
    assert a.check_invariants() == ""


def test_near_the_memory_at_which_the_device_ran_out_growth_creates_single_pages() -> None:
    # Under a cap, memory pinned in partly used chunks is what later out-of-memory errors are
    # made of (a long run's later passes, docs/benchmarks.md): close to where the device once
    # refused growth, every page is a handle of its own and goes back as soon as it is free.
    _, a = native(capacity=100 * MiB, config=CHUNKED)
    a.malloc(50 * MiB)                        # stays: the next growth ends 4 % below the ceiling
    with pytest.raises(ae.OutOfMemoryError):
        a.malloc(60 * MiB)                    # refused at 50 + 50 MiB free: the ceiling is 100
    assert pinned_after_freeing_the_tail(a) == 50 * MiB + 10 * MiB
    assert a.check_invariants() == ""


def test_a_refusal_far_above_what_is_reserved_leaves_growth_chunked() -> None:
    # A probe for more than the device has (cuDNN's benchmark mode tries such workspaces and
    # catches the error) says nothing about the memory the run itself needs.
    dev, a = native(capacity=GiB, config=CHUNKED)
    with pytest.raises(ae.OutOfMemoryError):
        a.malloc(2 * GiB)
    dev.reset_counters()
    a.free(a.malloc(46 * MiB))
    assert calls(dev, "create") == 5          # a page, two chunks, two pages
    assert a.check_invariants() == ""


def test_under_a_memory_fraction_growth_creates_single_pages_from_the_start() -> None:
    # A fraction says where the ceiling is before anything is refused. Chunks created on the
    # way up would pin their free pages by the time the ceiling is near: the 1.03 x replays of
    # the trainer and KV-cache recordings ran out of memory so (docs/benchmarks.md,
    # Fragmentation).
    dev, a = native(capacity=GiB, config=CHUNKED)
    a.set_memory_limit(100 * MiB)
    a.free(a.malloc(36 * MiB))
    assert calls(dev, "create") == 18         # 2 MiB pages, where chunks took 9 handles
    assert a.check_invariants() == ""


def test_a_memory_fraction_of_the_whole_device_leaves_growth_chunked() -> None:
    dev, a = native(capacity=GiB, config=CHUNKED)
    a.set_memory_fraction(1.0)
    a.malloc(36 * MiB)
    assert calls(dev, "create") == 9          # a page, a chunk, single pages
    a.set_memory_fraction(0.5)
    dev.reset_counters()
    a.malloc(36 * MiB)
    assert calls(dev, "create") == 18
    assert a.check_invariants() == ""


def test_a_new_memory_limit_forgets_where_the_device_refused() -> None:
    dev, a = native(capacity=100 * MiB, config=CHUNKED)
    a.malloc(60 * MiB)
    with pytest.raises(ae.OutOfMemoryError):
        a.malloc(50 * MiB)                    # refused at 60 + 40 MiB free: the ceiling is 100
    a.set_memory_limit(100 * MiB)             # the whole device: no limit
    dev.reset_counters()
    a.free(a.malloc(36 * MiB))                # to 96 MiB, past 95 % of where it refused
    assert calls(dev, "create") == 9          # chunked again: a page, a chunk, single pages
    assert a.check_invariants() == ""


def test_growth_past_the_ceiling_forgets_it() -> None:
    # Another process on the device freed its memory: the ceiling its use had set is gone.
    dev = ae.SimDevice(capacity=200 * MiB)
    a, other = ae.Allocator(dev, CHUNKED), ae.Allocator(dev, CHUNKED)
    hog = other.malloc(100 * MiB)
    a.malloc(50 * MiB)
    with pytest.raises(ae.OutOfMemoryError):
        a.malloc(60 * MiB)                    # refused at 50 + 50 MiB free
    other.free(hog)
    other.empty_cache()
    a.malloc(60 * MiB)                        # to 110 MiB: past the ceiling of 100
    dev.reset_counters()
    a.malloc(46 * MiB)
    assert calls(dev, "create") == 5          # chunked again
    assert a.check_invariants() == ""
