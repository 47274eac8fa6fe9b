"""alias_pages: a physical page keeps every address it was mapped at, in any stream's segment,
and is used through one of them at a time (expandable.cpp, Note [aliased pages]). On the
simulated device, whose counters say which device calls were made and whose streams complete
only when told; check_invariants recounts, for every address, the blocks in use over it and
fails where one physical page is in use through two addresses."""

from __future__ import annotations

from pathlib import Path

from support.page_steps import (
    MOVING,
    STEP_AMONG_HOLES,
    STEP_BESIDE_A_DISTANT_HOLE,
    calls,
    host_waits,
    looped_step_page_calls,
)
from support.paths import RECORDED_TRACES

import allocator_ext as ae
from allocator_ext.replay import load_trace, replay
from allocator_ext.replay.floor import reserved_floor

MiB, GiB = 1 << 20, 1 << 30
ALIASED = "alias_pages:True"
ALIASED_PAGES = "alias_pages:True,expandable_chunk_mb:2"  # handles of one page each


def _grow_beside_a_distant_hole(config: str) -> tuple[ae.SimDevice, ae.Allocator, dict[str, int]]:
    """40 MiB freed away from the end of the segment, then a 60 MiB request that must grow."""
    dev = ae.SimDevice(capacity=GiB)
    a = ae.Allocator(dev, config)
    held = {"x": a.malloc(40 * MiB), "y": a.malloc(40 * MiB)}
    a.free(held.pop("x"))
    held["z"] = a.malloc(60 * MiB)
    assert a.check_invariants() == ""
    return dev, a, held


def test_growth_maps_pages_in_use_nowhere_at_one_more_address_without_new_memory() -> None:
    dev, a, _ = _grow_beside_a_distant_hole(ALIASED_PAGES)
    c = dev.counters()
    # 100 MiB in use, 100 MiB reserved: the free 40 MiB serve the growth where they are mapped
    # too, so only 20 MiB are created, nothing is unmapped and no event orders a move.
    assert a.stats()["reserved_bytes.all.current"] == 100 * MiB == dev.used
    assert c["create"]["bytes"] == 100 * MiB
    assert "unmap" not in c and "record_event" not in c
    assert c["map_only"]["bytes"] == 140 * MiB              # 40 MiB at a second address


def test_a_page_in_use_through_one_address_is_not_handed_out_through_another() -> None:
    dev, a, held = _grow_beside_a_distant_hole(ALIASED_PAGES)
    # x's old block is free address space, but its pages are in use under z: a request that
    # fits it exactly must be served by other memory.
    w = a.malloc(40 * MiB)
    assert a.check_invariants() == ""
    assert a.stats()["reserved_bytes.all.current"] == 140 * MiB == dev.used
    a.free(held.pop("z"))                                     # now x's old address may serve
    v = a.malloc(40 * MiB)
    assert a.stats()["reserved_bytes.all.current"] == 140 * MiB
    assert a.check_invariants() == ""
    for p in (w, v, held.pop("y")):
        a.free(p)


def test_a_repeated_step_keeps_its_first_pass_memory_and_stops_calling_the_device() -> None:
    # Moving pages (settle_page_moves off) keeps the first pass's memory and moves pages in every
    # pass; settling (the defaults) stops the calls but holds more. Aliased pages do both: the
    # step holds its first pass's peak, which is its peak request, and from pass 2 on it makes
    # no device call.
    for step, peak in ((STEP_BESIDE_A_DISTANT_HOLE, 100), (STEP_AMONG_HOLES, 124)):
        moving = looped_step_page_calls(MOVING, 6, step=step)
        settled = looped_step_page_calls(None, 6, step=step)
        assert all(page_calls > 0 for _, page_calls in moving[1:])
        assert all(held > peak for held, _ in settled[1:])
        for config in (ALIASED, ALIASED_PAGES):
            aliased = looped_step_page_calls(config, 6, step=step)
            assert {held for held, _ in aliased} == {peak}
            assert [page_calls for _, page_calls in aliased[1:]] == [0] * 5


