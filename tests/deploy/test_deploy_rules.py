"""deploy/rules/: promtool accepts the rule files and their unit tests pass, every alert is
tested firing and not firing, has a runbook, and reads only metrics the sidecar exposes."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml
from support.deploy import (
    FOREIGN_METRICS,
    REPO,
    RULES,
    SIDECAR_METRICS,
    metric_names,
    require_binary,
)

RULE_FILES = [RULES / "recording.yaml", RULES / "alerts.yaml"]
TEST_FILES = sorted((RULES / "tests").glob("*.yaml"))
RUNBOOKS = REPO / "docs" / "runbooks.md"
# Where the rules say the docs are until a deployment sets it (deploy/components/runbook-url).
DOCS_PLACEHOLDER = "https://allocwatch.invalid/docs"


def rules_of(path: Path) -> list[dict]:
    return [rule for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"]]


ALERTS = rules_of(RULES / "alerts.yaml")
RECORDS = rules_of(RULES / "recording.yaml")


def test_promtool_check_rules() -> None:
    promtool = require_binary("promtool")
    result = subprocess.run(
        [promtool, "check", "rules", *map(str, RULE_FILES)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in result.stdout


@pytest.mark.parametrize("test_file", TEST_FILES, ids=lambda p: p.name)
def test_promtool_test_rules(test_file: Path) -> None:
    promtool = require_binary("promtool")
    result = subprocess.run(
        [promtool, "test", "rules", str(test_file)],
        capture_output=True,
        text=True,
        cwd=test_file.parent,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_test_rules_can_fail() -> None:
    """A unit test file whose expectation is wrong must fail: the suite above has teeth."""
    promtool = require_binary("promtool")
    tests = yaml.safe_load((RULES / "tests/alerts_test.yaml").read_text())
    tests["rule_files"] = [str(RULES / "alerts.yaml")]
    first = tests["tests"][0]["alert_rule_test"]
    firing = next(case for case in first if case["exp_alerts"])
    firing["exp_alerts"] = []
    broken = RULES / "tests" / ".broken_test.tmp.yaml"
    try:
        broken.write_text(yaml.safe_dump(tests))
        result = subprocess.run(
            [promtool, "test", "rules", str(broken)], capture_output=True, text=True
        )
    finally:
        broken.unlink(missing_ok=True)
    assert result.returncode != 0


def unit_test_cases() -> list[dict]:
    cases = []
    for path in TEST_FILES:
        for test in yaml.safe_load(path.read_text())["tests"]:
            cases += test.get("alert_rule_test", [])
    return cases


@pytest.mark.parametrize("alert", [a["alert"] for a in ALERTS])
def test_every_alert_is_tested_firing_and_not_firing(alert: str) -> None:
    cases = [c for c in unit_test_cases() if c["alertname"] == alert]
    assert any(c["exp_alerts"] for c in cases), f"{alert}: no case where it fires"
    assert any(not c["exp_alerts"] for c in cases), f"{alert}: no case where it stays silent"


def test_the_alerts_the_issue_asks_for_exist() -> None:
    expressions = " ".join(a["expr"] for a in ALERTS)
    for needle in [
        "min_over_time(torch_cuda_allocator_peak_fragmentation_ratio[",
        "predict_linear(min_over_time(torch_cuda_allocator_allocated_bytes[",
        "torch_cuda_allocator_alloc_retries_total",
        "torch_cuda_allocator_ooms_total",
        "allocwatch_gpu_memory_total_bytes",
        "torch_cuda_allocator_empty_cache_calls_total",
        "torch_cuda_allocator_sync_all_streams_total",
        "allocwatch_agent_last_report_timestamp_seconds",
        "allocwatch_agents_connected",
        "allocwatch_agent_wait_seconds",
        "up{",
    ]:
        assert needle in expressions, needle
    records = {r["record"] for r in RECORDS}
    assert any("peak_fragmentation" in r for r in records) and any(
        "unused_reserved_bytes" in r for r in records
    )


def test_no_alert_fires_on_the_caches_idle_share() -> None:
    """fragmentation_ratio is high between steps for any healthy cache: alerts read the peak
    figure."""
    for alert in ALERTS:
        assert "torch_cuda_allocator_fragmentation_ratio" not in alert["expr"], alert["alert"]


@pytest.mark.parametrize("alert", ALERTS, ids=lambda a: a["alert"])
def test_every_alert_has_severity_summary_and_a_runbook_entry(alert: dict) -> None:
    assert alert["labels"]["severity"] in ("info", "warning", "critical")
    assert alert["annotations"]["summary"] and alert["annotations"]["description"]
    url = alert["annotations"]["runbook_url"]
    assert url == f"{DOCS_PLACEHOLDER}/runbooks.md#{alert['alert'].lower()}"
    headings = re.findall(r"^## (\S+)\s*$", RUNBOOKS.read_text(), flags=re.M)
    assert alert["alert"] in headings, f"docs/runbooks.md has no section '## {alert['alert']}'"
    section = RUNBOOKS.read_text().split(f"## {alert['alert']}\n", 1)[1].split("\n## ", 1)[0]
    assert "**Check:**" in section and ("**Try" in section or "setting" in section), alert["alert"]


def test_the_runbook_placeholder_can_never_lead_anywhere_and_its_docs_say_so() -> None:
    """A default that names a real-looking host (an unregistered GitHub organisation) could be
    claimed by anyone, who would then write what on-call engineers run: the placeholder lives
    under .invalid (RFC 2606: never resolves, never delegated), and the component and the
    deploy docs name it, so that a user knows what to replace."""
    host = re.match(r"https://([^/]+)/", DOCS_PLACEHOLDER)
    assert host and host.group(1).endswith(".invalid")
    for says in ("deploy/components/runbook-url/kustomization.yaml", "docs/deploy.md"):
        assert DOCS_PLACEHOLDER in (REPO / says).read_text(), says
    shipped = [RULES / "alerts.yaml", RULES / "tests/alerts_test.yaml",
               REPO / "deploy/monitoring/prometheusrule.yaml",
               REPO / "grafana/dashboards/allocwatch.json"]
    for path in shipped:
        for url in re.findall(r"runbook_url: (\S+)", path.read_text()):
            assert url.startswith(DOCS_PLACEHOLDER + "/runbooks.md#"), (path, url)
        assert "github.com/allocwatch" not in path.read_text(), path


@pytest.mark.parametrize("rule", ALERTS + RECORDS, ids=lambda r: r.get("alert") or r["record"])
def test_rules_read_only_metrics_the_sidecar_exposes(rule: dict) -> None:
    names = metric_names(rule["expr"])
    assert names, rule["expr"]
    assert names <= SIDECAR_METRICS | FOREIGN_METRICS, names - SIDECAR_METRICS
