"""deploy/: every kustomization builds, core manifests validate strictly against current
Kubernetes schemas, custom resources hold together (selectors, ports, names), the sidecar is
the same everywhere, and yamllint is clean."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.deploy import (
    DEPLOY,
    ESSENTIAL_FIELDS,
    GRAFANA,
    METRICS_PORT,
    REPO,
    SIDECAR,
    SIDECAR_DIR,
    SIDECAR_UID,
    SOCKET_DIR,
    all_containers,
    canonical_sidecar,
    component_dirs,
    find_sidecar,
    kustomization_dirs,
    kustomize_build,
    newest_known_version,
    pod_templates,
    selector_matches,
    starts_the_agent,
    trainer_additions,
    validate_strict,
)

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate",
    reason="kubernetes-validate is not installed (pip install kubernetes-validate)",
)

# The oldest Kubernetes the native-sidecar manifests target, and the newest the installed
# kubernetes-validate knows ("a current version").
OLDEST_NATIVE = "1.31.0"
LEGACY_TARGET = "1.28.0"

CUSTOM_KINDS = {
    "PodMonitor",
    "ServiceMonitor",
    "PrometheusRule",
    "PyTorchJob",
    "JobSet",
    "ClusterPolicy",
}
NATIVE_EXAMPLES = ["job", "pytorchjob", "jobset"]
EXAMPLES = NATIVE_EXAMPLES + ["job-legacy-sidecar"]


def build(relative: str) -> list[dict]:
    return kustomize_build(REPO / relative)


def one(resources: list[dict], kind: str) -> dict:
    matches = [r for r in resources if r["kind"] == kind]
    assert len(matches) == 1, f"expected one {kind}, found {len(matches)}"
    return matches[0]


# --- builds and schemas --------------------------------------------------------------------


@pytest.mark.parametrize("directory", kustomization_dirs(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_kustomization_builds(directory: Path) -> None:
    resources = kustomize_build(directory)
    assert resources, f"{directory} builds to nothing"
    for resource in resources:
        assert (
            resource.get("apiVersion") and resource.get("kind") and resource["metadata"].get("name")
        )


def test_all_kustomizations_are_found() -> None:
    assert [str(p.relative_to(REPO)) for p in component_dirs()] == [
        "deploy/components/allocwatch", "deploy/components/runbook-url",
        "deploy/components/servicemonitor", "deploy/components/sidecar-image"]
    found = {str(p.relative_to(REPO)) for p in kustomization_dirs()}
    assert {
        "deploy/base",
        "deploy/monitoring",
        "deploy/admission/kyverno",
        "deploy/admission/mutating-admission-policy",
        "grafana",
    } | {f"deploy/examples/{e}" for e in EXAMPLES} <= found


def core_resources() -> list[tuple[str, dict]]:
    out = []
    for directory in kustomization_dirs():
        for resource in kustomize_build(directory):
            if resource["kind"] not in CUSTOM_KINDS and not resource["kind"].startswith(
                "MutatingAdmissionPolicy"
            ):
                out.append((str(directory.relative_to(REPO)), resource))
    return out


@pytest.mark.parametrize("version", [OLDEST_NATIVE, "newest"])
def test_core_manifests_are_valid_under_strict_schemas(version: str) -> None:
    version = newest_known_version() if version == "newest" else version
    resources = core_resources()
    kinds = {r["kind"] for _, r in resources}
    # The Service comes with the servicemonitor component, applied over a user's own job.
    assert {"Job", "ConfigMap", "NetworkPolicy"} <= kinds
    for where, resource in resources:
        try:
            validate_strict(resource, version)
        except Exception as error:  # the library raises several types; report which resource
            name = f"{resource['kind']}/{resource['metadata']['name']}"
            pytest.fail(f"{where}: {name} invalid on {version}: {error}")


def test_legacy_example_is_valid_where_it_is_meant_to_run() -> None:
    for resource in build("deploy/examples/job-legacy-sidecar"):
        if resource["kind"] not in CUSTOM_KINDS:
            validate_strict(resource, LEGACY_TARGET)


@pytest.mark.parametrize("version", ["1.34.0", "newest"])
def test_mutating_admission_policy_is_valid_where_v1beta1_is_served(version: str) -> None:
    version = newest_known_version() if version == "newest" else version
    resources = build("deploy/admission/mutating-admission-policy")
    assert {r["kind"] for r in resources} == {
        "MutatingAdmissionPolicy",
        "MutatingAdmissionPolicyBinding",
    }
    for resource in resources:
        validate_strict(resource, version)


def test_strict_validation_rejects_a_misspelt_field() -> None:
    """The validator is the test's teeth: a typo in the sidecar must fail it."""
    job = one(build("deploy/examples/job"), "Job")
    broken = copy.deepcopy(job)
    find_sidecar(broken["spec"]["template"]["spec"])["readinesProbe"] = {
        "httpGet": {"path": "/readyz", "port": 9471}
    }
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        validate_strict(broken, newest_known_version())


