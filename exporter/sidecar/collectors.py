"""The sidecar's Prometheus collectors, one per source, each building its families fresh on
each scrape (the policy engine's and the admin API's sit beside them, in exporter.policy and
exporter.admin).

Names follow DESIGN.md "Metric names". Allocator series are labelled by
rank, local_rank, cuda_device, gpu_uuid (unknown values are empty labels); two agents with the
same labels (e.g. a restarted process before its predecessor expired) show the latest reporter.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from exporter.protocol.figures import fragmentation_ratio
from exporter.protocol.nvml import GpuMemory, NvmlReader
from exporter.protocol.proto.allocwatch.v1 import agent_pb2 as pb
from exporter.protocol.version import PACKAGE_VERSION, PROTOCOL_MAJOR, PROTOCOL_MINOR
from exporter.sidecar.registry import AgentState, Registry
from exporter.sidecar.reload import ConfigWatcher

ALLOC = "torch_cuda_allocator"
SERIES_LABELS = ["rank", "local_rank", "cuda_device", "gpu_uuid"]

# (metric suffix, help, field of PoolStats) for the totals over both pools.
_POOL_GAUGES = [
    ("allocated_bytes", "Bytes in blocks handed out to tensors", "allocated_bytes"),
    ("reserved_bytes", "Bytes of device memory held by the allocator", "reserved_bytes"),
    ("active_bytes", "Bytes in active blocks (allocated, or freed with pending stream uses)",
     "active_bytes"),
    ("requested_bytes", "Bytes requested by tensors, before rounding", "requested_bytes"),
    ("inactive_split_bytes", "Free bytes inside split segments (not releasable)",
     "inactive_split_bytes"),
    ("segments", "Device allocations (segments) held", "segments"),
    ("peak_allocated_bytes", "Peak allocated bytes since the last peak reset",
     "peak_allocated_bytes"),
    ("peak_reserved_bytes", "Peak reserved bytes since the last peak reset", "peak_reserved_bytes"),
]
# Figures also shown per pool: the same metric with pool="small"|"large" beside the series without
# a pool label, which is the total (select it with {pool=""}). Peaks are totals only.
# Kept to the figures that tell the pools apart (each split adds two series per device, and
# scrape time grows with the series count).
_POOL_SPLIT = {"allocated_bytes", "reserved_bytes", "inactive_split_bytes"}

_COUNTERS = [
    ("alloc_retries", "Allocations that freed cached blocks and retried", "alloc_retries"),
    ("ooms", "Out-of-memory errors raised", "ooms"),
    ("device_mallocs", "Device memory allocations (cudaMalloc or mappings)", "device_mallocs"),
    ("device_frees", "Device memory releases", "device_frees"),
    ("sync_all_streams", "Device-wide synchronisations by the allocator", "sync_all_streams"),
    ("gc_reclaims", "Garbage-collection reclaims run", "gc_reclaims"),
    ("gc_reclaimed_bytes", "Bytes released by garbage collection", "gc_reclaimed_bytes"),
    ("empty_cache_calls", "empty_cache() calls", "empty_cache_calls"),
    ("allocations", "Allocations served", "allocations"),
]


def _label(value: int) -> str:
    return str(value) if value >= 0 else ""


def _add_pool_sample(family: Metric, labels: list[str], pool: str, value: float) -> None:
    # A family's label names are fixed by add_metric; the per-pool series add one more label.
    family.samples.append(Sample(family.name, {**dict(zip(SERIES_LABELS, labels, strict=True)),
                                               "pool": pool}, float(value)))


DeviceRow = tuple[list[str], AgentState, pb.DeviceReport]


def latest_device_rows(agents: list[AgentState]) -> list[DeviceRow]:
    """Each reported device once, under its series labels: the latest reporter wins a clash."""
    rows: dict[tuple[str, ...], tuple[float, AgentState, pb.DeviceReport]] = {}
    for agent in agents:
        report, when = agent.last_report, agent.last_report_time
        if report is None or when is None:
            continue
        ident = agent.identity
        for device in report.devices:
            labels = (_label(ident.rank), _label(ident.local_rank),
                      _label(device.cuda_device), device.gpu_uuid)
            if labels not in rows or rows[labels][0] <= when:
                rows[labels] = (when, agent, device)
    return [(list(k), agent, device) for k, (_, agent, device) in rows.items()]


class AllocatorCollector(Collector):
    """torch_cuda_allocator_*: each agent's allocator, from its latest report, and the info
    series of the process behind it."""

    def __init__(self, registry: Registry):
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        agents = self._registry.agents()
        yield from self._allocator_families(latest_device_rows(agents))
        yield self._info_family(agents)

    @staticmethod
    def _allocator_families(rows: list[DeviceRow]) -> Iterator[Metric]:
        for suffix, doc, field in _POOL_GAUGES:
            family = GaugeMetricFamily(f"{ALLOC}_{suffix}", doc, labels=SERIES_LABELS)
            for labels, _, device in rows:
                family.add_metric(labels, getattr(device.allocator.all, field))
            if field in _POOL_SPLIT:
                for labels, _, device in rows:
                    for pool, pool_stats in (("small", device.allocator.small_pool),
                                             ("large", device.allocator.large_pool)):
                        _add_pool_sample(family, labels, pool, getattr(pool_stats, field))
            yield family

        pending_free = GaugeMetricFamily(
            f"{ALLOC}_pending_free_bytes",
            "Freed bytes waiting for stream events before reuse", labels=SERIES_LABELS)
        pending_events = GaugeMetricFamily(
            f"{ALLOC}_pending_events", "Stream events not yet completed", labels=SERIES_LABELS)
        frag = GaugeMetricFamily(
            f"{ALLOC}_fragmentation_ratio",
            "(reserved - allocated) / reserved; 0 when nothing is reserved", labels=SERIES_LABELS)
        gc = GaugeMetricFamily(
            f"{ALLOC}_gc_threshold_ratio",
            "garbage_collection_threshold in force (0: off)", labels=SERIES_LABELS)
        max_split = GaugeMetricFamily(
            f"{ALLOC}_max_split_size_bytes",
            "max_split_size in force (+Inf: unlimited)", labels=SERIES_LABELS)
        expandable = GaugeMetricFamily(
            f"{ALLOC}_expandable_segments",
            "1 when expandable segments are on", labels=SERIES_LABELS)
        for labels, _, device in rows:
            stats, settings = device.allocator, device.settings
            pending_free.add_metric(labels, stats.pending_free_bytes)
            pending_events.add_metric(labels, stats.pending_events)
            frag.add_metric(labels, fragmentation_ratio(stats.all.reserved_bytes,
                                                        stats.all.allocated_bytes))
            for pool, pool_stats in (("small", stats.small_pool), ("large", stats.large_pool)):
                _add_pool_sample(frag, labels, pool, fragmentation_ratio(
                    pool_stats.reserved_bytes, pool_stats.allocated_bytes))
            gc.add_metric(labels, settings.garbage_collection_threshold)
            max_split.add_metric(labels, settings.max_split_size_bytes or math.inf)
            expandable.add_metric(labels, 1.0 if settings.expandable_segments else 0.0)
        yield from (pending_free, pending_events, frag, gc, max_split, expandable)

        for suffix, doc, field in _COUNTERS:
            counter = CounterMetricFamily(f"{ALLOC}_{suffix}", doc, labels=SERIES_LABELS)
            for labels, _, device in rows:
                counter.add_metric(labels, getattr(device.allocator, field))
            yield counter

    @staticmethod
    def _info_family(agents: list[AgentState]) -> Metric:
        info = InfoMetricFamily(
            ALLOC, "The training process behind the allocator series",
            labels=SERIES_LABELS,
        )
        seen: set[tuple[str, ...]] = set()
        for agent in reversed(agents):  # newest first: it wins a label clash
            ident = agent.identity
            # One info series per device the agent reports, labelled as that device's allocator
            # series, so that `* on(rank, cuda_device) group_left(...) ..._info` joins every one
            # of them — also when the process chose its device after the agent started (as
            # under `allocwatch run`, where the hello names no device yet).
            report = agent.last_report
            devices = ([(_label(d.cuda_device), d.gpu_uuid) for d in report.devices]
                       if report is not None and report.devices else [])
            if not devices:
                devices = [(_label(ident.cuda_device), ident.gpu_uuid)]
            for cuda_device, gpu_uuid in devices:
                labels = [_label(ident.rank), _label(ident.local_rank), cuda_device, gpu_uuid]
                if tuple(labels) in seen:
                    continue
                seen.add(tuple(labels))
                info.add_metric(labels, {
                    "backend": ident.backend,
                    "torch_version": ident.torch_version,
                    "cuda_version": ident.cuda_version,
                    "pid": str(ident.pid),
                    "host": ident.host,
                    "training_job": ident.training_job,
                    "world_size": _label(ident.world_size),
                    "agent_version": ident.agent_version,
                    "protocol": agent.protocol,
                })
        return info


class GpuCollector(Collector):
    """allocwatch_gpu_memory_* and allocwatch_process_gpu_memory_used_bytes: the GPUs, from the
    sidecar's own NVML where it sees them, else from what each agent read of its own GPU."""

    def __init__(self, registry: Registry, nvml: NvmlReader | None):
        self._registry = registry
        self._nvml = nvml

    def collect(self) -> Iterator[Metric]:
        total = GaugeMetricFamily("allocwatch_gpu_memory_total_bytes",
                                  "GPU memory, from NVML", labels=["gpu_uuid"])
        used = GaugeMetricFamily("allocwatch_gpu_memory_used_bytes",
                                 "GPU memory in use by every process, from NVML",
                                 labels=["gpu_uuid"])
        process = GaugeMetricFamily(
            "allocwatch_process_gpu_memory_used_bytes",
            "GPU memory used by the training process, from NVML", labels=SERIES_LABELS)
        own: dict[str, GpuMemory] = {g.uuid: g for g in (self._nvml.read() if self._nvml else [])}
        gpus: dict[str, tuple[int, int]] = {
            u: (g.total_bytes, g.used_bytes) for u, g in own.items()}
        for labels, agent, device in latest_device_rows(self._registry.agents()):
            uuid = device.gpu_uuid
            mem = device.device_memory if device.HasField("device_memory") else None
            if uuid and uuid not in own and mem is not None:
                gpus[uuid] = (mem.total_bytes, mem.used_bytes)
            # The agent sees its own PID; the sidecar's NVML matches only in a shared PID space.
            if mem is not None and mem.has_process_used_bytes:
                process.add_metric(labels, mem.process_used_bytes)
            elif uuid in own and agent.identity.pid in own[uuid].process_used_bytes:
                process.add_metric(labels, own[uuid].process_used_bytes[agent.identity.pid])
        for uuid, (total_bytes, used_bytes) in sorted(gpus.items()):
            total.add_metric([uuid], total_bytes)
            used.add_metric([uuid], used_bytes)
        yield from (total, used, process)