def test_the_free_pages_of_a_chunk_partly_in_use_serve_a_growth_elsewhere() -> None:
    # One 10 MiB chunk (five pages): x holds its first two pages, y the other three. Freed, x
    # leaves two pages in use nowhere inside a chunk in use; an 8 MiB request must grow. Its
    # last two pages are that chunk mapped once more at the end of the growth (its other three
    # lie past the request, usable there only once y is freed): two pages created, not four,
    # as where every page is a handle of its own.
    for config in (ALIASED, ALIASED_PAGES):
        dev = ae.SimDevice(capacity=GiB)
        a = ae.Allocator(dev, config)
        a.free(a.malloc(10 * MiB))
        x, y = a.malloc(4 * MiB), a.malloc(6 * MiB)
        a.free(x)
        z = a.malloc(8 * MiB)
        assert a.check_invariants() == ""
        assert a.stats()["reserved_bytes.all.current"] == 14 * MiB == dev.used
        assert dev.counters()["create"]["bytes"] == 14 * MiB
        # x's old address is free address space, but its pages are in use under z: a request
        # that fits it exactly is served by new memory until z is freed.
        w = a.malloc(4 * MiB)
        assert a.stats()["reserved_bytes.all.current"] == 18 * MiB
        a.free(z)
        v = a.malloc(4 * MiB)
        assert a.stats()["reserved_bytes.all.current"] == 18 * MiB
        assert a.check_invariants() == ""
        for p in (w, v, y):
            a.free(p)
        a.empty_cache()
        assert a.check_invariants() == ""
        assert a.stats()["reserved_bytes.all.current"] == 0 == dev.used


def test_empty_cache_releases_each_physical_page_once_with_its_last_address() -> None:
    dev, a, held = _grow_beside_a_distant_hole(ALIASED_PAGES)
    for p in held.values():
        a.free(p)
    a.empty_cache()
    assert a.check_invariants() == ""
    assert a.stats()["reserved_bytes.all.current"] == 0 == dev.used
    c = dev.counters()
    assert c["release"]["bytes"] == c["create"]["bytes"] == 100 * MiB
    assert c["unmap"]["bytes"] == c["map_only"]["bytes"]     # every address unmapped


def test_off_by_default_and_switching_it_off_keeps_the_addresses_made() -> None:
    dev, a, held = _grow_beside_a_distant_hole("expandable_chunk_mb:2")
    dev.synchronize()
    a.process_events()
    assert dev.counters()["unmap"]["bytes"] == 40 * MiB   # the defaults move x's pages
    dev, a, held = _grow_beside_a_distant_hole(ALIASED_PAGES)
    a.set_config("alias_pages:False")
    a.free(held.pop("z"))
    a.free(held.pop("y"))
    before = calls(dev, "map_only")
    a.malloc(60 * MiB)                          # served by free blocks: no growth, no new alias
    assert calls(dev, "map_only") == before
    assert a.check_invariants() == ""


def test_the_shared_multistream_trace_reserves_its_peak_request_within_a_percent(
        shared_traces: Path) -> None:
    # Its steps repeat within the recording, so the defaults settle in its first pass (1.0565 x);
    # aliased pages in handles of one page hold 1.0061 x.
    trace = load_trace(shared_traces / "multistream.pickle.gz")
    defaults = replay(trace).report
    aliased = replay(trace, config=ALIASED_PAGES).report
    assert defaults["reserved_ratio"] > 1.05
    assert aliased["reserved_ratio"] <= 1.01
    assert aliased["num_ooms"] == 0


def test_another_stream_maps_memory_in_use_nowhere_and_waits_for_its_last_user_on_the_device(
        ) -> None:
    # Stream 0 frees everything: 100 MiB of physical memory. Stream 2's growth maps it at one
    # more address instead of creating or moving any; handed out, stream 2 waits for stream 0's
    # work on the device (an event, cudaStreamWaitEvent), and the host waits for nothing.
    dev, a, held = _grow_beside_a_distant_hole(ALIASED_PAGES)
    for p in held.values():
        a.free(p)
    created, waits = dev.counters()["create"]["bytes"], calls(dev, "stream_wait_event")
    q = a.malloc(100 * MiB, stream=2)
    s = a.stats()
    assert dev.counters()["create"]["bytes"] == created
    assert s["reserved_bytes.all.current"] == 100 * MiB == dev.used
    assert calls(dev, "unmap") == 0 and host_waits(dev) == 0
    assert calls(dev, "stream_wait_event") - waits == 1 == s["num_stream_waits"]
    assert a.check_invariants() == ""
    # In use through stream 2's addresses, the pages serve no other stream: stream 1 creates.
    r = a.malloc(40 * MiB, stream=1)
    assert a.stats()["reserved_bytes.all.current"] == 140 * MiB == dev.used
    a.free(q)
    # Freed, they serve stream 1, after stream 2's work up to that free (an event recorded
    # then, as the pages had changed stream).
    t = a.malloc(60 * MiB, stream=1)
    s = a.stats()
    assert s["reserved_bytes.all.current"] == 140 * MiB
    assert s["num_stream_waits"] == 2 and host_waits(dev) == 0
    assert a.check_invariants() == ""
    # Once the work before a free is done, the next stream need not wait at all.
    a.free(t)
    for stream in (0, 2, 1):                  # each waited for the one before
        dev.complete_stream(stream)
    u = a.malloc(60 * MiB, stream=2)
    assert a.stats()["num_stream_waits"] == 2
    assert a.check_invariants() == ""
    for p in (r, u):
        a.free(p)
    a.empty_cache()
    assert a.stats()["reserved_bytes.all.current"] == 0 == dev.used
    assert dev.counters()["release"]["bytes"] == dev.counters()["create"]["bytes"]


