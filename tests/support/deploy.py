"""What the deploy checks (tests/deploy/) share: repository paths, tool lookup, manifest walking,
and a small PromQL reader that lists the metric names an expression selects."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from allocator_ext.protocol.metrics import METRICS
from support.paths import REPO

DEPLOY = REPO / "deploy"
GRAFANA = REPO / "grafana"
RULES = DEPLOY / "rules"
DASHBOARD = GRAFANA / "dashboards" / "allocwatch.json"

SIDECAR = "allocwatch-sidecar"
COMPONENT = DEPLOY / "components" / "allocwatch"
# The one place the sidecar image's name and tag are set, which every other copy takes.
SIDECAR_IMAGE_COMPONENT = DEPLOY / "components" / "sidecar-image"
METRICS_PORT = 9471
SOCKET_DIR = "/run/allocwatch"  # the shared emptyDir's mount
SIDECAR_DIR = "/run/allocwatch/sidecar"  # the sidecar's own directory in it: its sockets
SIDECAR_UID = 65532

# Every name the sidecar exposes, from the metric table (allocator_ext/protocol/metrics.py).
SIDECAR_METRICS = frozenset(metric.name for metric in METRICS)
# Series that come from elsewhere: Prometheus' own per-target `up`, dcgm-exporter.
FOREIGN_METRICS = frozenset(["up", "DCGM_FI_DEV_FB_USED"])


ESSENTIAL_FIELDS = (
    "image",
    "ports",
    "env",
    "startupProbe",
    "readinessProbe",
    "livenessProbe",
    "resources",
    "securityContext",
    "volumeMounts",
)


def _kubernetes_validate() -> Any:
    return pytest.importorskip(
        "kubernetes_validate",
        reason="kubernetes-validate is not installed (pip install kubernetes-validate)",
    )


def newest_known_version() -> str:
    schemas = Path(_kubernetes_validate().__file__).parent / "kubernetes-json-schema"
    versions = [
        tuple(int(x) for x in m.group(1).split("."))
        for p in schemas.iterdir()
        if (m := re.fullmatch(r"v(\d+\.\d+\.\d+)-local-strict", p.name))
    ]
    return ".".join(map(str, max(versions)))


def validate_strict(resource: dict, version: str) -> None:
    _kubernetes_validate().validate(resource, version, True)


def require_binary(name: str) -> str:
    """The binary's path; skips the test, saying why, where it is not installed."""
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"`{name}` is not installed (CI installs it; see docs/deploy.md)")
    return path


def kustomize_build(directory: Path) -> list[dict]:
    kubectl = require_binary("kubectl")
    result = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"kubectl kustomize {directory} failed:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def _is_component(kustomization: Path) -> bool:
    return yaml.safe_load(kustomization.read_text()).get("kind") == "Component"


def kustomization_dirs() -> list[Path]:
    """Every kustomization that builds on its own (Components are applied by others)."""
    return sorted(p.parent for root in (DEPLOY, GRAFANA) for p in root.rglob("kustomization.yaml")
                  if not _is_component(p))


def component_dirs() -> list[Path]:
    return sorted(p.parent for p in DEPLOY.rglob("kustomization.yaml") if _is_component(p))


def load_yaml_documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def pod_templates(resource: dict) -> Iterator[tuple[str, dict]]:
    """(where, pod template) for every pod template in a workload resource."""
    kind = resource.get("kind")
    spec = resource.get("spec", {})
    if kind == "Pod":
        yield "pod", {"metadata": resource.get("metadata", {}), "spec": spec}
    elif kind in ("Job", "Deployment", "StatefulSet", "DaemonSet"):
        yield "template", spec["template"]
    elif kind == "PyTorchJob":
        for replica, replica_spec in spec["pytorchReplicaSpecs"].items():
            yield f"pytorchReplicaSpecs.{replica}", replica_spec["template"]
    elif kind == "JobSet":
        for job in spec["replicatedJobs"]:
            yield f"replicatedJobs.{job['name']}", job["template"]["spec"]["template"]


def all_containers(pod_spec: dict) -> list[dict]:
    return list(pod_spec.get("initContainers", [])) + list(pod_spec.get("containers", []))


def find_sidecar(pod_spec: dict) -> dict | None:
    for container in all_containers(pod_spec):
        if container["name"] == SIDECAR:
            return container
    return None


