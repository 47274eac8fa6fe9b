"""Every metric the sidecar exposes, in one table: name, type, help, labels, and where its value
comes from.

What is derived from it: the collectors' families (exporter.metrics, exporter.policy,
exporter.admin, exporter.sidecar; the allocator's and the agents' per-report series are read
from the report through `field`), the series bound (`series_per_device`, `series_per_agent`),
the Grafana generator's check of the names it queries, the metric list in docs/sidecar.md (a
test compares them), and the tests' lists of names. Adding a metric is one row here; a figure
new to the report also needs its field in protos/allocwatch/v1/agent.proto and its line in
allocator_ext/agent/convert.py (a test checks that every `stats_key` reaches its `field`).

Names are as queried: counters end in `_total`, info series in `_info`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

Type = Literal["gauge", "counter", "info"]
# What one series of a metric stands for: a device a process reports (labelled by SERIES_LABELS),
# an agent (the same labels, of its primary device), a GPU (gpu_uuid), or the sidecar itself.
Per = Literal["device", "agent", "gpu", "sidecar"]
# The custom collector each metric comes from, one per source (DESIGN.md, "Metric names").
Collector = Literal["allocator", "gpu", "agents", "bounds", "policy", "admin", "http", "sidecar"]

# The labels of every allocator series and of each agent's own series (agent_slot is added
# where two live agents' coincide: exporter.shared.series).
SERIES_LABELS = ("rank", "local_rank", "cuda_device", "gpu_uuid")
INFO_LABELS = ("backend", "torch_version", "cuda_version", "pid", "host", "training_job",
               "world_size", "agent_version", "protocol")
POOLS = ("small", "large")
WAIT_SCOPES = ("device", "stream", "event", "unmap_thread")
# The device calls allocwatch's allocator counts (num_device_calls.*, core/counted_device.h).
DEVICE_CALLS = ("segment_alloc", "segment_free", "create", "release", "map", "set_access",
                "unmap")


@dataclasses.dataclass(frozen=True)
class Metric:
    name: str
    type: Type
    help: str
    per: Per
    collector: Collector
    labels: tuple[str, ...] = ()    # beyond the series labels of `per`
    # The values of the labels above that the table fixes (each makes a series per device or
    # agent); labels it does not fix take what happens (a command, a rule, a reason).
    values: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # Where the value comes from. `field`: a path in the report (from DeviceReport for `per`
    # device, from Report for `per` agent), `{label}` standing for each of its fixed values; the
    # collector reads it as it is. `stats_key`: the torch.cuda.memory_stats() key the agent
    # converts into that field. `source`: in words, for what the sidecar computes or counts.
    field: str = ""
    stats_key: str = ""
    source: str = ""
    # A sample for each of its series from an agent's first report on (or, per sidecar, from the
    # start); False where samples appear only once something happened or a source can tell.
    always: bool = True

    @property
    def family(self) -> str:
        """The name prometheus_client's families take: without the `_total` or `_info`."""
        suffix = {"counter": "_total", "info": "_info"}.get(self.type, "")
        return self.name.removesuffix(suffix) if suffix else self.name

    @property
    def series_labels(self) -> tuple[str, ...]:
        return SERIES_LABELS if self.per in ("device", "agent") else \
            ("gpu_uuid",) if self.per == "gpu" else ()

    @property
    def all_labels(self) -> tuple[str, ...]:
        return (*self.series_labels, *self.labels)

    def expanded(self) -> Iterator[tuple[dict[str, str], str, str]]:
        """(fixed labels, field, stats key) for each combination of the fixed label values."""
        names = [name for name, _ in self.values]
        for combination in itertools.product(*(values for _, values in self.values)):
            labels = dict(zip(names, combination, strict=True))
            yield labels, self.field.format(**labels), self.stats_key.format(**labels)

    @property
    def series_each(self) -> int:
        """The series it shows for each device or agent (`per`), at most."""
        return math.prod(len(values) for _, values in self.values)

    def where_from(self) -> str:
        """Its source, in words (docs/sidecar.md)."""
        if self.stats_key:
            return f"`{self.stats_key}` (report: `{self.field}`)"
        if self.field:
            return f"report: `{self.field}`" + (f"; {self.source}" if self.source else "")
        return self.source


