"""Blocks freed while other streams may still use them (record_stream), under memory pressure.

Where reserved memory cannot grow (the memory fraction, or the device is full), allocwatch's
defaults (reuse_waiting_frees) let a request take a block of its own stream that waits only for
other streams' uses, before anything cached is released: its stream waits for those uses on
the device, the host for nothing, and no retry is counted (Note [waiting frees] in
core/allocator.cpp). Where none fits alone, all of them are freed so, each block's stream
waiting for its uses, and another stream's request takes their pages by the take-back, ordered
after that stream on the device. With room to grow, PyTorch's rule holds: the block waits until
the host sees its events complete (tests/core/test_core_rules.py), and so it does under the
preset `native`, whose retry waits on the host for every stream.
"""

from __future__ import annotations

import pytest

import allocator_ext as ae

MiB = 1 << 20
MAIN, CONSUMER, OTHER = 0, 7, 3
HOST_WAITS = ("num_host_waits.device", "num_host_waits.stream", "num_host_waits.event")


def freed_while_in_use(a: ae.Allocator, size: int, stream: int = MAIN) -> int:
    """A block of `stream` that the consumer stream still reads when it is freed."""
    p = a.malloc(size, stream)
    a.record_stream(p, CONSUMER)
    a.free(p)
    return p


def full_device(config: str | None = None) -> tuple[ae.SimDevice, ae.Allocator]:
    """Room for 40 MiB: one 30 MiB block, not two. No stream's work completes unless told to."""
    dev = ae.SimDevice(capacity=40 * MiB)
    return dev, ae.Allocator(dev, config)


def test_on_a_full_device_the_waiting_block_serves_its_stream_ordered_on_the_device() -> None:
    dev, a = full_device()
    p = freed_while_in_use(a, 30 * MiB)

    assert a.malloc(30 * MiB, MAIN) == p
    s = a.stats()
    assert s["num_stream_waits"] == 1 and s["pending_events"] == 0
    assert s["num_alloc_retries"] == 0 and s["num_ooms"] == 0
    assert all(s[k] == 0 for k in HOST_WAITS)
    assert dev.outstanding_events == 0         # the event went back once waited on
    # The device orders the main stream's next work after the consumer's use, not before.
    after = dev.record_event(MAIN)
    dev.complete_stream(MAIN)
    assert not dev.query_event(after)
    dev.complete_stream(CONSUMER)
    dev.complete_stream(MAIN)
    assert dev.query_event(after)
    assert a.check_invariants() == ""


def test_under_a_memory_fraction_the_waiting_block_serves_before_a_retry() -> None:
    dev = ae.SimDevice(capacity=1 << 30)
    a = ae.Allocator(dev)
    a.set_memory_fraction(40 * MiB / (1 << 30))
    p = freed_while_in_use(a, 30 * MiB)
    assert a.malloc(30 * MiB, MAIN) == p
    s = a.stats()
    assert s["num_alloc_retries"] == 0 and s["num_sync_all_streams"] == 0
    assert all(s[k] == 0 for k in HOST_WAITS)


def test_with_room_to_grow_the_waiting_block_is_left_alone() -> None:
    dev = ae.SimDevice()                       # unlimited
    a = ae.Allocator(dev)
    p = freed_while_in_use(a, 30 * MiB)
    assert a.malloc(30 * MiB, MAIN) != p       # grows: no stream waits for another
    s = a.stats()
    assert s["num_stream_waits"] == 0 and s["pending_events"] == 1


@pytest.mark.parametrize("config", ["native,expandable_segments:True",
                                    "reuse_waiting_frees:False"])
def test_without_the_rule_a_full_device_waits_on_the_host_and_retries(config: str) -> None:
    dev, a = full_device(config)
    freed_while_in_use(a, 30 * MiB)
    assert a.malloc(30 * MiB, MAIN)            # once the host waited and the cache was released
    s = a.stats()
    assert s["num_alloc_retries"] == 1 and s["num_sync_all_streams"] == 1
    assert s["num_host_waits.event"] == 1 and s["num_stream_waits"] == 0


