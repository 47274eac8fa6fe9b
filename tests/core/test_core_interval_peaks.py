"""Interval peaks: the highest allocated and reserved bytes between two reads, kept apart from
the '.peak' statistics (torch.cuda.max_memory_allocated()), which they never reset."""

from __future__ import annotations

import allocator_ext as ae

MiB = 1 << 20


def test_each_read_gives_the_peak_since_the_previous_one_and_starts_a_new_interval() -> None:
    a = ae.Allocator(ae.SimDevice(), "native")
    assert a.take_interval_peaks() == {"allocated_bytes": 0, "reserved_bytes": 0}
    kept = a.malloc(100 * MiB)
    burst = a.malloc(50 * MiB)
    a.free(burst)  # allocated falls back to 100 MiB before the read: the read sees 150
    first = a.take_interval_peaks()
    assert first["allocated_bytes"] == 150 * MiB
    assert first["reserved_bytes"] == a.stats()["reserved_bytes.all.current"]
    # Nothing allocated since: the new interval's peaks are the values it started from.
    assert a.take_interval_peaks()["allocated_bytes"] == 100 * MiB
    a.free(kept)
    assert a.take_interval_peaks()["allocated_bytes"] == 100 * MiB
    assert a.take_interval_peaks()["allocated_bytes"] == 0


def test_reading_interval_peaks_leaves_the_users_peaks_alone_and_the_reverse() -> None:
    a = ae.Allocator(ae.SimDevice(), "native")
    p = a.malloc(64 * MiB)
    a.free(p)
    a.take_interval_peaks()
    assert a.stats()["allocated_bytes.all.peak"] == 64 * MiB  # max_memory_allocated() unchanged
    p = a.malloc(32 * MiB)
    a.free(p)
    a.reset_peak_stats()
    assert a.stats()["allocated_bytes.all.peak"] == 0
    assert a.take_interval_peaks()["allocated_bytes"] == 32 * MiB  # the interval still saw it


def test_released_memory_leaves_the_interval_peak_of_reserved_bytes() -> None:
    a = ae.Allocator(ae.SimDevice(), "native")
    p = a.malloc(200 * MiB)
    a.free(p)
    a.empty_cache()
    assert a.stats()["reserved_bytes.all.current"] == 0
    assert a.take_interval_peaks()["reserved_bytes"] == 200 * MiB
    assert a.take_interval_peaks()["reserved_bytes"] == 0