def test_a_hand_out_waits_on_the_first_event_after_the_free_not_on_one_recorded_then() -> None:
    # Stream 1 frees x and z (pages that never changed stream: no event at their frees, each
    # free takes a number). Stream 2 maps x's pages and, no event on stream 1 being recorded
    # since, records one there and waits on it. That event came after z's free too: stream 2
    # taking z's pages waits on it again rather than recording another, and not at all once
    # stream 1's work is done.
    for done_between in (False, True):
        dev = ae.SimDevice(capacity=GiB)
        a = ae.Allocator(dev, ALIASED_PAGES)
        x, z = a.malloc(20 * MiB, stream=1), a.malloc(20 * MiB, stream=1)
        a.free(x)
        a.free(z)
        w = a.malloc(20 * MiB, stream=2)
        assert (calls(dev, "event_record"), a.stats()["num_stream_waits"]) == (1, 1)
        if done_between:
            dev.complete_stream(1)
        v = a.malloc(20 * MiB, stream=2)
        assert a.stats()["reserved_bytes.all.current"] == 40 * MiB == dev.used
        assert calls(dev, "event_record") == 1 and host_waits(dev) == 0
        assert a.stats()["num_stream_waits"] == (1 if done_between else 2)
        assert a.check_invariants() == ""
        for p in (w, v):
            a.free(p)


def test_pages_taking_turns_between_streams_cost_an_event_a_free_and_a_query_a_hand_out(
        ) -> None:
    # Streams 1 and 2 take turns with the same 20 MiB while both keep running: each free
    # records an event (the next stream's wait needs that position), each hand-out waits on
    # the device for the other's latest, found with one query; frees query nothing (the list
    # of events is trimmed every 64, by bisection). The host waits for nothing.
    dev = ae.SimDevice(capacity=GiB)
    a = ae.Allocator(dev, ALIASED_PAGES)
    a.free(a.malloc(20 * MiB))
    before = dev.counters()
    turns = 300
    for _ in range(turns):
        for stream in (1, 2):
            a.free(a.malloc(20 * MiB, stream=stream))
    made = {k: dev.counters()[k]["count"] - before.get(k, {}).get("count", 0)
            for k in ("event_record", "event_query", "stream_wait_event")}
    hand_outs = 2 * turns
    assert made["event_record"] <= hand_outs + 1
    assert made["stream_wait_event"] == hand_outs and host_waits(dev) == 0
    assert made["event_query"] <= hand_outs + made["event_record"] // 8
    assert a.stats()["reserved_bytes.all.peak"] == 20 * MiB
    # Where the other's work is done by the hand-out, no wait; trims drop the events.
    dev.synchronize()  # (the test's: each stream waited for the other)
    waits = a.stats()["num_stream_waits"]
    for _ in range(64):
        for stream in (1, 2):
            a.free(a.malloc(20 * MiB, stream=stream))
            dev.complete_stream(stream)
    assert a.stats()["num_stream_waits"] == waits
    assert dev.outstanding_events <= 2 * 64
    assert a.check_invariants() == ""


def test_memory_in_use_through_no_address_leaves_whole_for_the_small_pool() -> None:
    # The small pool shares no pages: its growth takes a physical allocation of the large pool
    # that is in use nowhere, with every address it is mapped at, each unmapped once the events
    # recorded at the move complete; the host waits for nothing.
    dev, a, held = _grow_beside_a_distant_hole(ALIASED_PAGES)
    for p in held.values():
        a.free(p)
    created = dev.counters()["create"]["bytes"]
    small = a.malloc(512 << 10)
    s = a.stats()
    assert dev.counters()["create"]["bytes"] == created          # no new memory
    assert s["reserved_bytes.all.current"] == 100 * MiB == dev.used
    assert s["reserved_bytes.small_pool.current"] == 2 * MiB
    moved = s["pending_unmap_bytes"]
    assert moved in (2 * MiB, 4 * MiB)            # one page, at one address or two
    assert calls(dev, "unmap") == 0 and host_waits(dev) == 0
    assert a.check_invariants() == ""
    dev.synchronize()
    a.process_events()
    assert a.stats()["pending_unmap_bytes"] == 0
    assert dev.counters()["unmap"]["bytes"] == moved
    a.free(small)
    assert a.check_invariants() == ""


