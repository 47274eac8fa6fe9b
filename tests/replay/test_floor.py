"""The floor of a trace (allocator_ext.replay.floor): the least peak reserved memory any
allocator following the core's rules could reach, over the peak requested bytes. Small
programs written here pin down what it counts; the recorded traces show that no allocator's
replay, nor the recorded run itself, goes below it."""

from __future__ import annotations

import pytest
from support.paths import REPO

from allocator_ext.replay import load_trace, replay
from allocator_ext.replay.floor import PAGE_BYTES, reserved_floor
from allocator_ext.replay.replayer import recorded_figures
from allocator_ext.replay.trace import Trace, TraceEvent, peak_requested_bytes

MiB = 1 << 20


def program(*steps: tuple[str, int, int, int]) -> Trace:
    """A trace of (action, address, size, stream) events."""
    return Trace("program", [TraceEvent(a, addr, size, stream, i)
                             for i, (a, addr, size, stream) in enumerate(steps)], device=0)


def test_each_streams_pool_needs_whole_pages() -> None:
    # 3 MiB on each of two streams: two pages each, since no page holds two streams' blocks.
    floor = reserved_floor(program(("alloc", 0x1000, 3 * MiB, 1), ("alloc", 0x9000, 3 * MiB, 2)))
    assert floor.floor_bytes == 4 * PAGE_BYTES and floor.peak_requested_bytes == 6 * MiB
    assert floor.ratio == pytest.approx(8 / 6)
    # On one stream the same bytes pack into three pages.
    one = reserved_floor(program(("alloc", 0x1000, 3 * MiB, 1), ("alloc", 0x9000, 3 * MiB, 1)))
    assert one.floor_bytes == 3 * PAGE_BYTES


def test_small_and_large_requests_never_share_a_page() -> None:
    floor = reserved_floor(program(("alloc", 0x1000, MiB, 1), ("alloc", 0x9000, MiB + 1, 1)))
    assert floor.floor_bytes == 2 * PAGE_BYTES  # the 1 MiB request is small, the other large


def test_a_private_pool_needs_pages_of_its_own() -> None:
    # Two 512 KiB requests on one stream: one page, unless the snapshot's segments put the
    # second in a CUDA graph's private pool, which shares no page with the default pool.
    steps = [("segment_alloc", 1 << 30, 2 * MiB, 1), ("alloc", 1 << 30, MiB // 2, 1),
             ("segment_alloc", 2 << 30, 2 * MiB, 1), ("alloc", 2 << 30, MiB // 2, 1)]
    assert reserved_floor(program(*steps)).floor_bytes == PAGE_BYTES
    pooled = program(*steps)
    pooled.final_segments = [{"address": 2 << 30, "total_size": 2 * MiB,
                              "segment_pool_id": (0, 1)}]
    assert reserved_floor(pooled).floor_bytes == 2 * PAGE_BYTES


def test_a_private_pool_keeps_the_most_it_has_held() -> None:
    # A graph replays into the memory its capture used: 4 MiB freed inside the graph's pool
    # stays the pool's, so the default pool's 4 MiB after it need pages of their own. Outside a
    # pool the same program fits in two pages.
    steps = [("segment_alloc", 1 << 30, 4 * MiB, 1), ("alloc", 1 << 30, 4 * MiB, 1),
             ("free_requested", 1 << 30, 4 * MiB, 1), ("free_completed", 1 << 30, 4 * MiB, 1),
             ("segment_alloc", 2 << 30, 4 * MiB, 1), ("alloc", 2 << 30, 4 * MiB, 1)]
    assert reserved_floor(program(*steps)).floor_bytes == 2 * PAGE_BYTES
    pooled = program(*steps)
    pooled.final_segments = [{"address": 1 << 30, "total_size": 4 * MiB,
                              "segment_pool_id": (0, 1)}]
    floor = reserved_floor(pooled)
    assert floor.floor_bytes == 4 * PAGE_BYTES and floor.ratio == 2.0
    # Its own blocks reuse what it keeps: 3 MiB more in the pool add no page.
    again = program(*steps, ("alloc", (1 << 30) + 64, 3 * MiB, 1))
    again.final_segments = pooled.final_segments
    assert reserved_floor(again).floor_bytes == 4 * PAGE_BYTES


def test_a_free_waiting_for_other_streams_holds_its_bytes_until_it_completes() -> None:
    # A is freed while another stream may still read it: B cannot have its bytes. Both count as
    # requested (as PyTorch's requested_bytes counts them), so the floor is whole pages of both.
    waiting = program(("alloc", 0xA000, 4 * MiB, 1), ("free_requested", 0xA000, 4 * MiB, 1),
                      ("alloc", 0xB000, 4 * MiB, 1), ("free_completed", 0xA000, 4 * MiB, 1))
    floor = reserved_floor(waiting)
    assert floor.peak_requested_bytes == 8 * MiB == peak_requested_bytes(waiting)
    assert floor.floor_bytes == 8 * MiB and floor.ratio == 1.0
    # Completed at once, A's bytes are B's to take: the floor is one request's pages.
    at_once = program(("alloc", 0xA000, 4 * MiB, 1), ("free_requested", 0xA000, 4 * MiB, 1),
                      ("free_completed", 0xA000, 4 * MiB, 1), ("alloc", 0xB000, 4 * MiB, 1))
    assert reserved_floor(at_once).floor_bytes == 4 * MiB


def test_every_block_is_a_multiple_of_512_bytes() -> None:
    # 4,096 one-byte requests hold 2 MiB of blocks: exactly one page, and the 4,097th a second.
    ones = [("alloc", 0x1000 + i, 1, 1) for i in range(4096)]
    assert reserved_floor(program(*ones)).floor_bytes == PAGE_BYTES
    assert reserved_floor(program(*ones, ("alloc", 0x9999, 1, 1))).floor_bytes == 2 * PAGE_BYTES


def test_the_bar_is_1_01_or_the_floor_plus_0_01_where_the_floor_leaves_no_room() -> None:
    # One stream, 6 MiB in three pages: the floor is 1.00 and the bar 1.01.
    plain = reserved_floor(program(("alloc", 0x1000, 6 * MiB, 1)))
    assert plain.ratio == 1.0 and plain.bar == pytest.approx(1.01)
    # 3 MiB on each of two streams: four pages for six MiB, a floor of 1.333, a bar of 1.343.
    split = reserved_floor(program(("alloc", 0x1000, 3 * MiB, 1), ("alloc", 0x9000, 3 * MiB, 2)))
    assert split.bar == pytest.approx(8 / 6 + 0.01)
    assert split.as_dict()["bar"] == split.bar


def test_a_page_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="page_bytes must be positive, got 0"):
        reserved_floor(program(("alloc", 0x1000, 1, 1)), page_bytes=0)


@pytest.mark.parametrize("name", ["convnet__default", "gpt_varlen__default"])
def test_no_allocator_goes_below_the_floor_of_a_recorded_trace(name: str) -> None:
    trace = load_trace(REPO / "tests/data/traces" / f"{name}.pickle.gz")
    floor = reserved_floor(trace)
    assert 1.0 <= floor.ratio < 1.01  # one stream, requests far above a page: close to 1
    # The recorded run (PyTorch's defaults) and every allocator replayed reserve at least it.
    assert recorded_figures(trace).peak_reserved_bytes >= floor.floor_bytes
    for config in (None, "native", "native,expandable_segments:True"):
        report = replay(trace, config=config).report
        assert report["peak_requested_bytes"] == floor.peak_requested_bytes
        assert report["peak_reserved_bytes"] >= floor.floor_bytes, config
