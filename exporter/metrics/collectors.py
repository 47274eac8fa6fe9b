"""The sidecar's Prometheus collectors, one per source, each building its families fresh on
each scrape (the policy engine's and the admin API's sit beside them, in exporter.policy and
exporter.admin).

Names follow DESIGN.md "Metric names". Allocator series are labelled by rank, local_rank,
cuda_device, gpu_uuid (unknown values are empty labels), plus agent_slot where two live agents'
labels coincide (exporter.shared.series). A departed agent's series give way to a connected
agent's with the same labels (a restarted process before its predecessor expired). Totals and
pool breakdowns have names of their own (`…_reserved_bytes` and `…_pool_reserved_bytes{pool}`),
so that `sum()` over any one metric counts each byte once.
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

from allocator_ext.protocol.nvml import GpuMemory, NvmlReader
from allocator_ext.protocol.proto.allocwatch.v1 import agent_pb2 as pb
from exporter.shared.figures import device_peak_fragmentation_ratio, fragmentation_ratio
from exporter.shared.registry import AgentState, Registry
from exporter.shared.series import (
    SERIES_LABELS,
    agent_labels,
    device_labels,
    label_value,
    with_slot,
)

ALLOC = "torch_cuda_allocator"

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
    ("peak_allocated_bytes", "Peak allocated bytes since the process's last peak reset",
     "peak_allocated_bytes"),
    ("peak_reserved_bytes", "Peak reserved bytes since the process's last peak reset",
     "peak_reserved_bytes"),
]
# The pool breakdown, under names of its own (pool="small"|"large"): the figures that tell the
# pools apart (each adds two series per device, and scrape time grows with the series count).
_POOL_SPLIT = [
    ("pool_allocated_bytes", "Bytes handed out to tensors, by pool", "allocated_bytes"),
    ("pool_reserved_bytes", "Bytes of device memory held, by pool", "reserved_bytes"),
    ("pool_inactive_split_bytes", "Free bytes inside split segments, by pool",
     "inactive_split_bytes"),
]

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


def _add(family: Metric, labels: dict[str, str], value: float) -> None:
    # Label sets differ within a family (agent_slot, pool), so samples are added directly
    # rather than through add_metric, which fixes one set of label names.
    suffix = "_total" if family.type == "counter" else ""
    family.samples.append(Sample(family.name + suffix, labels, float(value)))


DeviceRow = tuple[dict[str, str], AgentState, pb.DeviceReport]


def _precedence(agent: AgentState) -> tuple[bool, float]:
    """Which of two agents showing the same series wins: a connected one, else the latest
    reporter."""
    return agent.connected, agent.last_report_time or 0.0


def device_rows(agents: list[AgentState]) -> list[DeviceRow]:
    """Each reported device once, under its series labels."""
    rows: dict[tuple[tuple[str, str], ...], DeviceRow] = {}
    for agent in agents:
        report = agent.last_report
        if report is None or agent.last_report_time is None:
            continue
        for device in report.devices:
            labels = with_slot(device_labels(agent.identity, device), agent.series_slot)
            key = tuple(sorted(labels.items()))
            if key not in rows or _precedence(rows[key][1]) <= _precedence(agent):
                rows[key] = (labels, agent, device)
    return list(rows.values())


class AllocatorCollector(Collector):
    """torch_cuda_allocator_*: each agent's allocator, from its latest report, and the info
    series of the process behind it."""

    def __init__(self, registry: Registry):
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        agents = self._registry.agents()
        yield from self._allocator_families(device_rows(agents))
        yield self._info_family(agents)

    @staticmethod
    def _allocator_families(rows: list[DeviceRow]) -> Iterator[Metric]:
        for suffix, doc, field in _POOL_GAUGES:
            family = GaugeMetricFamily(f"{ALLOC}_{suffix}", doc, labels=SERIES_LABELS)
            for labels, _, device in rows:
                _add(family, labels, getattr(device.allocator.all, field))
            yield family
        # One label set a pool and device, shared by the pool families: the exposition writes
        # each label set once a build.
        pools = [(({**labels, "pool": "small"}, device.allocator.small_pool),
                  ({**labels, "pool": "large"}, device.allocator.large_pool))
                 for labels, _, device in rows]
        for suffix, doc, field in _POOL_SPLIT:
            family = GaugeMetricFamily(f"{ALLOC}_{suffix}", doc, labels=[*SERIES_LABELS, "pool"])
            for device_pools in pools:
                for labels, pool_stats in device_pools:
                    _add(family, labels, getattr(pool_stats, field))
            yield family

        pending_free = GaugeMetricFamily(
            f"{ALLOC}_pending_free_bytes",
            "Freed bytes waiting for stream events before reuse", labels=SERIES_LABELS)
        pending_events = GaugeMetricFamily(
            f"{ALLOC}_pending_events", "Stream events not yet completed", labels=SERIES_LABELS)
        frag = GaugeMetricFamily(
            f"{ALLOC}_fragmentation_ratio",
            "(reserved - allocated) / reserved: the share of the cache unused at this moment "
            "(high between steps for any healthy cache); 0 when nothing is reserved",
            labels=SERIES_LABELS)
        peak_frag = GaugeMetricFamily(
            f"{ALLOC}_peak_fragmentation_ratio",
            "1 - peak allocated / peak reserved over the report interval: what the cache holds "
            "beyond its most-used moment; 0 for an unfragmented cache", labels=SERIES_LABELS)
        largest_free = GaugeMetricFamily(
            f"{ALLOC}_largest_free_block_bytes",
            "The largest cached free block: the biggest request served without a device call "
            "(absent where the allocator cannot tell)", labels=SERIES_LABELS)
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
            _add(pending_free, labels, stats.pending_free_bytes)
            _add(pending_events, labels, stats.pending_events)
            _add(frag, labels, fragmentation_ratio(stats.all.reserved_bytes,
                                                   stats.all.allocated_bytes))
            _add(peak_frag, labels, device_peak_fragmentation_ratio(device))
            if stats.HasField("largest_free_block_bytes"):
                _add(largest_free, labels, stats.largest_free_block_bytes)
            _add(gc, labels, settings.garbage_collection_threshold)
            _add(max_split, labels, settings.max_split_size_bytes or math.inf)
            _add(expandable, labels, 1.0 if settings.expandable_segments else 0.0)
        yield from (pending_free, pending_events, frag, peak_frag, largest_free, gc, max_split,
                    expandable)

        for suffix, doc, field in _COUNTERS:
            counter = CounterMetricFamily(f"{ALLOC}_{suffix}", doc, labels=SERIES_LABELS)
            for labels, _, device in rows:
                _add(counter, labels, getattr(device.allocator, field))
            yield counter

    @staticmethod
    def _info_family(agents: list[AgentState]) -> Metric:
        info = InfoMetricFamily(
            ALLOC, "The training process behind the allocator series",
            labels=SERIES_LABELS,
        )
        shown: dict[tuple[tuple[str, str], ...], tuple[AgentState, dict[str, str]]] = {}
        for agent in agents:
            ident = agent.identity
            # One info series per device the agent reports, labelled as that device's allocator
            # series, so that `* on(rank, cuda_device) group_left(...) ..._info` joins every one
            # of them — also when the process chose its device after the agent started (as
            # under `allocwatch run`, where the hello names no device yet).
            report = agent.last_report
            if report is not None and report.devices:
                label_sets = [device_labels(ident, d) for d in report.devices]
            else:
                label_sets = [agent_labels(ident)]
            for base in label_sets:
                labels = with_slot(base, agent.series_slot)
                key = tuple(sorted(labels.items()))
                if key in shown and _precedence(agent) < _precedence(shown[key][0]):
                    continue
                shown[key] = (agent, {**labels, **{
                    "backend": ident.backend,
                    "torch_version": ident.torch_version,
                    "cuda_version": ident.cuda_version,
                    "pid": str(ident.pid),
                    "host": ident.host,
                    "training_job": ident.training_job,
                    "world_size": label_value(ident.world_size),
                    "agent_version": ident.agent_version,
                    "protocol": agent.protocol,
                }})
        for _, labels in shown.values():
            info.samples.append(Sample(f"{ALLOC}_info", labels, 1.0))
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
        for labels, agent, device in device_rows(self._registry.agents()):
            uuid = device.gpu_uuid
            mem = device.device_memory if device.HasField("device_memory") else None
            if uuid and uuid not in own and mem is not None:
                gpus[uuid] = (mem.total_bytes, mem.used_bytes)
            # The agent sees its own PID; the sidecar's NVML matches only in a shared PID space.
            if mem is not None and mem.has_process_used_bytes:
                _add(process, labels, mem.process_used_bytes)
            elif uuid in own and agent.identity.pid in own[uuid].process_used_bytes:
                _add(process, labels, own[uuid].process_used_bytes[agent.identity.pid])
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
        shown: dict[tuple[tuple[str, str], ...], tuple[AgentState, dict[str, str], pb.Report]] = {}
        for agent in agents:
            if agent.last_report is None:
                continue
            labels = with_slot(agent_labels(agent.identity), agent.series_slot)
            key = tuple(sorted(labels.items()))
            if key not in shown or _precedence(shown[key][0]) <= _precedence(agent):
                shown[key] = (agent, labels, agent.last_report)
        for agent, labels, report in shown.values():
            _add(last, labels, agent.last_report_time or 0.0)
            _add(dropped, labels, report.agent.reports_dropped_total)
        yield from (last, dropped)
        collisions = CounterMetricFamily(
            "allocwatch_agent_series_collisions",
            "Agents accepted whose series labels coincided with a connected agent's; each is "
            "told apart by its agent_slot label")
        collisions.add_metric([], self._registry.series_collisions())
        yield collisions

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