def test_the_record_stream_pipeline_reserves_within_its_bar_waiting_only_on_the_device() -> None:
    # The producer/consumer recording (two streams taking turns with the same bytes): the
    # defaults hold both streams' peaks or move pages between them (1.69 x its peak request);
    # pages shared by both streams' segments hold it within its floor + 0.01, every change of
    # stream ordered by a device-side wait, none on the host.
    trace = load_trace(RECORDED_TRACES / "stream_pipeline__default_lockstep.pickle.gz")
    bar = reserved_floor(trace).bar
    defaults = replay(trace).report
    aliased = replay(trace, config=ALIASED_PAGES).report
    assert defaults["reserved_ratio"] > 1.5
    assert aliased["reserved_ratio"] <= bar
    assert aliased["num_ooms"] == 0 and aliased["num_sync_all_streams"] == 0
    assert aliased["device_calls"]["stream_wait_event"]["count"] > 0


# --- alias_pages_under_limit: the same, for the large pool's segments made under a limit ---

UNDER_LIMIT = "alias_pages_under_limit:True"


def test_under_a_limit_a_repeated_step_finds_its_moved_pages_still_mapped() -> None:
    # Under a memory fraction growth maps single pages, and the step's 60 MiB request takes the
    # free 40 MiB back every pass: 20 page calls a pass (map, and unmap where they were). With
    # alias_pages_under_limit they stay mapped at both addresses: no call after the first pass.
    moved = looped_step_page_calls(None, 6, fraction=120 / 1024)
    aliased = looped_step_page_calls(UNDER_LIMIT, 6, fraction=120 / 1024)
    assert [c for _, c in moved[1:]] == [20] * 5
    assert [c for _, c in aliased[1:]] == [0] * 5
    assert [p for p, _ in aliased] == [p for p, _ in moved]   # the same memory


def test_a_limit_counts_only_where_it_is_set_before_the_large_pool_first_grows() -> None:
    dev = ae.SimDevice(capacity=GiB)
    a = ae.Allocator(dev, UNDER_LIMIT)
    x = a.malloc(40 * MiB)
    a.set_memory_fraction(0.5)
    y = a.malloc(40 * MiB)                     # a limit now, but the segment was made without
    assert not a.aliases_pages
    a.free(x)
    a.free(y)
    a.empty_cache()                            # every segment released: the next one decides
    assert calls(dev, "address_free") == 1
    z = a.malloc(40 * MiB)
    assert a.aliases_pages
    a.free(z)
    a.empty_cache()
    a.set_memory_fraction(1.0)                 # no limit when the next segment is made
    a.malloc(40 * MiB)
    assert not a.aliases_pages
    assert a.check_invariants() == ""


def test_under_a_limit_is_off_unless_asked_and_alias_pages_needs_no_limit() -> None:
    for config, limit, aliases in ((None, True, False), (UNDER_LIMIT, False, False),
                                   (ALIASED, False, True)):
        a = ae.Allocator(ae.SimDevice(capacity=GiB), config)
        if limit:
            a.set_memory_fraction(0.5)
        a.malloc(40 * MiB)
        assert a.aliases_pages is aliases, config


def test_the_pipelines_recording_under_a_fraction_stops_unmapping_with_aliased_pages() -> None:
    # The record_stream pipeline as the lockstep benchmark ran it, replayed under a memory
    # fraction of 1.5 x its peak request: its two streams pass pages to each other all the
    # time. Moved, each passing unmaps a page (an unmap costs per page: 20 us or so); aliased,
    # the pages keep both addresses, and reserved memory comes within its floor + 0.01.
    trace = load_trace(RECORDED_TRACES / "stream_pipeline__default_lockstep.pickle.gz")
    floor = reserved_floor(trace)
    h200 = 143771566080
    fraction = int(1.5 * floor.peak_requested_bytes) / h200
    moved = replay(trace, device_memory=h200, memory_fraction=fraction).report
    aliased = replay(trace, config=UNDER_LIMIT, device_memory=h200,
                     memory_fraction=fraction).report
    assert moved["device_calls"]["unmap"]["count"] > 500
    assert sum(aliased["device_calls"].get(k, {"count": 0})["count"]
               for k in ("unmap", "unmap_off_thread")) <= 5
    assert aliased["num_alloc_retries"] == moved["num_alloc_retries"] == 0
    assert aliased["reserved_ratio"] <= floor.bar < moved["reserved_ratio"]
