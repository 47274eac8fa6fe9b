"""grafana/: the dashboard is its generator's output, uses the current JSON model, every
panel has a unit and per-rank legends, every PromQL expression parses (promtool) and selects
only metrics the sidecar exposes (or dcgm-exporter's and Prometheus' own)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
from support.deploy import (
    DASHBOARD,
    FOREIGN_METRICS,
    GRAFANA,
    SIDECAR_METRICS,
    metric_names,
    run_promtool_check,
    substitute_grafana_variables,
)

BOARD = json.loads(DASHBOARD.read_text())
PANELS = [p for p in BOARD["panels"] if p["type"] != "row"]
TARGETS = [(p["title"], t) for p in PANELS for t in p["targets"]]
VARIABLES = {v["name"]: v for v in BOARD["templating"]["list"]}


def dashboard_expressions() -> dict[str, str]:
    exprs = {f"panel_{i}": t["expr"] for i, (_, t) in enumerate(TARGETS)}
    for name, variable in VARIABLES.items():
        if variable["type"] == "query":
            query = variable["query"]["query"]
            # label_values(<selector>, label) is Grafana's; the selector inside is PromQL.
            inner = query[len("label_values(") : query.rindex(",")]
            exprs[f"variable_{name}"] = inner
    return exprs


def test_json_is_the_generators_output() -> None:
    result = subprocess.run(
        [sys.executable, str(GRAFANA / "generate_dashboard.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


def test_the_generator_refuses_a_metric_the_table_lacks(monkeypatch) -> None:
    spec = importlib.util.spec_from_file_location("generate_dashboard",
                                                  GRAFANA / "generate_dashboard.py")
    assert spec is not None and spec.loader is not None
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    assert generator.render() == DASHBOARD.read_text()
    real = generator.dashboard

    def with_a_typo() -> dict:
        board = real()
        board["panels"][1]["targets"][0]["expr"] = "torch_cuda_allocator_reserverd_bytes"
        return board

    monkeypatch.setattr(generator, "dashboard", with_a_typo)
    with pytest.raises(SystemExit, match="torch_cuda_allocator_reserverd_bytes"):
        generator.render()


def test_current_json_model() -> None:
    assert BOARD["schemaVersion"] >= 39
    assert {p["type"] for p in PANELS} <= {"timeseries", "table"}  # no legacy "graph" panels
    assert BOARD["uid"] and BOARD["title"]
    ids = [p["id"] for p in BOARD["panels"]]
    assert len(ids) == len(set(ids))


def test_panels_do_not_overlap() -> None:
    cells = set()
    for panel in BOARD["panels"]:
        g = panel["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & mine, panel["title"]
        cells |= mine


def test_template_variables() -> None:
    assert {"datasource", "namespace", "pod", "rank", "device"} <= set(VARIABLES)
    assert (
        VARIABLES["datasource"]["type"] == "datasource"
        and VARIABLES["datasource"]["query"] == "prometheus"
    )
    for name in ("namespace", "pod", "rank", "device"):
        variable = VARIABLES[name]
        assert variable["multi"] and variable["includeAll"] and variable["allValue"] == ".*"
        assert variable["datasource"]["uid"] == "${datasource}"
    assert VARIABLES["device"]["query"]["query"].endswith(", cuda_device)")
    for panel in PANELS:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]


UNITS = {"bytes", "percentunit", "ops", "short", "s", "Bps"}


@pytest.mark.parametrize(
    "panel", [p for p in PANELS if p["type"] == "timeseries"], ids=lambda p: p["title"]
)
def test_every_timeseries_has_a_unit_and_legends_by_rank_and_device(panel: dict) -> None:
    assert panel["fieldConfig"]["defaults"]["unit"] in UNITS
    for target in panel["targets"]:
        legend = target["legendFormat"]
        assert legend and legend != "__auto", target["expr"]
        per_rank = any(n.startswith("torch_cuda_allocator_") for n in metric_names(target["expr"]))
        aggregated = target["expr"].lstrip().startswith(("sum(", "sum by (pod"))
        if per_rank and not aggregated:
            assert "{{rank}}" in legend and "{{cuda_device}}" in legend, (panel["title"], legend)


def test_units_match_what_the_panels_show() -> None:
    units = {
        p["title"]: p["fieldConfig"]["defaults"]["unit"]
        for p in PANELS
        if p["type"] == "timeseries"
    }
    assert units["Allocated vs reserved vs device used"] == "bytes"
    assert units["Peak fragmentation"] == "percentunit"
    assert units["Unused share of the cache"] == "percentunit"
    assert units["Allocation retries and out-of-memory errors"] == "ops"
    assert units["Pending free bytes"] == "bytes"
    assert units["Pending events"] == "short"


def test_the_issue_panels_are_there() -> None:
    used = set().union(*(metric_names(t["expr"]) for _, t in TARGETS))
    for metric in [
        "torch_cuda_allocator_allocated_bytes",
        "torch_cuda_allocator_reserved_bytes",
        "allocwatch_gpu_memory_used_bytes",
        "torch_cuda_allocator_fragmentation_ratio",
        "torch_cuda_allocator_peak_fragmentation_ratio",
        "torch_cuda_allocator_largest_free_block_bytes",
        "torch_cuda_allocator_pool_reserved_bytes",
        "allocwatch_agent_series_collisions_total",
        "torch_cuda_allocator_alloc_retries_total",
        "torch_cuda_allocator_ooms_total",
        "torch_cuda_allocator_pending_events",
        "torch_cuda_allocator_pending_free_bytes",
        "torch_cuda_allocator_gc_reclaims_total",
        "torch_cuda_allocator_host_waits_total",
        "torch_cuda_allocator_stream_waits_total",
        "allocwatch_policy_actions_total",
        "allocwatch_agents_connected",
        "up",
        "DCGM_FI_DEV_FB_USED",
    ]:
        assert metric in used, metric
    dcgm = [t["expr"] for _, t in TARGETS if "DCGM_FI_DEV_FB_USED" in t["expr"]]
    assert dcgm and all(
        'label_replace(DCGM_FI_DEV_FB_USED, "gpu_uuid", "$1", "UUID", "(.*)")' in e for e in dcgm
    )


def test_the_fragmentation_threshold_is_drawn_on_the_peak_figure() -> None:
    panels = {p["title"]: p for p in PANELS}
    peak = panels["Peak fragmentation"]
    assert peak["fieldConfig"]["defaults"]["thresholds"]["steps"][-1]["value"] == 0.25
    assert all("peak_fragmentation_ratio" in t["expr"] for t in peak["targets"])
    assert "thresholds" not in panels["Unused share of the cache"]["fieldConfig"]["defaults"]


def test_no_query_selects_a_pool_label_on_the_totals() -> None:
    """Totals and the pool breakdown have names of their own: no {pool=""} needed, and the
    breakdown is read only from its own names."""
    for title, t in TARGETS:
        assert 'pool=""' not in t["expr"], title
        if "pool" in t["legendFormat"]:
            assert "_pool_" in t["expr"], title


def test_every_expression_parses(tmp_path) -> None:
    exprs = {name: substitute_grafana_variables(e) for name, e in dashboard_expressions().items()}
    assert len(exprs) >= 30
    for expr in exprs.values():
        assert "$" not in expr.replace('"$1"', ""), expr  # no Grafana variable left behind
    result = run_promtool_check(exprs, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_check_rejects_a_broken_expression(tmp_path) -> None:
    result = run_promtool_check(
        {"broken": 'rate(torch_cuda_allocator_ooms_total{pod=~".*"}[1m]'}, tmp_path
    )
    assert result.returncode != 0


@pytest.mark.parametrize("name", sorted(dashboard_expressions()))
def test_every_expression_selects_only_known_metrics(name: str) -> None:
    names = metric_names(dashboard_expressions()[name])
    assert names, name
    assert names <= SIDECAR_METRICS | FOREIGN_METRICS, names - SIDECAR_METRICS


def test_metric_name_reader_on_known_expressions() -> None:
    assert metric_names(
        'sum by (pod, rule) (rate(allocwatch_policy_actions_total{pod=~"x"}[5m]))'
    ) == {"allocwatch_policy_actions_total"}
    dcgm_join = (
        'max by (gpu_uuid) (label_replace(DCGM_FI_DEV_FB_USED, "gpu_uuid", "$1", "UUID", "(.*)"))'
    )
    assert metric_names(dcgm_join + " * 1048576") == {"DCGM_FI_DEV_FB_USED"}
    assert metric_names("time() - allocwatch_agent_last_report_timestamp_seconds > 60") == {
        "allocwatch_agent_last_report_timestamp_seconds"
    }
    assert metric_names(
        "a_bytes / on (namespace, pod) group_left () max by (pod) (b_total) > 1/60"
    ) == {"a_bytes", "b_total"}
