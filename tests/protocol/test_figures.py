"""The derived figures, as every view computes them."""

from __future__ import annotations

import pytest

from allocator_ext.protocol.proto.allocwatch.v1 import agent_pb2 as pb
from exporter.shared.figures import (
    fragmentation_ratio,
    peak_fragmentation_ratio,
    report_peaks,
)

MiB = 1 << 20


def test_the_cache_idle_share_and_the_peak_ratio_differ_for_a_healthy_cache() -> None:
    # Between steps: 150 of 200 MiB cached for the next step; at the peak, 199 MiB in use.
    assert fragmentation_ratio(200 * MiB, 50 * MiB) == 0.75
    assert peak_fragmentation_ratio(200 * MiB, 199 * MiB) == pytest.approx(0.005)
    assert peak_fragmentation_ratio(0, 0) == 0.0 and fragmentation_ratio(0, 0) == 0.0
    assert peak_fragmentation_ratio(100, 100) == 0.0


def test_a_report_from_a_1_0_agent_falls_back_to_the_peaks_since_reset() -> None:
    old = pb.DeviceReport(allocator=pb.AllocatorStats(all=pb.PoolStats(
        peak_allocated_bytes=30 * MiB, peak_reserved_bytes=40 * MiB)))
    assert report_peaks(old) == (40 * MiB, 30 * MiB, "since_reset")
    new = pb.DeviceReport(allocator=old.allocator, interval_peaks=pb.IntervalPeaks(
        peak_allocated_bytes=39 * MiB, peak_reserved_bytes=40 * MiB,
        window=pb.IntervalPeaks.INTERVAL))
    assert report_peaks(new) == (40 * MiB, 39 * MiB, "interval")
