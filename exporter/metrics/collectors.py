"""The sidecar's Prometheus collectors, one per source, each building its families fresh on
each scrape (the policy engine's and the admin API's sit beside them, in exporter.policy and
exporter.admin).

Each family's name, help and labels come from the metric table (allocator_ext.protocol.metrics);
the allocator's series and the agents' own figures are read from the report's fields it names.
Allocator series are labelled by rank, local_rank,
cuda_device, gpu_uuid (unknown values are empty labels), plus agent_slot where two live agents'
labels coincide (exporter.shared.series). A departed agent's series give way to a connected
agent's with the same labels (a restarted process before its predecessor expired). Totals and
pool breakdowns have names of their own (`…_reserved_bytes` and `…_pool_reserved_bytes{pool}`),
so that `sum()` over any one metric counts each byte once.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterator
from typing import Any

from google.protobuf.message import Message
from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from allocator_ext.protocol import metrics as metrics_table
from allocator_ext.protocol.metrics import Metric as TableRow
from allocator_ext.protocol.nvml import GpuMemory, NvmlReader
from allocator_ext.protocol.proto.allocwatch.v1 import agent_pb2 as pb
from exporter.shared.families import counter, gauge, named, new_family
from exporter.shared.figures import device_peak_fragmentation_ratio, fragmentation_ratio
from exporter.shared.registry import AgentState, Registry
from exporter.shared.series import (
    agent_labels,
    device_labels,
    label_value,
    with_slot,
)

# Reads one figure from a DeviceReport (or, for the agents' own figures, a Report).
Reader = Callable[[Any], "float | None"]

# What the allocator collector computes rather than reads as it is (every other row of the
# table's "allocator" collector is read from its `field`).
_COMPUTED: dict[str, Reader] = {
    "torch_cuda_allocator_fragmentation_ratio": lambda device: fragmentation_ratio(
        device.allocator.all.reserved_bytes, device.allocator.all.allocated_bytes),
    "torch_cuda_allocator_peak_fragmentation_ratio": device_peak_fragmentation_ratio,
    "torch_cuda_allocator_max_split_size_bytes":  # 0 is PyTorch's SIZE_MAX: unlimited
        lambda device: device.settings.max_split_size_bytes or math.inf,
}


def field_reader(path: str, root: type[Message] = pb.DeviceReport) -> Reader:
    """A reader of the number at `path` (dotted field names from the message `root`): None where
    the field tracks presence and is not set; ValueError naming a path the protocol lacks."""
    *parents, name = path.split(".")
    message = descriptor = root.DESCRIPTOR
    for part in parents:
        field = descriptor.fields_by_name.get(part)
        if field is None or field.message_type is None:
            raise ValueError(f"{path}: {message.name} has no message field {part!r} there")
        descriptor = field.message_type
    field = descriptor.fields_by_name.get(name)
    if field is None or field.message_type is not None:
        raise ValueError(f"{path}: {descriptor.name} has no number field {name!r}")
    whole = operator.attrgetter(path)
    if not field.has_presence:
        return lambda report: float(whole(report))
    parent = operator.attrgetter(".".join(parents)) if parents else (lambda report: report)

    def present(report: Any) -> float | None:
        holder = parent(report)
        return float(getattr(holder, name)) if holder.HasField(name) else None

    return present


def _allocator_readers(row: TableRow) -> tuple[tuple[tuple[tuple[str, str], ...], Reader], ...]:
    """(fixed labels, reader) for each series one device shows of `row`."""
    if row.name in _COMPUTED:
        return (((), _COMPUTED[row.name]),)
    if not row.field:
        raise ValueError(f"{row.name}: the allocator collector reads a field, and the table "
                         "names none (or add how to compute it to _COMPUTED)")
    return tuple((tuple(fixed.items()), field_reader(path))
                 for fixed, path, _ in row.expanded())


_INFO = metrics_table.metric("torch_cuda_allocator_info")
# Every row of the allocator collector but its info series, each with its readers.
_ALLOCATOR = tuple((row, _allocator_readers(row)) for row in metrics_table.of("allocator")
                   if row.type != "info")
_GPU_TOTAL, _GPU_USED, _PROCESS_GPU = named("allocwatch_gpu_memory_total_bytes",
                                           "allocwatch_gpu_memory_used_bytes",
                                           "allocwatch_process_gpu_memory_used_bytes")
_CONNECTED, _WAITING, _LAST_REPORT, _COLLISIONS, _RECEIVED, _COMMANDS, _STREAM_ERRORS = named(
    "allocwatch_agents_connected", "allocwatch_agent_wait_seconds",
    "allocwatch_agent_last_report_timestamp_seconds", "allocwatch_agent_series_collisions_total",
    "allocwatch_reports_received_total", "allocwatch_commands_total",
    "allocwatch_stream_errors_total")
# The agents' own counters, each read from the report's field the table names.
_AGENT_FIGURES = tuple((row, field_reader(row.field, pb.Report))
                       for row in metrics_table.of("agents") if row.per == "agent" and row.field)


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
        # One label set a device and fixed labels (a pool), shared by the families that use it:
        # the exposition writes each label set once a build.
        shared: dict[tuple[int, tuple[tuple[str, str], ...]], dict[str, str]] = {}
        for row, readers in _ALLOCATOR:
            family = new_family(row)
            for index, (labels, _, device) in enumerate(rows):
                for fixed, read in readers:
                    value = read(device)
                    if value is None:
                        continue
                    if fixed:
                        key = (index, fixed)
                        named = shared.get(key)
                        if named is None:
                            named = shared[key] = {**labels, **dict(fixed)}
                        _add(family, named, value)
                    else:
                        _add(family, labels, value)
            yield family

    @staticmethod
    def _info_family(agents: list[AgentState]) -> Metric:
        info = new_family(_INFO)
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
            info.samples.append(Sample(_INFO.name, labels, 1.0))
        return info


class GpuCollector(Collector):
    """allocwatch_gpu_memory_* and allocwatch_process_gpu_memory_used_bytes: the GPUs, from the
    sidecar's own NVML where it sees them, else from what each agent read of its own GPU."""

    def __init__(self, registry: Registry, nvml: NvmlReader | None):
        self._registry = registry
        self._nvml = nvml

    def collect(self) -> Iterator[Metric]:
        total, used, process = gauge(_GPU_TOTAL), gauge(_GPU_USED), gauge(_PROCESS_GPU)
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
        connected = gauge(_CONNECTED)
        connected.add_metric([], sum(1 for a in agents if a.connected))
        yield connected
        # An agent that never connects cannot say so itself: the sidecar does.
        waiting = gauge(_WAITING)
        waiting.add_metric([], self._registry.seconds_without_any_agent())
        yield waiting

        last = new_family(_LAST_REPORT)
        figures = [(new_family(row), read) for row, read in _AGENT_FIGURES]
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
            for family, read in figures:
                value = read(report)
                if value is not None:
                    _add(family, labels, value)
        yield last
        yield from (family for family, _ in figures)
        collisions = counter(_COLLISIONS)
        collisions.add_metric([], self._registry.series_collisions())
        yield collisions

        total = counter(_RECEIVED)
        total.add_metric([], received)
        yield total
        cmd = counter(_COMMANDS)
        for (command, result), count in sorted(commands.items()):
            cmd.add_metric([command, result], count)
        yield cmd
        err = counter(_STREAM_ERRORS)
        for reason, count in sorted(errors.items()):
            err.add_metric([reason], count)
        yield err
