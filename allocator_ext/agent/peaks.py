"""The peaks of a report interval, from whatever the source offers.

allocwatch's allocator keeps interval peaks of its own (read and restarted once per report);
PyTorch's allocator keeps only the peaks that torch.cuda.reset_peak_memory_stats() resets,
which belong to the user: the agent never resets them, and reports them as peaks since the
process's last reset instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from allocator_ext.protocol.proto.allocwatch.v1 import agent_pb2 as pb

Window = pb.IntervalPeaks.Window


def interval_peaks(source: Any, device: int, stats: Mapping[str, Any]) -> pb.IntervalPeaks:
    take = getattr(source, "interval_peaks", None)
    if take is not None:
        allocated, reserved = take(device)
        return pb.IntervalPeaks(peak_allocated_bytes=allocated, peak_reserved_bytes=reserved,
                                window=Window.INTERVAL)
    return pb.IntervalPeaks(
        peak_allocated_bytes=max(0, int(stats.get("allocated_bytes.all.peak", 0))),
        peak_reserved_bytes=max(0, int(stats.get("reserved_bytes.all.peak", 0))),
        window=Window.SINCE_RESET)


def largest_free_block(source: Any, device: int) -> int | None:
    """Bytes, or None where the source cannot say."""
    find = getattr(source, "largest_free_block", None)
    return int(find(device)) if find is not None else None
