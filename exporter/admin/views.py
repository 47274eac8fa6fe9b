"""The admin API's JSON shapes: an agent with its live figures, allocator settings, and a
command's result."""

from __future__ import annotations

import urllib.parse
from typing import Any

from allocator_ext.protocol.proto.allocwatch.v1 import agent_pb2 as pb
from exporter.admin.snapshots import snapshot_name
from exporter.shared.figures import (
    fragmentation_ratio,
    peak_fragmentation_ratio,
    report_peaks,
)
from exporter.shared.registry import AgentState, Outcome, outcome_name

_COUNTER_FIELDS = ("alloc_retries", "ooms", "device_mallocs", "device_frees", "sync_all_streams",
                   "gc_reclaims", "gc_reclaimed_bytes", "empty_cache_calls", "allocations")
_POOL_FIELDS = ("allocated_bytes", "reserved_bytes", "active_bytes", "requested_bytes",
                "inactive_split_bytes", "segments", "peak_allocated_bytes", "peak_reserved_bytes")


def settings_view(settings: pb.AllocatorSettings) -> dict[str, Any]:
    return {"config_string": settings.config_string,
            "garbage_collection_threshold": settings.garbage_collection_threshold,
            "max_split_size_bytes": settings.max_split_size_bytes or None,
            "expandable_segments": settings.expandable_segments}


def _pool_view(pool: pb.PoolStats) -> dict[str, int]:
    return {name: getattr(pool, name) for name in _POOL_FIELDS}


def agent_view(state: AgentState) -> dict[str, Any]:
    ident = state.identity
    report = state.last_report
    devices = []
    for device in report.devices if report is not None else []:
        stats = device.allocator
        memory = None
        if device.HasField("device_memory"):
            memory = {"total_bytes": device.device_memory.total_bytes,
                      "used_bytes": device.device_memory.used_bytes}
        peak_reserved, peak_allocated, window = report_peaks(device)
        devices.append({
            "cuda_device": device.cuda_device, "gpu_uuid": device.gpu_uuid,
            **_pool_view(stats.all),
            "small_pool": _pool_view(stats.small_pool), "large_pool": _pool_view(stats.large_pool),
            "pending_free_bytes": stats.pending_free_bytes,
            "pending_events": stats.pending_events,
            "fragmentation_ratio": fragmentation_ratio(stats.all.reserved_bytes,
                                                       stats.all.allocated_bytes),
            "peak_fragmentation_ratio": peak_fragmentation_ratio(peak_reserved, peak_allocated),
            "interval_peaks": {"window": window, "allocated_bytes": peak_allocated,
                               "reserved_bytes": peak_reserved},
            "largest_free_block_bytes": (stats.largest_free_block_bytes
                                         if stats.HasField("largest_free_block_bytes")
                                         else None),
            "counters": {name: getattr(stats, name) for name in _COUNTER_FIELDS},
            "settings": settings_view(device.settings),
            "device_memory": memory,
        })
    return {
        "agent": state.key, "connected": state.connected, "series_slot": state.series_slot,
        "rank": ident.rank,
        "local_rank": ident.local_rank, "world_size": ident.world_size, "host": ident.host,
        "pid": ident.pid, "job": ident.training_job, "pod": ident.pod,
        "backend": ident.backend, "protocol": state.protocol,
        "reports_received": state.reports_received,
        "report_sequence": report.sequence if report is not None else None,
        "report_timestamp": report.timestamp_seconds if report is not None else None,
        "devices": devices,
    }


def snapshot_download(path: str) -> str:
    """Where a snapshot an agent wrote is fetched from this API (by its name alone: only the
    snapshot directory is served)."""
    return f"/v1/snapshots/{urllib.parse.quote(snapshot_name(path))}"


def result_view(state: AgentState, outcome: Outcome) -> dict[str, Any]:
    view: dict[str, Any] = {"agent": state.key, "rank": state.identity.rank,
                            "host": state.identity.host, "status": outcome_name(outcome)}
    if isinstance(outcome, str):
        view["message"] = f"no answer from the agent ({outcome})"
        return view
    view.update(
        message=outcome.message, bytes_released=outcome.bytes_released,
        sync_seconds=outcome.sync_seconds,
        settings_in_force=[{"cuda_device": s.cuda_device, **settings_view(s.settings)}
                           for s in outcome.settings_in_force])
    if outcome.snapshot_path:
        view["snapshot"] = {"path": outcome.snapshot_path, "bytes": outcome.snapshot_bytes,
                            "download": snapshot_download(outcome.snapshot_path)}
    return view