@pytest.mark.parametrize("example", ["pytorchjob", "jobset"])
def test_pod_templates_inside_custom_resources_are_valid_pods(example: str) -> None:
    """The operators copy these templates into Pods, so they get the Pod schema's strictness."""
    workload = next(
        r for r in build(f"deploy/examples/{example}") if r["kind"] in ("PyTorchJob", "JobSet")
    )
    templates = list(pod_templates(workload))
    assert templates
    for where, template in templates:
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "x", **template["metadata"]},
            "spec": template["spec"],
        }
        try:
            validate_strict(pod, newest_known_version())
        except Exception as error:
            pytest.fail(f"{example} {where}: {error}")


# --- the sidecar, everywhere it appears ----------------------------------------------------



def example_pods(example: str) -> list[tuple[str, dict]]:
    resources = build(f"deploy/examples/{example}")
    return [(f"{example} {where}", t) for r in resources for where, t in pod_templates(r)]


def kyverno_pod_patch() -> dict:
    policy = one(build("deploy/admission/kyverno"), "ClusterPolicy")
    return policy["spec"]["rules"][0]["mutate"]["patchStrategicMerge"]


@pytest.mark.parametrize("example", EXAMPLES)
def test_sidecar_is_the_same_in_every_example(example: str) -> None:
    reference = canonical_sidecar()
    for where, template in example_pods(example):
        sidecar = find_sidecar(template["spec"])
        assert sidecar is not None, f"{where}: no {SIDECAR}"
        for field in ESSENTIAL_FIELDS:
            assert sidecar.get(field) == reference.get(field), (
                f"{where}: {field} differs from examples/job"
            )


def test_kyverno_policy_injects_the_same_sidecar() -> None:
    patch = kyverno_pod_patch()
    sidecar = find_sidecar(patch["spec"])
    reference = canonical_sidecar()
    assert sidecar is not None
    for field in ESSENTIAL_FIELDS + ("restartPolicy", "args"):
        assert sidecar.get(field) == reference.get(field), field
    assert patch["metadata"]["labels"]["allocwatch.io/sidecar"] == "true"
    assert {v["name"] for v in patch["spec"]["volumes"]} >= {
        "allocwatch-socket",
        "allocwatch-config",
    }
    # the anchor that adds the socket mount and address to every container of the pod
    containers = patch["spec"]["containers"]
    assert containers[0]["(name)"] == "*"
    assert {"name": "allocwatch-socket", "mountPath": SOCKET_DIR} in containers[0]["volumeMounts"]


def test_kyverno_policy_matches_opted_in_pods_only_and_never_blocks_them() -> None:
    policy = one(build("deploy/admission/kyverno"), "ClusterPolicy")
    assert policy["apiVersion"] == "kyverno.io/v1"
    assert policy["spec"]["failurePolicy"] == "Ignore"
    assert (
        policy["metadata"]["annotations"]["pod-policies.kyverno.io/autogen-controllers"] == "none"
    )
    rule = policy["spec"]["rules"][0]
    resources = rule["match"]["any"][0]["resources"]
    assert resources["kinds"] == ["Pod"] and resources["operations"] == ["CREATE"]
    assert resources["selector"]["matchLabels"] == {"allocwatch.io/inject": "true"}
    assert "allocwatch-sidecar" in rule["preconditions"]["all"][0]["key"]


