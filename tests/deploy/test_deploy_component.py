"""deploy/components/allocwatch on workloads written without allocwatch: a Job, a PyTorchJob and a
JobSet as a user has them (the examples' manifests with their command back to plain `torchrun`,
and with the user's own containers, environment, volumes and init containers), built with
`kubectl kustomize` from a kustomization of a few lines. Every training container must start the
agent, every pod template must carry the sidecar, and nothing of the user's may be lost."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from support.deploy import (
    COMPONENT,
    DEPLOY,
    ESSENTIAL_FIELDS,
    SIDECAR,
    SOCKET_DIR,
    canonical_sidecar,
    find_sidecar,
    kustomize_build,
    load_yaml_documents,
    newest_known_version,
    pod_templates,
    require_binary,
    starts_the_agent,
    trainer_additions,
    validate_strict,
)
from support.pod import LocalPod, stop
from support.waiting import wait_for

from bench.lib.ports import free_port

WORKLOADS = {
    "Job": DEPLOY / "examples/job/job.yaml",
    "PyTorchJob": DEPLOY / "examples/pytorchjob/pytorchjob.yaml",
    "JobSet": DEPLOY / "examples/jobset/jobset.yaml",
}
USER_ENV = {"name": "HF_HOME", "value": "/data/hf"}
USER_VOLUME = {"name": "data", "persistentVolumeClaim": {"claimName": "datasets"}}
USER_MOUNT = {"name": "data", "mountPath": "/data"}
USER_INIT = {"name": "fetch-weights", "image": "busybox:1.36", "command": ["true"]}
TRAIN_TORCH = Path(__file__).with_name("train_torch.py")
USER_SIDE_CONTAINER = {"name": "tensorboard", "image": "tensorflow/tensorflow:2.16.1"}


def component_from(directory: Path) -> str:
    """The Component's path as a user's kustomization names it (kustomize wants it relative)."""
    return os.path.relpath(COMPONENT, directory)


def bare(kind: str) -> dict:
    """The example's workload as a user has it: plain torchrun, the user's own things."""
    [workload] = load_yaml_documents(WORKLOADS[kind])
    for _, template in pod_templates(workload):
        spec = template["spec"]
        for container in spec["containers"]:
            command = container["command"]
            assert command[:3] == ["allocwatch", "run", "--"]
            container["command"] = command[3:]
            container.setdefault("env", []).append(dict(USER_ENV))
            container.setdefault("volumeMounts", []).append(dict(USER_MOUNT))
        spec.setdefault("volumes", []).append(copy.deepcopy(USER_VOLUME))
        spec.setdefault("initContainers", []).append(copy.deepcopy(USER_INIT))
        if kind == "Job":  # a pod with a second container: every container gets the agent's env
            spec["containers"].append(dict(USER_SIDE_CONTAINER))
    return workload


def build_with_component(tmp_path: Path, *workloads: dict) -> list[dict]:
    names = []
    for i, workload in enumerate(workloads):
        names.append(f"workload-{i}.yaml")
        (tmp_path / names[-1]).write_text(yaml.safe_dump(workload))
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(
        {"resources": names, "components": [component_from(tmp_path)]}))
    return kustomize_build(tmp_path)


@pytest.mark.parametrize("kind", WORKLOADS)
def test_the_component_adds_allocwatch_to_a_bare_workload(kind: str, tmp_path: Path) -> None:
    user = bare(kind)
    [built] = build_with_component(tmp_path, user)  # the additions' own Pod is never output
    assert built["kind"] == kind
    reference = canonical_sidecar()
    agent_env = {e["name"]: e for e in trainer_additions()["env"]}
    user_templates = dict(pod_templates(user))
    templates = list(pod_templates(built))
    assert len(templates) == len(user_templates)
    for where, template in templates:
        spec = template["spec"]
        original = user_templates[where]["spec"]
        assert template["metadata"]["labels"]["allocwatch.io/sidecar"] == "true", where

        sidecar = find_sidecar(spec)
        assert sidecar is not None, where
        for field in ESSENTIAL_FIELDS + ("restartPolicy", "args"):
            assert sidecar.get(field) == reference.get(field), f"{where}: {field}"
        assert [c["name"] for c in spec["initContainers"]] == ["fetch-weights", SIDECAR]

        volumes = {v["name"]: v for v in spec["volumes"]}
        assert {"allocwatch-socket", "allocwatch-config", "allocwatch-tmp", "data"} <= set(volumes)
        assert volumes["data"] == USER_VOLUME

        for container, before in zip(spec["containers"], original["containers"], strict=True):
            name = f"{where} {container['name']}"
            assert starts_the_agent(container), name
            env = {e["name"]: e for e in container["env"]}
            for key, entry in agent_env.items():
                assert env[key] == entry, f"{name}: {key}"
            assert "ALLOCWATCH_TRAINING_JOB" in env, name
            for entry in before.get("env", []):  # the user's own, kept
                assert env[entry["name"]] == entry, name
            # env values stay strings (a created YAML scalar could turn "1" into a number)
            assert env["ALLOCWATCH_RUN"]["value"] == "1", name
            mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
            assert mounts == {"allocwatch-socket": SOCKET_DIR, **{
                m["name"]: m["mountPath"] for m in before.get("volumeMounts", [])}}, name
            # the user's command, image and resources untouched
            for field in ("command", "image", "resources"):
                assert container.get(field) == before.get(field), f"{name}: {field}"

        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": "x", **template["metadata"]}, "spec": spec}
        validate_strict(pod, newest_known_version())


def test_the_training_job_name_comes_from_each_controllers_label(tmp_path: Path) -> None:
    built = build_with_component(tmp_path, *(bare(kind) for kind in WORKLOADS))
    expected = {"Job": "batch.kubernetes.io/job-name",
                "PyTorchJob": "training.kubeflow.org/job-name",
                "JobSet": "jobset.sigs.k8s.io/jobset-name"}
    assert {r["kind"] for r in built} == set(expected)
    for workload in built:
        for where, template in pod_templates(workload):
            for container in template["spec"]["containers"]:
                env = {e["name"]: e for e in container["env"]}
                path = env["ALLOCWATCH_TRAINING_JOB"]["valueFrom"]["fieldRef"]["fieldPath"]
                assert path == f"metadata.labels['{expected[workload['kind']]}']", where


def test_a_pytorchjob_without_workers_fails_the_build_naming_the_replica(tmp_path: Path) -> None:
    user = bare("PyTorchJob")
    del user["spec"]["pytorchReplicaSpecs"]["Worker"]
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(user))
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(
        {"resources": ["job.yaml"], "components": [component_from(tmp_path)]}))
    result = subprocess.run([require_binary("kubectl"), "kustomize", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "spec.pytorchReplicaSpecs.Worker" in result.stderr


def test_a_pod_the_component_made_starts_the_agent_through_its_environment_alone(
        tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """The bare Job's own `torchrun ... train.py`, with nothing but the Component's environment
    (ALLOCWATCH_RUN=1, the installed .pth file): the worker's import of torch starts the agent,
    which connects to the sidecar as the pod's one agent; torchrun's launcher starts none.
    With a CPU build of torch, as here, allocwatch's allocator does not install (the worker
    says so) and the agent's source is PyTorch's allocator: it is the start-up that is tested.
    The worker uses no GPU, so its agent would wait for a first use that never comes
    (tests/agent/test_agent_unconnected.py): the one variable added to the pod's environment,
    ALLOCWATCH_AGENT_CONNECT=start, is the one docs/deploy.md gives for a check without GPUs."""
    torch = pytest.importorskip("torch")
    user_dir = tmp_path / "user"
    user_dir.mkdir()
    (user_dir / "job.yaml").write_text(yaml.safe_dump(bare("Job")))
    (user_dir / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [os.path.relpath(DEPLOY / "base", user_dir), "job.yaml"],
        "components": [component_from(user_dir)]}))
    # A short path: a Unix socket's path has at most 107 bytes, and pytest's tmp_path is long.
    work = Path(tempfile.mkdtemp(prefix="aw-pod-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(work, ignore_errors=True))
    pod = LocalPod(work / "volumes", user_dir, metrics_port=free_port(), as_users=False)
    stop_file = work / "stop"
    argv = pod.argv(pod.trainer, replace={
        "--nproc-per-node=8": ["--nproc-per-node=1", "--standalone"],
        "train.py": [str(TRAIN_TORCH), str(stop_file)]})
    assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]  # no `allocwatch run`

    sidecar = pod.start(pod.sidecar, pod.argv(pod.sidecar), cwd=work)
    trainer = None
    try:
        wait_for(lambda: (pod.sidecar_dir() / "agent.sock").exists() or sidecar.poll() is not None,
                 timeout=60, what="the sidecar's socket")
        assert sidecar.poll() is None, stop(sidecar)
        # PYTHONPATH emptied: the hook can come from the installed .pth file alone.
        trainer = pod.start(pod.trainer, argv, cwd=work, PYTHONPATH="",
                            ALLOCWATCH_AGENT_CONNECT="start")

        def connected() -> list[dict]:
            out = pod.ctl("agents", "--json")
            agents = json.loads(out.stdout)["agents"] if out.returncode == 0 else []
            exited = [{}] if trainer.poll() is not None else []  # ends the wait, then fails
            return [a for a in agents if a["connected"]] or exited

        agents = wait_for(connected, timeout=120, interval=0.5, what="the worker's agent")
        assert trainer.poll() is None, stop(trainer)
        [agent] = agents
        stop_file.touch()
        assert trainer.wait(timeout=60) == 0
        log = stop(trainer)
        worker_pid = int(re.search(r"worker pid (\d+)", log).group(1))
        assert agent["pid"] == worker_pid, (agent, log)
        assert agent["pod"] == "llm-pretrain-x7k2p" and agent["job"] == "llm-pretrain"
        if torch.version.cuda is None:
            assert agent["backend"] == "pytorch" and "keeping PyTorch's CUDA allocator" in log
        else:
            assert agent["backend"] == "allocwatch", log
        assert "cuda initialised: False" in log  # nothing of allocwatch's started CUDA
    finally:
        print(stop(sidecar))
        if trainer is not None:
            print(stop(trainer))
