"""Figures derived from an allocator's counters, computed the same way wherever they are shown
(the Prometheus series, the admin API, `ctl`, the policy engine's rules)."""

from __future__ import annotations

from allocator_ext.protocol.proto.allocwatch.v1 import agent_pb2 as pb


def fragmentation_ratio(reserved: int, allocated: int) -> float:
    """(reserved - allocated) / reserved: the share of the cache unused at this moment; 0 when
    nothing is reserved. High between training steps for any healthy cache (freed activations
    stay cached for the next step), so it says little about fragmentation on its own."""
    return (reserved - allocated) / reserved if reserved > 0 else 0.0


def peak_fragmentation_ratio(peak_reserved: int, peak_allocated: int) -> float:
    """1 - peak allocated / peak reserved: what the cache holds beyond the most it was ever
    asked for at once, in the same window; 0 for an unfragmented cache and when nothing is
    reserved."""
    if peak_reserved <= 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - peak_allocated / peak_reserved))


def report_peaks(device: pb.DeviceReport) -> tuple[int, int, str]:
    """(peak reserved, peak allocated, window) of a device's report: its interval peaks where
    the agent sends them (protocol 1.1), else the allocator's peaks since its last reset.
    window: "interval" or "since_reset"."""
    if device.HasField("interval_peaks") and device.interval_peaks.window:
        peaks = device.interval_peaks
        window = pb.IntervalPeaks.Window.Name(peaks.window).lower()
        return peaks.peak_reserved_bytes, peaks.peak_allocated_bytes, window
    pool = device.allocator.all
    return pool.peak_reserved_bytes, pool.peak_allocated_bytes, "since_reset"


def device_peak_fragmentation_ratio(device: pb.DeviceReport) -> float:
    reserved, allocated, _ = report_peaks(device)
    return peak_fragmentation_ratio(reserved, allocated)