def test_mutating_admission_policy_injects_the_same_sidecar() -> None:
    resources = build("deploy/admission/mutating-admission-policy")
    policy = one(resources, "MutatingAdmissionPolicy")
    binding = one(resources, "MutatingAdmissionPolicyBinding")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["matchResources"]["objectSelector"]["matchLabels"] == {
        "allocwatch.io/inject": "true"
    }
    assert policy["spec"]["failurePolicy"] == "Ignore"
    cel = policy["spec"]["mutations"][0]["applyConfiguration"]["expression"]
    for needle in [
        # the image, from the PodTemplate of deploy/base (tests/deploy/test_deploy_sidecar_image.py)
        "image: params.template.spec.containers[0].image,",
        'restartPolicy: "Always"',
        f"containerPort: {METRICS_PORT},",
        '"/healthz"',
        '"/readyz"',
        "runAsNonRoot: true",
        "readOnlyRootFilesystem: true",
        "allowPrivilegeEscalation: false",
        'drop: ["ALL"]',
        'type: "RuntimeDefault"',
        '"allocwatch-sidecar-config"',
        '"allocwatch.io/sidecar": "true"',
        f'mountPath: "{SOCKET_DIR}"',
    ] + [f'"{e["name"]}"' for e in trainer_additions()["env"]]:
        assert needle in cel, needle
    assert (
        cel.count("{") == cel.count("}")
        and cel.count("[") == cel.count("]")
        and cel.count("(") == cel.count(")")
    )
    assert "sidecar-not-present" in {c["name"] for c in policy["spec"]["matchConditions"]}


@pytest.mark.parametrize("example", NATIVE_EXAMPLES)
def test_native_sidecar_is_a_restartable_init_container(example: str) -> None:
    for where, template in example_pods(example):
        init = {c["name"]: c for c in template["spec"].get("initContainers", [])}
        assert init.get(SIDECAR, {}).get("restartPolicy") == "Always", where
        assert SIDECAR not in {c["name"] for c in template["spec"]["containers"]}, where


def test_legacy_sidecar_exits_after_training() -> None:
    [(where, template)] = example_pods("job-legacy-sidecar")
    spec = template["spec"]
    sidecar = {c["name"]: c for c in spec["containers"]}[SIDECAR]
    assert "restartPolicy" not in sidecar
    assert "--exit-after-training" in sidecar["args"]
    assert not spec.get("initContainers")
    # OnFailure would restart a failed trainer without its (exited) sidecar
    assert spec["restartPolicy"] == "Never"
    trainer = next(c for c in spec["containers"] if c["name"] != SIDECAR)
    script = " ".join(trainer.get("command", []) + trainer.get("args", []))
    assert f"trap 'touch {SOCKET_DIR}/training-done' EXIT" in script


JOB_NAME_LABELS = {
    "job": "batch.kubernetes.io/job-name",
    "job-legacy-sidecar": "batch.kubernetes.io/job-name",
    "pytorchjob": "training.kubeflow.org/job-name",
    "jobset": "jobset.sigs.k8s.io/jobset-name",
}
IDENTITY = {
    "ALLOCWATCH_POD_NAME": "metadata.name",
    "ALLOCWATCH_POD_NAMESPACE": "metadata.namespace",
    "ALLOCWATCH_NODE_NAME": "spec.nodeName",
}


@pytest.mark.parametrize("example", EXAMPLES)
def test_every_example_starts_the_agent_as_copied(example: str) -> None:
    """Copied verbatim, every example starts the agent: without it the sidecar would wait for
    an agent that never comes (AllocwatchNoAgentConnected)."""
    for where, template in example_pods(example):
        trainers = [c for c in template["spec"]["containers"] if c["name"] != SIDECAR]
        assert trainers, where
        for container in trainers:
            assert starts_the_agent(container), f"{where} {container['name']}"
            words = " ".join(container.get("command", []) + container.get("args", []))
            assert "allocwatch run -- torchrun" in words, f"{where}: the command says so, too"


WORKLOAD_KINDS = ("Job", "PyTorchJob", "JobSet")


@pytest.mark.parametrize("example", EXAMPLES)
def test_each_examples_opening_comment_names_its_own_kind(example: str) -> None:
    """What a user reads first describes the workload below it, not another example's."""
    [manifest] = [p for p in (DEPLOY / "examples" / example).glob("*.yaml")
                  if p.name != "kustomization.yaml"]
    text = manifest.read_text()
    [kind] = {r["kind"] for r in yaml.safe_load_all(text) if r and r["kind"] in WORKLOAD_KINDS}
    opening = " ".join(line for line in text.split("\napiVersion:")[0].splitlines()
                       if line.startswith("#")).split(".")[0]
    named = set(re.findall(r"\b(" + "|".join(WORKLOAD_KINDS) + r")\b", opening))
    assert named == {kind}, f"{manifest.name} opens with {opening!r}"