def _device(name: str, type: Type, help: str, *, labels: tuple[str, ...] = (),
            values: tuple[tuple[str, tuple[str, ...]], ...] = (), field: str = "",
            stats_key: str = "", source: str = "", always: bool = True) -> Metric:
    return Metric(f"torch_cuda_allocator_{name}", type, help, "device", "allocator", labels,
                  values, field, stats_key, source, always)


def _total(name: str, stats: str, help: str) -> Metric:
    """A gauge over both pools, from the report's `allocator.all`."""
    moment = "peak" if name.startswith("peak_") else "current"
    return _device(name, "gauge", help, field=f"allocator.all.{name}",
                   stats_key=f"{stats}.all.{moment}")


def _pool(name: str, stats: str, help: str) -> Metric:
    """A gauge by pool, under a name of its own."""
    return _device(f"pool_{name}", "gauge", help, labels=("pool",), values=(("pool", POOLS),),
                   field=f"allocator.{{pool}}_pool.{name}",
                   stats_key=f"{stats}.{{pool}}_pool.current")


def _counter(name: str, stats: str, help: str) -> Metric:
    return _device(f"{name}_total", "counter", help, field=f"allocator.{name}", stats_key=stats)


def _agent(name: str, type: Type, help: str, *, field: str = "", source: str = "") -> Metric:
    return Metric(name, type, help, "agent", "agents", field=field, source=source)


def _sidecar(name: str, type: Type, help: str, collector: Collector, source: str,
             labels: tuple[str, ...] = (), always: bool = True) -> Metric:
    return Metric(name, type, help, "sidecar", collector, labels=labels, source=source,
                  always=always)


