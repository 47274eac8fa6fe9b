"""What a kustomize user chooses without forking deploy/: the monitor that scrapes the sidecars
(deploy/base's PodMonitor, or the ServiceMonitor of deploy/components/servicemonitor instead of
it, never both), and where the alerts' runbook links point (deploy/components/runbook-url).

Each choice is built as a user's own kustomization would be: a folder of its own that lists
deploy/ by relative path."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml
from support.deploy import (
    DEPLOY,
    METRICS_PORT,
    kustomize_build,
    pod_templates,
    require_binary,
    selector_matches,
)

EXAMPLES = sorted(p.parent.name for p in (DEPLOY / "examples").glob("*/kustomization.yaml"))
MONITORS = {"PodMonitor", "ServiceMonitor"}
DOCS = "https://git.example.com/ml/allocwatch/-/blob/v0.1.0/docs"


def user_kustomization(where: Path, text: str, **paths: Path) -> Path:
    """A kustomization at `where` whose text names deploy/'s folders as {name}, each by its
    path relative to `where` (kustomize refuses absolute ones)."""
    where.mkdir(parents=True, exist_ok=True)
    (where / "kustomization.yaml").write_text(
        text.format(**{name: os.path.relpath(path, where) for name, path in paths.items()}))
    return where


def one(resources: list[dict], kind: str) -> dict:
    matches = [r for r in resources if r["kind"] == kind]
    assert len(matches) == 1, f"expected one {kind}, found {len(matches)}"
    return matches[0]


@pytest.mark.parametrize("example", EXAMPLES)
def test_every_example_is_scraped_by_one_monitor(example: str) -> None:
    kinds = [r["kind"] for r in kustomize_build(DEPLOY / "examples" / example)]
    assert [k for k in kinds if k in MONITORS] == ["PodMonitor"], kinds


def test_the_servicemonitor_component_replaces_the_podmonitor(tmp_path: Path) -> None:
    (tmp_path / "job.yaml").write_text((DEPLOY / "examples/job/job.yaml").read_text())
    built = kustomize_build(user_kustomization(tmp_path, """\
namespace: training
resources: [{base}, job.yaml]
components: [{allocwatch}, {servicemonitor}]
""", base=DEPLOY / "base", allocwatch=DEPLOY / "components/allocwatch",
        servicemonitor=DEPLOY / "components/servicemonitor"))
    assert sorted(r["kind"] for r in built if r["kind"] in MONITORS) == ["ServiceMonitor"]
    service, monitor = one(built, "Service"), one(built, "ServiceMonitor")
    assert "release" in monitor["metadata"]["labels"]
    assert selector_matches(monitor["spec"]["selector"], service["metadata"]["labels"])
    service_ports = {p["name"]: p for p in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in service_ports
        # a number: named ports of native sidecars resolve only from Kubernetes 1.32
        assert service_ports[endpoint["port"]]["targetPort"] == METRICS_PORT
    assert service["spec"]["clusterIP"] == "None"
    pods = [t for r in built for _, t in pod_templates(r)]
    assert pods and all(selector_matches({"matchLabels": service["spec"]["selector"]},
                                         t["metadata"]["labels"]) for t in pods)


def alerts(resources: list[dict]) -> list[dict]:
    rule = one(resources, "PrometheusRule")
    return [r for group in rule["spec"]["groups"] for r in group["rules"] if "alert" in r]


def test_runbook_links_are_set_once_for_every_alert(tmp_path: Path) -> None:
    built = kustomize_build(user_kustomization(tmp_path, f"""\
resources: [{{monitoring}}]
components: [{{runbook_url}}]
configMapGenerator:
  - name: allocwatch-docs
    literals: [url={DOCS}]
    options:
      disableNameSuffixHash: true
      annotations: {{{{config.kubernetes.io/local-config: "true"}}}}
""", monitoring=DEPLOY / "monitoring", runbook_url=DEPLOY / "components/runbook-url"))
    found = alerts(built)
    assert len(found) >= 10
    for alert in found:
        assert alert["annotations"]["runbook_url"] == \
            f"{DOCS}/runbooks.md#{alert['alert'].lower()}"
    # Read by the component, never applied: only the dashboard's ConfigMap is left.
    assert [r["metadata"]["name"] for r in built if r["kind"] == "ConfigMap"] == \
        [r["metadata"]["name"] for r in kustomize_build(DEPLOY / "monitoring")
         if r["kind"] == "ConfigMap"]


def test_the_runbook_component_without_its_url_fails_naming_it(tmp_path: Path) -> None:
    where = user_kustomization(tmp_path, "resources: [{monitoring}]\ncomponents: [{runbook_url}]\n",
                               monitoring=DEPLOY / "monitoring",
                               runbook_url=DEPLOY / "components/runbook-url")
    result = subprocess.run([require_binary("kubectl"), "kustomize", str(where)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "allocwatch-docs" in result.stderr


def test_the_component_documents_what_the_test_builds() -> None:
    """The component's own header is what a user copies: it sets the same ConfigMap."""
    header = (DEPLOY / "components/runbook-url/kustomization.yaml").read_text()
    copied = "\n".join(line.removeprefix("#   ") for line in header.splitlines()
                       if line.startswith("#   "))
    assert yaml.safe_load(copied)["configMapGenerator"][0]["name"] == "allocwatch-docs"