def test_both_injections_start_the_agent_through_the_environment() -> None:
    patch = kyverno_pod_patch()
    [every] = patch["spec"]["containers"]
    assert starts_the_agent(every)
    cel = one(build("deploy/admission/mutating-admission-policy"), "MutatingAdmissionPolicy")[
        "spec"]["mutations"][0]["applyConfiguration"]["expression"]
    containers = cel[cel.index("containers: object.spec.containers.map"):]
    assert re.search(r'name: "ALLOCWATCH_RUN",\s*value: "1"', containers)


@pytest.mark.parametrize("example", EXAMPLES)
def test_sidecar_pod_wiring(example: str) -> None:
    config = one(build("deploy/base"), "ConfigMap")
    sidecar_config = yaml.safe_load(config["data"]["allocwatch.yaml"])
    socket_path = sidecar_config["agents"]["unix_socket"]
    for where, template in example_pods(example):
        spec = template["spec"]
        sidecar = find_sidecar(spec)
        volumes = {v["name"]: v for v in spec["volumes"]}

        # socket on a pod-private emptyDir, mounted by the sidecar and every training container
        assert "emptyDir" in volumes["allocwatch-socket"], where
        for container in all_containers(spec):
            mounts = {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}
            assert mounts.get("allocwatch-socket") == SOCKET_DIR, f"{where} {container['name']}"
        # the sockets in the sidecar's own directory inside it; the agents check its user
        assert Path(socket_path).parent == Path(SIDECAR_DIR)
        assert sidecar["securityContext"]["runAsUser"] == SIDECAR_UID, where
        sidecar_env = {e["name"]: e["value"] for e in sidecar.get("env", [])}
        assert sidecar_env["ALLOCWATCH_ADMIN"] == f"unix://{SIDECAR_DIR}/admin.sock", where
        for container in spec["containers"]:
            if container["name"] != SIDECAR:
                env = {e["name"]: e for e in container["env"]}
                assert env["ALLOCWATCH_TARGET"]["value"] == f"unix://{socket_path}", where
                assert env["ALLOCWATCH_SIDECAR_UID"]["value"] == str(SIDECAR_UID), where

        # the config comes from the ConfigMap that deploy/base generates, under a stable name
        assert volumes["allocwatch-config"]["configMap"]["name"] == config["metadata"]["name"], (
            where
        )
        config_flag = sidecar["args"][sidecar["args"].index("--config") + 1]
        config_mount = {m["name"]: m for m in sidecar["volumeMounts"]}["allocwatch-config"]
        assert (
            Path(config_flag).parent == Path(config_mount["mountPath"]) and config_mount["readOnly"]
        )
        assert Path(config_flag).name in config["data"]

        # who the process is, through the downward API, on every training container (the
        # agent reads it; the sidecar needs none of it: only where ctl finds its admin API)
        assert [e["name"] for e in sidecar["env"]] == ["ALLOCWATCH_ADMIN"], where
        for container in spec["containers"]:
            if container["name"] == SIDECAR:
                continue
            env = {
                e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
                for e in container["env"]
            }
            assert {k: env.get(k) for k in IDENTITY} == IDENTITY, where
            # the training job's name, from the label its controller sets on its pods
            assert env["ALLOCWATCH_TRAINING_JOB"] == (
                f"metadata.labels['{JOB_NAME_LABELS[example]}']"), where

        # the metrics port, named, where the config listens; probes on it
        ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
        assert ports == {"metrics": METRICS_PORT}
        assert sidecar_config["metrics"]["port"] == METRICS_PORT
        probes = {
            k: sidecar[k]["httpGet"] for k in ("startupProbe", "readinessProbe", "livenessProbe")
        }
        assert probes["readinessProbe"] == {"path": "/readyz", "port": "metrics"}
        assert probes["livenessProbe"] == {"path": "/healthz", "port": "metrics"}
        assert probes["startupProbe"] == {"path": "/healthz", "port": "metrics"}