def component_additions() -> dict:
    """The Pod (local-config, never applied) whose parts the Component copies into workloads."""
    pods = [d for d in load_yaml_documents(COMPONENT / "additions.yaml") if d["kind"] == "Pod"]
    assert len(pods) == 1
    return pods[0]


def sidecar_image_entry() -> dict:
    """The `images:` entry of deploy/components/sidecar-image: the image's name, its tag."""
    kustomization = yaml.safe_load((SIDECAR_IMAGE_COMPONENT / "kustomization.yaml").read_text())
    [entry] = kustomization["images"]
    return entry


def sidecar_image() -> str:
    """The sidecar image as every kustomization renders it unless a user sets theirs."""
    entry = sidecar_image_entry()
    return f"{entry['name']}:{entry['newTag']}"


def canonical_sidecar() -> dict:
    """The Component's sidecar as it renders: the manifest names the image without its tag,
    which deploy/components/sidecar-image adds."""
    sidecar = find_sidecar(component_additions()["spec"])
    assert sidecar is not None
    assert sidecar["image"] == sidecar_image_entry()["name"], sidecar["image"]
    return {**sidecar, "image": sidecar_image()}


def trainer_additions() -> dict:
    """What the Component adds to every container, whatever the workload's kind."""
    return {c["name"]: c for c in component_additions()["spec"]["containers"]}["trainer"]


def starts_the_agent(container: dict) -> bool:
    """`allocwatch run --` in the command (or the shell script it runs), or the same start-up
    hook enabled through the environment (ALLOCWATCH_RUN=1, the .pth file)."""
    words = " ".join(container.get("command", []) + container.get("args", []))
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    return bool(re.search(r"(^|\s)allocwatch run --(\s|$)", words)) or env.get(
        "ALLOCWATCH_RUN") == "1"


def selector_matches(selector: dict, labels: dict) -> bool:
    """A Kubernetes LabelSelector (matchLabels and matchExpressions) against a label set."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


# --- PromQL ----------------------------------------------------------------------------------

# Grafana's variables, replaced by values that keep an expression valid PromQL.
GRAFANA_SUBSTITUTIONS = {
    "$__rate_interval": "1m",
    "$__interval": "1m",
    "$__range": "1h",
    "${__range}": "1h",
    "$__range_s": "3600",
}

PROMQL_FUNCTIONS = frozenset(
    """abs absent absent_over_time avg_over_time ceil changes clamp clamp_max clamp_min
    count_over_time day_of_month day_of_week day_of_year days_in_month delta deriv exp floor
    histogram_quantile holt_winters hour idelta increase irate label_join label_replace ln log10
    log2 last_over_time max_over_time min_over_time minute month predict_linear present_over_time
    quantile_over_time rate resets round scalar sgn sort sort_desc sqrt stddev_over_time
    stdvar_over_time sum_over_time time timestamp vector year
    sum min max avg group stddev stdvar count count_values bottomk topk quantile
    by without on ignoring group_left group_right bool and or unless offset""".split()
)


def substitute_grafana_variables(expr: str) -> str:
    for variable, value in GRAFANA_SUBSTITUTIONS.items():
        expr = expr.replace(variable, value)
    # Multi-value template variables sit inside regex matchers (=~"$pod"): any value matches.
    return re.sub(r"\$\{?(namespace|pod|rank|device|datasource)\}?", ".*", expr)


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects.

    Strips what cannot be a metric name (string literals, label matchers, grouping label lists,
    range and subquery brackets, numbers), then keeps the identifiers that are not functions,
    aggregations or keywords. Good enough for the expressions this repository writes, and
    checked against known cases in test_deploy_dashboard.py.
    """
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r" \1 ", text)
    text = re.sub(r"\b\d+(\.\d+)?(e[+-]?\d+)?\b", " ", text)
    names = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", text))
    return {name for name in names if name not in PROMQL_FUNCTIONS and name not in ("inf", "nan")}


def run_promtool_check(exprs: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess:
    """`promtool check rules` on the expressions as recording rules: it parses every one."""
    promtool = require_binary("promtool")
    rules = [{"record": f"check:{name}", "expr": expr} for name, expr in exprs.items()]
    path = tmp_path / "expressions.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "check", "rules": rules}]}))
    return subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