def test_a_cached_block_that_fits_comes_before_any_wait() -> None:
    dev, a = full_device()
    cached = a.malloc(10 * MiB, MAIN)
    p = freed_while_in_use(a, 30 * MiB)
    a.free(cached)
    assert a.malloc(10 * MiB, MAIN) == cached
    s = a.stats()
    assert s["num_stream_waits"] == 0 and s["pending_events"] == 1
    assert p != cached


def test_another_streams_waiting_block_moves_its_pages_ordered_on_the_device() -> None:
    # MAIN's block waits for the consumer's use; OTHER asks. MAIN is ordered after that use,
    # the block's pages move to OTHER's segment, and OTHER is ordered after MAIN's work: two
    # waits on the device, none on the host, no retry.
    dev, a = full_device()
    freed_while_in_use(a, 30 * MiB, stream=MAIN)
    assert a.malloc(30 * MiB, OTHER)
    s = a.stats()
    assert s["num_stream_waits"] == 2
    assert s["num_alloc_retries"] == 0 and s["num_sync_all_streams"] == 0
    assert all(s[k] == 0 for k in HOST_WAITS)
    after = dev.record_event(OTHER)
    dev.complete_stream(OTHER)
    dev.complete_stream(MAIN)                  # MAIN waits for the consumer: not done yet
    assert not dev.query_event(after)
    dev.complete_stream(CONSUMER)
    dev.complete_stream(MAIN)
    dev.complete_stream(OTHER)
    assert dev.query_event(after)
    # The pages' old addresses are unmapped once the device is past the move, found by polling.
    assert s["pending_unmap_bytes"] == 30 * MiB
    a.process_events()
    assert a.stats()["pending_unmap_bytes"] == 0
    assert a.check_invariants() == ""


def test_waiting_blocks_that_fit_only_together_serve_once_all_are_waited_for() -> None:
    dev, a = full_device()
    first = freed_while_in_use(a, 20 * MiB)
    second = freed_while_in_use(a, 20 * MiB)
    assert a.malloc(40 * MiB, MAIN) == min(first, second)   # the two merged
    s = a.stats()
    assert s["num_stream_waits"] == 2 and s["pending_events"] == 0
    assert s["num_alloc_retries"] == 0 and all(s[k] == 0 for k in HOST_WAITS)
    assert a.check_invariants() == ""


def test_the_waiting_block_that_fits_best_is_taken_and_only_its_use_is_waited_for() -> None:
    dev = ae.SimDevice(capacity=100 * MiB)
    a = ae.Allocator(dev)
    large = a.malloc(60 * MiB, MAIN)
    small = a.malloc(30 * MiB, MAIN)
    for p in (large, small):
        a.record_stream(p, CONSUMER)
        a.free(p)
    assert a.malloc(25 * MiB, MAIN) == small
    s = a.stats()
    assert s["num_stream_waits"] == 1 and s["pending_events"] == 1
    assert s["pending_free_bytes"] == 60 * MiB  # the larger block still waits for its use
    dev.complete_stream(CONSUMER)
    a.process_events()
    assert a.malloc(60 * MiB, MAIN) == large
    assert a.check_invariants() == ""


def test_nothing_is_reused_by_waiting_while_a_graph_is_captured() -> None:
    # Events recorded during a capture are nodes of its graph: the capture's own rule applies.
    dev, a = full_device()
    freed_while_in_use(a, 30 * MiB)
    a.begin_allocate_to_pool((0, 1), OTHER)    # another stream is being captured
    with pytest.raises(ae.OutOfMemoryError):
        a.malloc(30 * MiB, MAIN)
    a.end_allocate_to_pool((0, 1))
    assert a.stats()["num_stream_waits"] == 0
    a.release_pool((0, 1))