def test_sidecar_security_and_resources() -> None:
    sidecar = canonical_sidecar()
    security = sidecar["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] != 0
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert "privileged" not in security
    resources = sidecar["resources"]
    # equal, so that a Guaranteed training pod stays Guaranteed
    assert resources["requests"] == resources["limits"]
    assert set(resources["requests"]) == {"cpu", "memory"}
    # the image runs as the same user the manifests ask for
    dockerfile = (DEPLOY / "image/Dockerfile").read_text()
    assert f"USER {security['runAsUser']}:{security['runAsGroup']}" in dockerfile


# --- monitoring custom resources -----------------------------------------------------------


@pytest.mark.parametrize("example", EXAMPLES)
def test_podmonitor_selects_every_sidecar_pod_and_its_port(example: str) -> None:
    monitor = one(build("deploy/base"), "PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert "release" in monitor["metadata"]["labels"]
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    keep = [r for r in endpoint.get("relabelings", []) if r.get("action") == "keep"]
    for where, template in example_pods(example):
        assert selector_matches(monitor["spec"]["selector"], template["metadata"]["labels"]), where
        sidecar = find_sidecar(template["spec"])
        assert endpoint["port"] in {p["name"] for p in sidecar["ports"]}
        for rule in keep:  # the relabelling keeps the sidecar's container
            assert rule["sourceLabels"] == ["__meta_kubernetes_pod_container_name"]
            assert re.fullmatch(rule["regex"], SIDECAR)
        # and a training container is not selected by that rule
        for container in template["spec"]["containers"]:
            if container["name"] != SIDECAR:
                assert not any(re.fullmatch(r["regex"], container["name"]) for r in keep)


def test_podmonitor_does_not_select_pods_without_the_sidecar() -> None:
    monitor = one(build("deploy/base"), "PodMonitor")
    assert not selector_matches(
        monitor["spec"]["selector"], {"app.kubernetes.io/name": "llm-pretrain"}
    )


def port_set(rule: dict, protocol: str) -> set[int]:
    found: set[int] = set()
    for port in rule["ports"]:
        if port["protocol"] == protocol:
            found |= set(range(port["port"], port.get("endPort", port["port"]) + 1))
    return found



def test_the_networkpolicies_admit_prometheus_to_the_metrics_port_and_the_pods_to_each_other(
) -> None:
    """Opt-in: deploy/base ships none. Once a policy selects a pod, whatever no policy allows
    is denied: the opt-in policies allow the metrics port from Prometheus and the training pods'
    traffic to each other, and nothing from anywhere else."""
    assert not [r for r in build("deploy/base") if r["kind"] == "NetworkPolicy"]
    policies = {p["metadata"]["name"]: p for p in build("deploy/networkpolicy")
                if p["kind"] == "NetworkPolicy"}
    assert set(policies) == {"allocwatch-sidecar", "allocwatch-training-pods"}
    for policy in policies.values():
        for example in EXAMPLES:
            for where, template in example_pods(example):
                assert selector_matches(
                    policy["spec"]["podSelector"], template["metadata"]["labels"]
                ), where
        assert policy["spec"]["policyTypes"] == ["Ingress"]  # egress untouched
        assert all(rule.get("from") for rule in policy["spec"]["ingress"])  # never "anyone"
    [metrics] = policies["allocwatch-sidecar"]["spec"]["ingress"]
    assert port_set(metrics, "TCP") == {METRICS_PORT} and not port_set(metrics, "UDP")
    assert all("namespaceSelector" in peer for peer in metrics["from"])
    [pods] = policies["allocwatch-training-pods"]["spec"]["ingress"]
    assert "ports" not in pods  # every port: rendezvous, NCCL's ephemeral ones
    assert pods["from"] == [{"podSelector": policies["allocwatch-training-pods"]["spec"][
        "podSelector"]}]  # the training pods of this namespace alone


def test_prometheusrule_is_the_generated_one() -> None:
    rule = one(build("deploy/monitoring"), "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert "release" in rule["metadata"]["labels"]
    sources = []
    for name in ("recording.yaml", "alerts.yaml"):
        sources += yaml.safe_load((DEPLOY / "rules" / name).read_text())["groups"]
    assert rule["spec"]["groups"] == sources
    check = subprocess.run(
        [sys.executable, str(DEPLOY / "rules/generate.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stderr


@pytest.mark.parametrize("example", ["pytorchjob", "jobset"])
def test_training_operator_resources_are_well_formed(example: str) -> None:
    workload = next(
        r for r in build(f"deploy/examples/{example}") if r["kind"] in ("PyTorchJob", "JobSet")
    )
    if workload["kind"] == "PyTorchJob":
        assert workload["apiVersion"] == "kubeflow.org/v1"
        replicas = workload["spec"]["pytorchReplicaSpecs"]
        assert set(replicas) <= {"Master", "Worker"} and "Master" in replicas
        for name, replica in replicas.items():
            assert replica["replicas"] >= 1 and replica["restartPolicy"] in (
                "OnFailure",
                "Never",
                "ExitCode",
                "Always",
            )
            # the operator finds the training container by this name
            assert "pytorch" in {c["name"] for c in replica["template"]["spec"]["containers"]}, name
    else:
        assert workload["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
        names = [job["name"] for job in workload["spec"]["replicatedJobs"]]
        assert len(names) == len(set(names))
        assert set(workload["spec"]["successPolicy"]["targetReplicatedJobs"]) <= set(names)
        for job in workload["spec"]["replicatedJobs"]:
            job_spec = job["template"]["spec"]
            assert job_spec["template"]["spec"]["restartPolicy"] in ("Never", "OnFailure")
            assert job_spec["completions"] == job_spec["parallelism"]
    assert workload["metadata"]["namespace"] == "training"


def test_grafana_provisioning_configmap_carries_the_dashboard() -> None:
    config_map = one(kustomize_build(GRAFANA), "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert (
        config_map["data"]["allocwatch.json"]
        == (GRAFANA / "dashboards/allocwatch.json").read_text()
    )
    monitoring = build("deploy/monitoring")
    assert {r["kind"] for r in monitoring} == {"PrometheusRule", "ConfigMap"}
    assert all(r["metadata"]["namespace"] == "monitoring" for r in monitoring)


# --- lint ----------------------------------------------------------------------------------


def test_yamllint_is_clean() -> None:
    pytest.importorskip("yamllint", reason="yamllint is not installed (pip install yamllint)")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "yamllint",
            "--strict",
            "-c",
            str(REPO / ".yamllint"),
            str(DEPLOY),
            str(GRAFANA),
            str(REPO / ".yamllint"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_sidecar_configmap_is_accepted_by_the_sidecar() -> None:
    """The sidecar refuses unknown fields; its own parser must accept what the ConfigMap holds."""
    config_module = pytest.importorskip(
        "exporter.sidecar.config", reason="the exporter package is not importable"
    )
    config_map = one(build("deploy/base"), "ConfigMap")
    config = config_module.parse_config(yaml.safe_load(config_map["data"]["allocwatch.yaml"]))
    assert config.metrics.port == METRICS_PORT and config.metrics.address == "0.0.0.0"
    assert config.agents.unix_socket == f"{SIDECAR_DIR}/agent.sock"
    assert config.agents.socket_mode == 0o666


# --- the one metrics port --------------------------------------------------------------------

DCGM_EXPORTER_PORT, OPENTELEMETRY_PORT = 9400, 9464


def test_one_metrics_port_everywhere_and_clear_of_the_gpu_nodes_exporters() -> None:
    """The default, the manifests, the image and the demo agree on one port, which is neither
    dcgm-exporter's nor OpenTelemetry's (both run beside training pods, under hostNetwork too)."""
    import argparse

    from exporter.commands import demo
    from exporter.sidecar.config import MetricsConfig

    assert METRICS_PORT not in (DCGM_EXPORTER_PORT, OPENTELEMETRY_PORT)
    assert MetricsConfig().port == METRICS_PORT
    parser = argparse.ArgumentParser()
    demo.register(parser.add_subparsers())
    assert parser.parse_args(["demo"]).port == METRICS_PORT
    assert f"EXPOSE {METRICS_PORT}" in (DEPLOY / "image/Dockerfile").read_text()
    # Every other mention of the two neighbours' ports says whose they are.
    texts = [p for root in (DEPLOY, GRAFANA) for p in root.rglob("*")
             if p.suffix in (".yaml", ".json", ".py", "")]
    texts += [REPO / "README.md", *(REPO / "docs").glob("*.md")]
    for path in texts:
        if not path.is_file():
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if re.search(rf"\b({DCGM_EXPORTER_PORT}|{OPENTELEMETRY_PORT})\b", line):
                assert re.search(r"dcgm|OpenTelemetry", line, re.I), f"{path}:{n}: {line.strip()}"