METRICS: tuple[Metric, ...] = (
    # ---- the allocator (AllocatorCollector): gauges over both pools
    _total("allocated_bytes", "allocated_bytes", "Bytes in blocks handed out to tensors"),
    _total("reserved_bytes", "reserved_bytes", "Bytes of device memory held by the allocator"),
    _total("active_bytes", "active_bytes",
           "Bytes in active blocks (allocated, or freed with pending stream uses)"),
    _total("requested_bytes", "requested_bytes", "Bytes requested by tensors, before rounding"),
    _total("inactive_split_bytes", "inactive_split_bytes",
           "Free bytes inside split segments (not releasable)"),
    _total("segments", "segment", "Device allocations (segments) held"),
    _total("peak_allocated_bytes", "allocated_bytes",
           "Peak allocated bytes since the process's last peak reset"),
    _total("peak_reserved_bytes", "reserved_bytes",
           "Peak reserved bytes since the process's last peak reset"),
    # the pool breakdown, under names of its own, so that sum() over any metric means something
    _pool("allocated_bytes", "allocated_bytes", "Bytes handed out to tensors, by pool"),
    _pool("reserved_bytes", "reserved_bytes", "Bytes of device memory held, by pool"),
    _pool("inactive_split_bytes", "inactive_split_bytes",
          "Free bytes inside split segments, by pool"),
    _device("pending_free_bytes", "gauge", "Freed bytes waiting for stream events before reuse",
            field="allocator.pending_free_bytes", stats_key="pending_free_bytes"),
    _device("pending_events", "gauge", "Stream events not yet completed",
            field="allocator.pending_events", stats_key="pending_events"),
    _device("fragmentation_ratio", "gauge",
            "(reserved - allocated) / reserved: the share of the cache unused at this moment "
            "(high between steps for any healthy cache); 0 when nothing is reserved",
            source="computed from `allocator.all.reserved_bytes` and "
                   "`allocator.all.allocated_bytes`"),
    _device("peak_fragmentation_ratio", "gauge",
            "1 - peak allocated / peak reserved over the report interval: what the cache holds "
            "beyond its most-used moment; 0 for an unfragmented cache",
            source="computed from `interval_peaks` (else the peaks since the last reset)"),
    _device("largest_free_block_bytes", "gauge",
            "The largest cached free block: the biggest request served without a device call "
            "(absent where the allocator cannot tell)",
            field="allocator.largest_free_block_bytes",
            source="the source's `largest_free_block()`; absent from PyTorch's allocator",
            always=False),
    _device("gc_threshold_ratio", "gauge", "garbage_collection_threshold in force (0: off)",
            field="settings.garbage_collection_threshold", source="the settings in force"),
    _device("max_split_size_bytes", "gauge", "max_split_size in force (+Inf: unlimited)",
            field="settings.max_split_size_bytes", source="the settings in force; 0 reads +Inf"),
    _device("expandable_segments", "gauge", "1 when expandable segments are on",
            field="settings.expandable_segments", source="the settings in force"),
    _device("pending_unmap_bytes", "gauge",
            "Bytes of pages mapped at a new place and still mapped at their old one, until the "
            "streams that used them there are done",
            field="allocator.pending_unmap_bytes", stats_key="pending_unmap_bytes"),
    # counters, cumulative in the process
    _counter("alloc_retries", "num_alloc_retries",
             "Allocations that freed cached blocks and retried"),
    _counter("ooms", "num_ooms", "Out-of-memory errors raised"),
    _counter("device_mallocs", "num_device_alloc",
             "Device memory allocations (cudaMalloc or mappings)"),
    _counter("device_frees", "num_device_free", "Device memory releases"),
    _counter("sync_all_streams", "num_sync_all_streams",
             "Device-wide synchronisations by the allocator"),
    _counter("gc_reclaims", "num_gc_reclaims", "Garbage-collection reclaims run"),
    _counter("gc_reclaimed_bytes", "gc_reclaimed_bytes", "Bytes released by garbage collection"),
    _counter("empty_cache_calls", "num_empty_cache_calls", "empty_cache() calls"),
    _counter("allocations", "allocation.all.allocated", "Allocations served"),
    _device("host_waits_total", "counter",
            "Times the allocator made the host wait, by scope (device: cudaDeviceSynchronize, "
            "stream: cudaStreamSynchronize, event: cudaEventSynchronize, unmap_thread: its "
            "own thread's unmaps of moved pages, where the whole cache is released)",
            labels=("scope",), values=(("scope", WAIT_SCOPES),),
            field="allocator.host_waits_{scope}", stats_key="num_host_waits.{scope}"),
    _counter("stream_waits", "num_stream_waits",
             "Orderings the allocator made on the device without the host waiting "
             "(cudaStreamWaitEvent)"),
    _device("device_calls_total", "counter",
            "Memory calls the allocator made of the driver, by call (segment_alloc: cudaMalloc, "
            "segment_free: cudaFree, create: cuMemCreate, release: cuMemRelease, map: cuMemMap, "
            "set_access: cuMemSetAccess, unmap: cuMemUnmap): one a page mapped or unmapped, "
            "where device_mallocs counts a mapping (0 from PyTorch's allocator)",
            labels=("call",), values=(("call", DEVICE_CALLS),),
            field="allocator.device_calls_{call}", stats_key="num_device_calls.{call}"),
    _device("info", "info", "The training process behind the allocator series",
            labels=INFO_LABELS, source="the agent's hello (and the protocol version it speaks); "
                                       "one series per device the process reports"),
    # ---- the GPUs, from NVML (GpuCollector): the sidecar's own reading, else the agents'
    Metric("allocwatch_gpu_memory_total_bytes", "gauge", "GPU memory, from NVML", "gpu", "gpu",
           field="device_memory.total_bytes", source="the sidecar's NVML where it sees the GPU",
           always=False),
    Metric("allocwatch_gpu_memory_used_bytes", "gauge",
           "GPU memory in use by every process, from NVML", "gpu", "gpu",
           field="device_memory.used_bytes", source="the sidecar's NVML where it sees the GPU",
           always=False),
    Metric("allocwatch_process_gpu_memory_used_bytes", "gauge",
           "GPU memory used by the training process, from NVML", "device", "gpu",
           field="device_memory.process_used_bytes",
           source="where NVML lists the process's PID (`has_process_used_bytes`)", always=False),
    # ---- the agents' streams (AgentsCollector)
    _sidecar("allocwatch_agents_connected", "gauge", "Agents with an open stream", "agents",
             "the agents' registry"),
    _sidecar("allocwatch_agent_wait_seconds", "gauge",
             "Seconds since the sidecar started, while no agent has ever connected (0 once one "
             "has)", "agents", "the agents' registry"),
    _agent("allocwatch_agent_last_report_timestamp_seconds", "gauge",
           "When the sidecar last received a report from the agent",
           source="the sidecar's clock at the report"),
    _agent("allocwatch_agent_dropped_reports_total", "counter",
           "Reports the agent sampled but could not send", field="agent.reports_dropped_total"),
    _agent("allocwatch_agent_reports_sampled_total", "counter",
           "Reports the agent sampled, sent or not", field="agent.reports_sampled_total"),
    _agent("allocwatch_agent_sample_errors_total", "counter",
           "Samples of the allocator that failed in the agent (no report made)",
           field="agent.sample_errors_total"),
    _agent("allocwatch_agent_reconnects_total", "counter",
           "Times the agent opened its stream again after losing it",
           field="agent.reconnects_total"),
    _sidecar("allocwatch_agent_series_collisions_total", "counter",
             "Agents accepted whose series labels coincided with a connected agent's; each is "
             "told apart by its agent_slot label", "agents", "the agents' registry"),
    _sidecar("allocwatch_reports_received_total", "counter",
             "Reports received from all agents since the sidecar started", "agents",
             "the agents' registry"),
    _sidecar("allocwatch_commands_total", "counter", "Commands sent to agents, by result",
             "agents", "the agents' registry", labels=("command", "result"), always=False),
    _sidecar("allocwatch_stream_errors_total", "counter",
             "Agent streams refused or ended by bad input, by reason", "agents",
             "the agents' gRPC server", labels=("reason",), always=False),
    # ---- the sidecar's bounds at work (BoundsCollector)
    _sidecar("allocwatch_departed_agents_dropped_total", "counter",
             "Departed agents forgotten before their expiry, oldest first, to keep within "
             "agents.max_departed_agents", "bounds", "the agents' registry"),
    _sidecar("allocwatch_series_dropped_total", "counter",
             "Series left out of /metrics to keep within agents.max_series: departed agents' "
             "(oldest first), then the devices of a report that did not fit", "bounds",
             "the agents' registry"),
    _sidecar("allocwatch_agents_refused_total", "counter", "Agents' hellos refused, by reason",
             "bounds", "the agents' registry", labels=("reason",), always=False),
    _sidecar("allocwatch_refused_total", "counter",
             "Clients refused by the listeners, by reason (agent_token, admin_token, "
             "metrics_token, peer_user, health_watch_limit); their warnings are rate-limited",
             "bounds", "the listeners", labels=("reason",), always=False),
    _sidecar("allocwatch_figures_dropped_total", "counter",
             "Figures from agents never exported, by reason (non_finite, out_of_range, "
             "inconsistent): the device entry holding one is left out of the report kept",
             "bounds", "the screening of reports", labels=("reason",), always=False),
    # ---- the policy engine (PolicyCollector)
    _sidecar("allocwatch_policy_actions_total", "counter",
             "Actions decided by the policy engine, by result (dry_run: decided, not sent)",
             "policy", "the policy engine", labels=("rule", "action", "result"), always=False),
    _sidecar("allocwatch_policy_suppressed_total", "counter",
             "Actions a firing rule did not take, by reason", "policy", "the policy engine",
             labels=("rule", "reason"), always=False),
    _sidecar("allocwatch_policy_rule_firing", "gauge", "Agent devices on which the rule is firing",
             "policy", "the policy engine", labels=("rule",), always=False),
    # ---- the admin API (AdminCollector, once it listens)
    _sidecar("allocwatch_admin_requests_total", "counter",
             "Admin API requests, by endpoint and HTTP status", "admin", "the admin API",
             labels=("endpoint", "code"), always=False),
    # ---- the HTTP listeners' limits (HttpCollector)
    _sidecar("allocwatch_http_connections", "gauge",
             "HTTP connections open, by server (metrics, admin)", "http", "the HTTP listeners",
             labels=("server",)),
    _sidecar("allocwatch_http_connections_closed_total", "counter",
             "HTTP connections closed by the listeners' limits, by server and reason "
             "(idle_evicted, all_busy, request_timeout, body_timeout, slow_reader)", "http",
             "the HTTP listeners",
             labels=("server", "reason"), always=False),
    # ---- the sidecar itself (SidecarCollector)
    _sidecar("allocwatch_build_info", "info", "The sidecar's version", "sidecar",
             "the sidecar's package and protocol versions", labels=("version", "protocol")),
    _sidecar("allocwatch_config_reloads_total", "counter",
             "Settings file changes seen, by result (ok, partial: some fields need a restart, "
             "invalid: refused, unreadable)", "sidecar", "the settings file's watcher",
             labels=("result",), always=False),
    _sidecar("allocwatch_config_last_reload_successful", "gauge",
             "1 when the last settings file seen was accepted", "sidecar",
             "the settings file's watcher", always=False),
)