class AgentsCollector(Collector):
    """allocwatch_agents_connected and the other figures of the agents' streams: reports,
    drops, commands and refused streams."""

    def __init__(self, registry: Registry):
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        agents = self._registry.agents()
        received, commands, errors = self._registry.counters()
        connected = GaugeMetricFamily("allocwatch_agents_connected",
                                      "Agents with an open stream")
        connected.add_metric([], sum(1 for a in agents if a.connected))
        yield connected
        # An agent that never connects cannot say so itself: the sidecar does.
        waiting = GaugeMetricFamily(
            "allocwatch_agent_wait_seconds",
            "Seconds since the sidecar started, while no agent has ever connected (0 once one has)")
        waiting.add_metric([], self._registry.seconds_without_any_agent())
        yield waiting

        last = GaugeMetricFamily("allocwatch_agent_last_report_timestamp_seconds",
                                 "When the sidecar last received a report from the agent",
                                 labels=SERIES_LABELS)
        dropped = CounterMetricFamily("allocwatch_agent_dropped_reports",
                                      "Reports the agent sampled but could not send",
                                      labels=SERIES_LABELS)
        seen: set[tuple[str, ...]] = set()
        for agent in reversed(agents):
            ident = agent.identity
            labels = [_label(ident.rank), _label(ident.local_rank),
                      _label(ident.cuda_device), ident.gpu_uuid]
            if tuple(labels) in seen or agent.last_report is None:
                continue
            seen.add(tuple(labels))
            last.add_metric(labels, agent.last_report_time or 0.0)
            dropped.add_metric(labels, agent.last_report.agent.reports_dropped_total)
        yield from (last, dropped)

        total = CounterMetricFamily("allocwatch_reports_received",
                                    "Reports received from all agents since the sidecar started")
        total.add_metric([], received)
        yield total
        cmd = CounterMetricFamily("allocwatch_commands", "Commands sent to agents, by result",
                                  labels=["command", "result"])
        for (command, result), count in sorted(commands.items()):
            cmd.add_metric([command, result], count)
        yield cmd
        err = CounterMetricFamily("allocwatch_stream_errors",
                                  "Agent streams refused or ended by bad input, by reason",
                                  labels=["reason"])
        for reason, count in sorted(errors.items()):
            err.add_metric([reason], count)
        yield err


class SidecarCollector(Collector):
    """The sidecar itself: its build, and the reloads of its settings file where one is
    watched."""

    def __init__(self, watcher: ConfigWatcher | None):
        self._watcher = watcher

    def collect(self) -> Iterator[Metric]:
        build = InfoMetricFamily("allocwatch_build", "The sidecar's version",
                                 labels=["version", "protocol"])
        build.add_metric([PACKAGE_VERSION, f"{PROTOCOL_MAJOR}.{PROTOCOL_MINOR}"], {})
        yield build
        if self._watcher is None:
            return
        totals, last_successful = self._watcher.counts()
        family = CounterMetricFamily(
            "allocwatch_config_reloads", "Settings file changes seen, by result (ok, partial: "
            "some fields need a restart, invalid: refused, unreadable)", labels=["result"])
        for result, count in totals:
            family.add_metric([result], count)
        yield family
        gauge = GaugeMetricFamily("allocwatch_config_last_reload_successful",
                                  "1 when the last settings file seen was accepted")
        gauge.add_metric([], 1.0 if last_successful else 0.0)
        yield gauge
