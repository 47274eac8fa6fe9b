#!/usr/bin/env python3
"""Write grafana/dashboards/allocwatch.json, the allocwatch dashboard (Grafana JSON model).

The dashboard is generated so that every panel follows the same conventions (legends by rank
and device, units, rate windows) and a test can check that the committed JSON is this
script's output (`--check`). Edit the panels here, then run:

    python3 grafana/generate_dashboard.py            # rewrite the JSON
    python3 grafana/generate_dashboard.py --check    # exit 1 if the JSON is stale
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from allocator_ext.protocol.metrics import BY_NAME

OUTPUT = Path(__file__).resolve().parent / "dashboards" / "allocwatch.json"

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

# Label matchers shared by the queries: per pod (sidecar series) and per rank (allocator series).
POD = 'namespace=~"$namespace", pod=~"$pod"'
RANK = POD + ', rank=~"$rank", cuda_device=~"$device"'
RATE = "[$__rate_interval]"
BY_RANK = "rank {{rank}} · cuda:{{cuda_device}}"


def by_rank(what: str) -> str:
    return f"{BY_RANK} {what}"


def per_rank_join(device_series: str) -> str:
    """A per-GPU series (labelled gpu_uuid) relabelled with the rank and device using that GPU.

    NVML figures are per GPU, not per rank; adding zero times an allocator series of the same
    GPU carries its rank and cuda_device labels over, so legends read the same everywhere.
    """
    return (
        f"max by (namespace, pod, rank, cuda_device, gpu_uuid) "
        f"(0 * torch_cuda_allocator_reserved_bytes{{{RANK}}})\n"
        f"+ on (namespace, pod, gpu_uuid) group_left ()\n"
        f"max by (namespace, pod, gpu_uuid) ({device_series})"
    )


DCGM_FB_USED_BYTES = (
    # dcgm-exporter labels the GPU `UUID` and reports framebuffer memory in MiB.
    f"max by (namespace, pod, rank, cuda_device, gpu_uuid) "
    f"(0 * torch_cuda_allocator_reserved_bytes{{{RANK}}})\n"
    f"+ on (gpu_uuid) group_left ()\n"
    'max by (gpu_uuid) (label_replace(DCGM_FI_DEV_FB_USED, "gpu_uuid", "$1", "UUID", "(.*)")) * '
    "1048576"
)


def target(expr: str, legend: str, ref: str, *, instant: bool = False, table: bool = False) -> dict:
    t = {
        "datasource": DATASOURCE,
        "editorMode": "code",
        "expr": expr,
        "legendFormat": legend,
        "range": not instant,
        "instant": instant,
        "refId": ref,
    }
    if table:
        t["format"] = "table"
    return t


def timeseries(
    title: str,
    description: str,
    unit: str,
    queries: list[tuple[str, str]],
    *,
    minimum: float | None = 0,
    maximum: float | None = None,
    overrides: list | None = None,
    threshold: float | None = None,
) -> dict:
    defaults: dict = {
        "unit": unit,
        "color": {"mode": "palette-classic"},
        "custom": {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 0,
            "showPoints": "never",
            "spanNulls": False,
            "axisSoftMin": minimum,
        },
    }
    if minimum is not None:
        defaults["min"] = minimum
    if maximum is not None:
        defaults["max"] = maximum
    if threshold is not None:
        # Draw the alert's threshold as a dashed line.
        defaults["custom"]["thresholdsStyle"] = {"mode": "dashed"}
        defaults["thresholds"] = {
            "mode": "absolute",
            "steps": [{"color": "green", "value": None}, {"color": "red", "value": threshold}],
        }
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "targets": [target(e, legend, chr(ord("A") + i)) for i, (e, legend) in enumerate(queries)],
        "fieldConfig": {"defaults": defaults, "overrides": overrides or []},
        "options": {
            "legend": {
                "showLegend": True,
                "displayMode": "table",
                "placement": "bottom",
                "calcs": ["lastNotNull", "max"],
            },
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    }


def dashed(regex: str) -> dict:
    return {
        "matcher": {"id": "byRegexp", "options": regex},
        "properties": [{"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}}],
    }


def unit_override(regex: str, unit: str) -> dict:
    return {
        "matcher": {"id": "byRegexp", "options": regex},
        "properties": [{"id": "unit", "value": unit}],
    }


def table(title: str, description: str, expr: str) -> dict:
    return {
        "type": "table",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "targets": [target(expr, "", "A", instant=True, table=True)],
        "fieldConfig": {"defaults": {}, "overrides": []},
        "options": {"showHeader": True, "cellHeight": "sm"},
        "transformations": [
            {
                "id": "organize",
                "options": {"excludeByName": {"Time": True, "Value": True, "__name__": True}},
            }
        ],
    }


ROWS: list[tuple[str, list[dict]]] = [
    (
        "Memory",
        [
            timeseries(
                "Allocated vs reserved vs device used",
                "Allocated: memory in live tensors. Reserved: what the caching allocator holds "
                "from "
                "the device (allocated plus its cache). Device used (NVML): everything on the GPU, "
                "including the CUDA context, NCCL buffers and other processes. Dashed: the "
                "device's "
                "capacity.",
                "bytes",
                [
                    (f"torch_cuda_allocator_allocated_bytes{{{RANK}}}", by_rank("allocated")),
                    (f"torch_cuda_allocator_reserved_bytes{{{RANK}}}", by_rank("reserved")),
                    (
                        per_rank_join(f"allocwatch_gpu_memory_used_bytes{{{POD}}}"),
                        by_rank("device used"),
                    ),
                    (
                        per_rank_join(f"allocwatch_gpu_memory_total_bytes{{{POD}}}"),
                        by_rank("device total"),
                    ),
                ],
                overrides=[dashed(".*device total")],
            ),
            timeseries(
                "Peak fragmentation",
                "1 − peak allocated ÷ peak reserved of each report interval: what the cache holds "
                "beyond its most-used moment (0 for a cache that strands nothing). Intervals "
                "without a step's peak read higher; the 15-minute minimum is what the "
                "AllocwatchFragmentationHigh alert reads, and the dashed line its threshold.",
                "percentunit",
                [
                    (f"torch_cuda_allocator_peak_fragmentation_ratio{{{RANK}}}", BY_RANK),
                    (
                        f"min_over_time(torch_cuda_allocator_peak_fragmentation_ratio"
                        f"{{{RANK}}}[15m])",
                        by_rank("15-minute minimum"),
                    ),
                ],
                maximum=1,
                threshold=0.25,
                overrides=[dashed(".*15-minute minimum")],
            ),
            timeseries(
                "Unused share of the cache",
                "(reserved − allocated) ÷ reserved right now (torch_cuda_allocator_"
                "fragmentation_ratio). High between steps for any healthy cache: freed "
                "activations stay cached for the next step. Peak fragmentation says what is "
                "stranded.",
                "percentunit",
                [
                    (f"torch_cuda_allocator_fragmentation_ratio{{{RANK}}}", BY_RANK),
                    (
                        f"sum(torch_cuda_allocator_reserved_bytes{{{RANK}}} - "
                        f"torch_cuda_allocator_allocated_bytes{{{RANK}}})\n"
                        f"/ (sum(torch_cuda_allocator_reserved_bytes{{{RANK}}}) > 0)",
                        "all selected ranks, weighted by reserved memory",
                    ),
                ],
                maximum=1,
            ),
            timeseries(
                "Unused reserved memory",
                "Reserved − allocated: memory cached by the allocator and in no tensor.",
                "bytes",
                [
                    (
                        f"torch_cuda_allocator_reserved_bytes{{{RANK}}} - "
                        f"torch_cuda_allocator_allocated_bytes{{{RANK}}}",
                        BY_RANK,
                    )
                ],
            ),
            timeseries(
                "Peaks and requested bytes",
                "Peak allocated and peak reserved since the process started (or since its peaks "
                "were reset); requested: the bytes the program asked for, before rounding.",
                "bytes",
                [
                    (
                        f"torch_cuda_allocator_peak_allocated_bytes{{{RANK}}}",
                        by_rank("peak allocated"),
                    ),
                    (
                        f"torch_cuda_allocator_peak_reserved_bytes{{{RANK}}}",
                        by_rank("peak reserved"),
                    ),
                    (f"torch_cuda_allocator_requested_bytes{{{RANK}}}", by_rank("requested")),
                    (f"torch_cuda_allocator_active_bytes{{{RANK}}}", by_rank("active")),
                ],
            ),
            timeseries(
                "This process on the GPU (NVML)",
                "The GPU memory NVML attributes to the training process itself (its CUDA context "
                "included), beside what its allocator reserved.",
                "bytes",
                [
                    (
                        per_rank_join(f"allocwatch_process_gpu_memory_used_bytes{{{POD}}}"),
                        by_rank("process (NVML)"),
                    ),
                    (f"torch_cuda_allocator_reserved_bytes{{{RANK}}}", by_rank("reserved")),
                ],
            ),
            timeseries(
                "Segments and inactive split memory",
                "Segments: device allocations the cache holds. Inactive split: free pieces of "
                "split blocks, the part of the cache that fragmentation leaves unusable for large "
                "requests. Largest free block: the biggest request the cache serves without a "
                "device call (allocwatch's allocator only).",
                "bytes",
                [
                    (
                        f"torch_cuda_allocator_inactive_split_bytes{{{RANK}}}",
                        by_rank("inactive split"),
                    ),
                    (
                        f"torch_cuda_allocator_largest_free_block_bytes{{{RANK}}}",
                        by_rank("largest free block"),
                    ),
                    (f"torch_cuda_allocator_segments{{{RANK}}}", by_rank("segments")),
                ],
                overrides=[unit_override(".*segments", "short")],
            ),
            timeseries(
                "Reserved and allocated by pool",
                "The pool breakdown (small: requests up to 1 MiB, in 2 MiB segments; large: the "
                "rest), under names of its own: the two pools add up to the totals above.",
                "bytes",
                [
                    (
                        f"torch_cuda_allocator_pool_reserved_bytes{{{RANK}}}",
                        by_rank("{{pool}} reserved"),
                    ),
                    (
                        f"torch_cuda_allocator_pool_allocated_bytes{{{RANK}}}",
                        by_rank("{{pool}} allocated"),
                    ),
                ],
            ),
        ],
    ),
    (
        "Allocator events",
        [
            timeseries(
                "Allocation retries and out-of-memory errors",
                "Retries: a device allocation failed, the cache was flushed and the allocation "
                "retried. OOMs: it failed again. See the runbooks AllocwatchAllocRetries and "
                "AllocwatchOutOfMemory.",
                "ops",
                [
                    (
                        f"rate(torch_cuda_allocator_alloc_retries_total{{{RANK}}}{RATE})",
                        by_rank("retries"),
                    ),
                    (f"rate(torch_cuda_allocator_ooms_total{{{RANK}}}{RATE})", by_rank("OOMs")),
                ],
            ),
            timeseries(
                "Device allocations and frees",
                "cudaMalloc / cudaFree (or page maps and unmaps with expandable segments) per "
                "second, and under allocwatch's allocator the driver calls behind them, by call "
                "(a mapping makes one a page). "
                "A steady rate in a training loop means the cache does not hold the working set.",
                "ops",
                [
                    (
                        f"rate(torch_cuda_allocator_device_mallocs_total{{{RANK}}}{RATE})",
                        by_rank("device mallocs"),
                    ),
                    (
                        f"rate(torch_cuda_allocator_device_frees_total{{{RANK}}}{RATE})",
                        by_rank("device frees"),
                    ),
                    (
                        f"rate(torch_cuda_allocator_device_calls_total{{{RANK}}}{RATE})",
                        by_rank("driver {{call}} calls"),
                    ),
                ],
            ),
            timeseries(
                "Cache releases and full synchronisations",
                "empty_cache() calls and synchronisations of every stream per second. A steady "
                "rate "
                "is empty_cache() in the training loop (runbook AllocwatchEmptyCacheInLoop).",
                "ops",
                [
                    (
                        f"rate(torch_cuda_allocator_empty_cache_calls_total{{{RANK}}}{RATE})",
                        by_rank("empty_cache"),
                    ),
                    (
                        f"rate(torch_cuda_allocator_sync_all_streams_total{{{RANK}}}{RATE})",
                        by_rank("sync all streams"),
                    ),
                ],
            ),
            timeseries(
                "Host waits and device-side orderings",
                "Times per second the allocator made the host wait for the GPU, by what it waited "
                "for (device: cudaDeviceSynchronize, stream: cudaStreamSynchronize, event: "
                "cudaEventSynchronize), and the orderings it made on the device instead "
                "(cudaStreamWaitEvent), which cost the host nothing. Host waits in a training "
                "loop stall the CPU that feeds the GPU.",
                "ops",
                [
                    (
                        f"rate(torch_cuda_allocator_host_waits_total{{{RANK}}}{RATE})",
                        by_rank("{{scope}} waits"),
                    ),
                    (
                        f"rate(torch_cuda_allocator_stream_waits_total{{{RANK}}}{RATE})",
                        by_rank("stream orderings"),
                    ),
                ],
            ),
            timeseries(
                "Allocations",
                "Tensor allocations served per second.",
                "ops",
                [(f"rate(torch_cuda_allocator_allocations_total{{{RANK}}}{RATE})", BY_RANK)],
            ),
        ],
    ),
    (
        "Pending frees (cross-stream)",
        [
            timeseries(
                "Pending events",
                "Blocks freed while another stream may still use them (record_stream): each waits "
                "for its events before it can be reused.",
                "short",
                [(f"torch_cuda_allocator_pending_events{{{RANK}}}", BY_RANK)],
            ),
            timeseries(
                "Pending free bytes",
                "Bytes held by blocks waiting for their events.",
                "bytes",
                [(f"torch_cuda_allocator_pending_free_bytes{{{RANK}}}", BY_RANK)],
            ),
        ],
    ),
    (
        "Reclaims and tuning",
        [
            timeseries(
                "Garbage-collection reclaims",
                "Reclaims by garbage_collection_threshold per second, and the bytes they returned "
                "to the device.",
                "ops",
                [
                    (
                        f"rate(torch_cuda_allocator_gc_reclaims_total{{{RANK}}}{RATE})",
                        by_rank("reclaims"),
                    ),
                    (
                        f"rate(torch_cuda_allocator_gc_reclaimed_bytes_total{{{RANK}}}{RATE})",
                        by_rank("reclaimed bytes"),
                    ),
                ],
                overrides=[unit_override(".*reclaimed bytes", "Bps")],
            ),
            timeseries(
                "Tuning actions",
                "Actions the sidecar's policy engine took, by rule and action.",
                "ops",
                [
                    (
                        "sum by (pod, rule, action) "
                        f"(rate(allocwatch_policy_actions_total{{{POD}}}{RATE}))",
                        "{{pod}} {{rule}} → {{action}}",
                    )
                ],
            ),
            timeseries(
                "Commands",
                "Commands sent to agents (settings, reclaims, snapshots) by result.",
                "ops",
                [
                    (
                        "sum by (pod, command, result) "
                        f"(rate(allocwatch_commands_total{{{POD}}}{RATE}))",
                        "{{pod}} {{command}} {{result}}",
                    )
                ],
            ),
            timeseries(
                "Settings in force",
                "garbage_collection_threshold (0 = off), max_split_size and expandable segments "
                "(1 = on) as each rank runs them now; a step shows a change by the policy or by "
                "ctl.",
                "percentunit",
                [
                    (f"torch_cuda_allocator_gc_threshold_ratio{{{RANK}}}", by_rank("gc threshold")),
                    (
                        f"torch_cuda_allocator_max_split_size_bytes{{{RANK}}}",
                        by_rank("max split size"),
                    ),
                    (
                        f"torch_cuda_allocator_expandable_segments{{{RANK}}}",
                        by_rank("expandable segments"),
                    ),
                ],
                overrides=[
                    unit_override(".*max split size", "bytes"),
                    unit_override(".*expandable segments", "bool_on_off"),
                ],
            ),
        ],
    ),
    (
        "Agents and sidecar",
        [
            timeseries(
                "Sidecar up",
                "1 when Prometheus scrapes the sidecar (runbook AllocwatchSidecarDown).",
                "short",
                [(f'up{{container="allocwatch-sidecar", {POD}}}', "{{pod}}")],
                maximum=1,
            ),
            timeseries(
                "Agents connected",
                "Training processes connected to each sidecar (runbooks AllocwatchAgentGone, "
                "AllocwatchNoAgentConnected), and agents whose series labels coincided with a "
                "live agent's: each is shown apart, with an agent_slot label.",
                "short",
                [
                    (f"allocwatch_agents_connected{{{POD}}}", "{{pod}}"),
                    (
                        f"allocwatch_agent_series_collisions_total{{{POD}}}",
                        "{{pod}} label collisions",
                    ),
                ],
            ),
            timeseries(
                "Time since each agent's last report",
                "Agents report every second by default (runbook AllocwatchAgentSilent).",
                "s",
                [
                    (
                        f"time() - allocwatch_agent_last_report_timestamp_seconds{{{POD}}}",
                        "{{pod}} rank {{rank}}",
                    )
                ],
            ),
            timeseries(
                "Reports received and dropped",
                "Reports per second the sidecar received, and those agents dropped because their "
                "bounded buffer was full (counted, never blocking training).",
                "ops",
                [
                    (
                        f"sum by (pod) (rate(allocwatch_reports_received_total{{{POD}}}{RATE}))",
                        "{{pod}} received",
                    ),
                    (
                        "sum by (pod) "
                        f"(rate(allocwatch_agent_dropped_reports_total{{{POD}}}{RATE}))",
                        "{{pod}} dropped",
                    ),
                ],
            ),
            table(
                "Training processes",
                "One row per agent: backend, versions, pid and host.",
                f"torch_cuda_allocator_info{{{POD}}}",
            ),
            table(
                "Sidecar versions",
                "allocwatch_build_info of each sidecar; agents and sidecars work together one "
                "minor "
                "version apart.",
                f"allocwatch_build_info{{{POD}}}",
            ),
        ],
    ),
    (
        "dcgm-exporter (where installed)",
        [
            timeseries(
                "Framebuffer used (dcgm-exporter) vs reserved",
                "dcgm-exporter's DCGM_FI_DEV_FB_USED (MiB, converted to bytes), joined to each "
                "rank "
                "by GPU UUID (dcgm's `UUID` is our `gpu_uuid`). The gap above reserved is the CUDA "
                "context, NCCL and anything not allocated through the caching allocator. Empty "
                "where dcgm-exporter is not installed.",
                "bytes",
                [
                    (DCGM_FB_USED_BYTES, by_rank("framebuffer used (dcgm)")),
                    (f"torch_cuda_allocator_reserved_bytes{{{RANK}}}", by_rank("reserved")),
                ],
            ),
        ],
    ),
]


def variable_query(name: str, label: str, query: str, metric_label: str) -> dict:
    return {
        "type": "query",
        "name": name,
        "label": label,
        "datasource": DATASOURCE,
        "definition": query,
        "query": {
            "qryType": 1,
            "query": query,
            "refId": "PrometheusVariableQueryEditor-VariableQuery",
        },
        "refresh": 2,
        "multi": True,
        "includeAll": True,
        "allValue": ".*",
        "current": {},
        "sort": 3 if metric_label in ("rank", "cuda_device") else 1,
        "regex": "",
        "hide": 0,
    }


def layout(rows: list[tuple[str, list[dict]]]) -> list[dict]:
    panels: list[dict] = []
    next_id = 1
    y = 0
    for title, row_panels in rows:
        panels.append(
            {
                "type": "row",
                "title": title,
                "collapsed": False,
                "id": next_id,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        next_id += 1
        y += 1
        for i, panel in enumerate(row_panels):
            panel = dict(panel, id=next_id)
            next_id += 1
            panel["gridPos"] = {"h": 8, "w": 12, "x": 12 * (i % 2), "y": y + 8 * (i // 2)}
            panels.append(panel)
        y += 8 * ((len(row_panels) + 1) // 2)
    return panels


def dashboard() -> dict:
    return {
        "uid": "allocwatch-allocator",
        "title": "allocwatch: GPU caching allocator",
        "description": (
            "PyTorch CUDA caching allocator, per rank and device, from the allocwatch sidecar."
        ),
        "tags": ["allocwatch", "gpu", "pytorch"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "timezone": "browser",
        "time": {"from": "now-3h", "to": "now"},
        "refresh": "30s",
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        # No link to the runbooks: their address is the deployment's (deploy/components/
        # runbook-url), which a dashboard shipped as a ConfigMap cannot take; each alert carries it.
        "links": [],
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "templating": {
            "list": [
                {
                    "type": "datasource",
                    "name": "datasource",
                    "label": "Data source",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                    "includeAll": False,
                    "multi": False,
                    "refresh": 1,
                    "regex": "",
                },
                # Namespaces and pods come from the sidecar's own series, so a sidecar that no
                # agent has reached yet can still be selected.
                variable_query(
                    "namespace",
                    "Namespace",
                    "label_values(allocwatch_build_info, namespace)",
                    "namespace",
                ),
                variable_query(
                    "pod",
                    "Pod",
                    'label_values(allocwatch_build_info{namespace=~"$namespace"}, pod)',
                    "pod",
                ),
                variable_query(
                    "rank",
                    "Rank",
                    f"label_values(torch_cuda_allocator_allocated_bytes{{{POD}}}, rank)",
                    "rank",
                ),
                variable_query(
                    "device",
                    "CUDA device",
                    f'label_values(torch_cuda_allocator_allocated_bytes{{{POD}, rank=~"$rank"}}, '
                    "cuda_device)",
                    "cuda_device",
                ),
            ]
        },
        "panels": layout(ROWS),
    }


# allocwatch's own metric names wherever the dashboard writes them: queries, variables, text.
OUR_NAMES = re.compile(r"\b(?:torch_cuda_allocator|allocwatch)_[a-z0-9_]*[a-z0-9]")


def unknown_metrics(text: str) -> list[str]:
    """The names of ours in `text` that the metric table (allocator_ext/protocol/metrics.py)
    does not hold."""
    return sorted(set(OUR_NAMES.findall(text)) - set(BY_NAME))


def render() -> str:
    text = json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n"
    unknown = unknown_metrics(text)
    if unknown:
        raise SystemExit(f"the dashboard names metrics the sidecar does not expose "
                         f"(allocator_ext/protocol/metrics.py): {', '.join(unknown)}")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the JSON is stale")
    args = parser.parse_args(argv)
    wanted = render()
    if args.check:
        if not OUTPUT.exists() or OUTPUT.read_text() != wanted:
            print(f"{OUTPUT} is stale: run python3 grafana/generate_dashboard.py", file=sys.stderr)
            return 1
        return 0
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(wanted)
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
