"""From torch.cuda.memory_stats()-style dictionaries and settings strings to protocol messages.

Both sources (ours and PyTorch's) report the same keys, so one conversion serves both; keys a
source lacks (PyTorch has no pending_events, gc counters or host waits) read as 0. Each key is
the `stats_key` of its metric in allocator_ext/protocol/metrics.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from allocator_ext.protocol.metrics import DEVICE_CALLS, WAIT_SCOPES
from allocator_ext.protocol.proto.allocwatch.v1 import agent_pb2 as pb

MiB = 1 << 20


def _get(stats: Mapping[str, Any], key: str) -> int:
    value = stats.get(key, 0)
    try:
        return max(0, int(value))
    except (TypeError, ValueError):
        return 0


def _pool(stats: Mapping[str, Any], pool: str) -> pb.PoolStats:
    return pb.PoolStats(
        allocated_bytes=_get(stats, f"allocated_bytes.{pool}.current"),
        reserved_bytes=_get(stats, f"reserved_bytes.{pool}.current"),
        active_bytes=_get(stats, f"active_bytes.{pool}.current"),
        requested_bytes=_get(stats, f"requested_bytes.{pool}.current"),
        inactive_split_bytes=_get(stats, f"inactive_split_bytes.{pool}.current"),
        segments=_get(stats, f"segment.{pool}.current"),
        peak_allocated_bytes=_get(stats, f"allocated_bytes.{pool}.peak"),
        peak_reserved_bytes=_get(stats, f"reserved_bytes.{pool}.peak"),
    )


def allocator_stats(stats: Mapping[str, Any]) -> pb.AllocatorStats:
    allocations = _get(stats, "num_allocations") or _get(stats, "allocation.all.allocated")
    return pb.AllocatorStats(
        all=_pool(stats, "all"),
        small_pool=_pool(stats, "small_pool"),
        large_pool=_pool(stats, "large_pool"),
        pending_free_bytes=_get(stats, "pending_free_bytes"),
        pending_events=_get(stats, "pending_events"),
        pending_unmap_bytes=_get(stats, "pending_unmap_bytes"),
        alloc_retries=_get(stats, "num_alloc_retries"),
        ooms=_get(stats, "num_ooms"),
        device_mallocs=_get(stats, "num_device_alloc"),
        device_frees=_get(stats, "num_device_free"),
        sync_all_streams=_get(stats, "num_sync_all_streams"),
        gc_reclaims=_get(stats, "num_gc_reclaims"),
        gc_reclaimed_bytes=_get(stats, "gc_reclaimed_bytes"),
        empty_cache_calls=_get(stats, "num_empty_cache_calls"),
        allocations=allocations,
        **{f"host_waits_{scope}": _get(stats, f"num_host_waits.{scope}")
           for scope in WAIT_SCOPES},
        stream_waits=_get(stats, "num_stream_waits"),
        **{f"device_calls_{call}": _get(stats, f"num_device_calls.{call}")
           for call in DEVICE_CALLS},
    )


def parse_settings_string(text: str) -> dict[str, str]:
    """'a:1,b:2' -> {'a': '1', 'b': '2'} in order; 'native' presets are kept as key 'native'.

    Only splits; validation is the allocator's job (it names the bad key).
    """
    result: dict[str, str] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition(":")
        if not sep and key.strip() != "native":
            raise ValueError(f"setting {part!r} has no value (expected key:value)")
        result[key.strip()] = value.strip()
    return result


def format_settings(settings: Mapping[str, str]) -> str:
    return ",".join(key if key == "native" and not value else f"{key}:{value}"
                    for key, value in settings.items())


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes", "on")
    return bool(value)


def allocator_settings(config: Mapping[str, Any], config_string: str = "") -> pb.AllocatorSettings:
    """Settings in force, from a config dict (ours: a.config()) or a parsed settings string."""
    gc = config.get("garbage_collection_threshold", 0.0)
    max_split: Any = 0
    if "max_split_size_bytes" in config:
        max_split = config["max_split_size_bytes"]
    elif "max_split_size" in config:
        max_split = config["max_split_size"]
    elif "max_split_size_mb" in config:
        max_split = float(config["max_split_size_mb"]) * MiB
    try:
        max_split_bytes = int(float(max_split))
    except (TypeError, ValueError):
        max_split_bytes = 0
    # SIZE_MAX (or anything beyond the 64-bit range) means unlimited, which the protocol sends as 0.
    if max_split_bytes < 0 or max_split_bytes >= (1 << 63):
        max_split_bytes = 0
    try:
        gc_ratio = float(gc)
    except (TypeError, ValueError):
        gc_ratio = 0.0
    return pb.AllocatorSettings(
        garbage_collection_threshold=gc_ratio,
        max_split_size_bytes=max_split_bytes,
        expandable_segments=_truthy(config.get("expandable_segments", False)),
        config_string=config_string,
    )