BY_NAME = {metric.name: metric for metric in METRICS}


def metric(name: str) -> Metric:
    """The table's row for `name` (as queried); KeyError naming it when there is none."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is no metric of allocator_ext/protocol/metrics.py") from None


def of(collector: Collector) -> tuple[Metric, ...]:
    """The rows of one collector, in the table's order (the order of the exposition)."""
    return tuple(m for m in METRICS if m.collector == collector)


def series_per_device() -> int:
    """The series one reported device adds to /metrics, at most: its allocator series, its info
    series, its process's GPU memory and its GPU's."""
    return sum(m.series_each for m in METRICS if m.per in ("device", "gpu"))


def series_per_agent() -> int:
    """The series an agent adds besides its devices': its own (last report, its counters)."""
    return sum(m.series_each for m in METRICS if m.per == "agent")


# docs/sidecar.md holds the table's rendering between these lines (a test compares them);
# `python3 -m allocator_ext.protocol.metrics docs/sidecar.md` rewrites it.
DOCS_BEGIN = "<!-- the metric table (allocator_ext/protocol/metrics.py), rendered -->"
DOCS_END = "<!-- end of the metric table -->"


def markdown() -> str:
    """The table as docs/sidecar.md shows it, between DOCS_BEGIN and DOCS_END."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = [DOCS_BEGIN, "",
             f"*series*: `{', '.join(SERIES_LABELS)}` (and `agent_slot` where two agents' "
             "coincide). Per device: "
             f"{series_per_device()} series at most; per agent, besides: {series_per_agent()}.",
             "", "| metric | type | labels | what | from |", "| --- | --- | --- | --- | --- |"]
    for m in METRICS:
        labels = ", ".join(["*series*", *m.labels] if m.per in ("device", "agent")
                           else m.all_labels)
        values = "; ".join(f"{name}: {'|'.join(v)}" for name, v in m.values)
        lines.append(f"| `{m.name}` | {m.type} | {cell(labels)} | {cell(m.help)}"
                     f"{cell(f' ({values})') if values else ''} | {cell(m.where_from())} |")
    return "\n".join([*lines, "", DOCS_END])


def _rewrite(path: str) -> None:
    doc = Path(path)
    text = doc.read_text()
    begin, end = text.index(DOCS_BEGIN), text.index(DOCS_END) + len(DOCS_END)
    doc.write_text(text[:begin] + markdown() + text[end:])


if __name__ == "__main__":
    _rewrite(sys.argv[1])
