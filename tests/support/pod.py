"""An example's pod run on this machine as its rendered manifest gives it: each container's
command and environment, its user (runAsUser/runAsGroup, through util-linux's setpriv), and its
volumes as directories of one root (an emptyDir with the kubelet's mode 0777, a ConfigMap's
files). What the machine cannot be is replaced, and said: `allocwatch` and `torchrun` are the
given interpreter's (`python -m exporter.cli`, `python -m torch.distributed.run`, what the two
commands are; or `allocwatch` the console script beside it, as an image installs it), the
downward API's fields get the values given (the job's name from the label its controller
adds), and the sidecar's metrics port a free one on loopback (a shared machine)."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from support.deploy import DEPLOY, SIDECAR, find_sidecar, kustomize_build, pod_templates

FIELDS = {
    "metadata.name": "llm-pretrain-x7k2p",
    "metadata.namespace": "training",
    "spec.nodeName": "gpu-node-1",
}


RUN_AS = Path(__file__).with_name("run_as.py")


@functools.cache
def _usable(as_user: tuple[str, ...], python: str) -> bool:
    probe = subprocess.run([*as_user, python, "-c",
                            "import grpc, prometheus_client, yaml, exporter.cli"],
                           capture_output=True, timeout=60)
    return probe.returncode == 0


def interpreter_usable_by(as_user: list[str], python: str) -> bool:
    """Whether the user can run this interpreter with its packages."""
    return _usable(tuple(as_user), python)


def setpriv() -> str:
    path = shutil.which("setpriv")
    if path is None:
        pytest.skip("setpriv (util-linux) is not installed: cannot run a container as its user")
    if os.geteuid() != 0:
        pytest.skip("running the containers as their users needs root")
    return path


class LocalPod:
    def __init__(self, root: Path, example: str | Path = "job", metrics_port: int = 0, *,
                 deploy: Path = DEPLOY, python: str = sys.executable, as_users: bool = True,
                 console_script: bool = False):
        """`example`: an example's name, or the directory of any kustomization (a user's, with
        the Component); its first pod template is the pod."""
        directory = example if isinstance(example, Path) else deploy / "examples" / example
        resources = kustomize_build(directory)
        [(workload, template)] = [(r, t) for r in resources for _, t in pod_templates(r)][:1]
        self.python = python
        self.as_users = as_users  # False: every container as this process's user
        self.console_script = console_script  # True: `allocwatch` is the script beside python
        # The pod's labels: its template's, and the one its controller adds (the job's name).
        self.labels: dict[str, str] = {**template["metadata"].get("labels", {}),
                                       "batch.kubernetes.io/job-name": workload["metadata"]["name"]}
        self.spec = template["spec"]
        self.sidecar = find_sidecar(self.spec)
        assert self.sidecar is not None
        self.trainer = next(c for c in self.spec["containers"] if c["name"] != SIDECAR)
        config_maps = {r["metadata"]["name"]: r for r in resources if r["kind"] == "ConfigMap"}
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        os.chmod(root, 0o755)  # every container's user reaches its volumes
        self.volumes: dict[str, Path] = {}
        for volume in self.spec["volumes"]:
            path = root / volume["name"]
            path.mkdir()
            if "emptyDir" in volume:
                os.chmod(path, 0o777)  # the kubelet's emptyDir
            elif "configMap" in volume:
                for name, text in config_maps[volume["configMap"]["name"]]["data"].items():
                    (path / name).write_text(text)
                    os.chmod(path / name, 0o644)
            self.volumes[volume["name"]] = path
        self.metrics_port = metrics_port
        self._rewrite_sidecar_config()

    # -- paths ---------------------------------------------------------------------------------

    def mounts(self, container: Mapping[str, Any]) -> dict[str, Path]:
        return {m["mountPath"]: self.volumes[m["name"]] for m in container.get("volumeMounts", [])}

    def host_path(self, container: Mapping[str, Any], text: str) -> str:
        """`text` with every mount path of the container replaced by its directory here (in
        one pass, so that a directory here is never mistaken for a mount path)."""
        mounts = self.mounts(container)
        if not mounts:
            return text
        pattern = "|".join(re.escape(m) for m in sorted(mounts, key=len, reverse=True))
        return re.sub(f"({pattern})(?=/|$|[^\\w.-])", lambda m: str(mounts[m.group(1)]), text)

    def socket_dir(self) -> Path:
        """The shared emptyDir."""
        return self.volumes["allocwatch-socket"]

    def sidecar_dir(self) -> Path:
        """The sidecar's own directory in it, where its sockets and the snapshots are."""
        return Path(self.sidecar_config["agents"]["unix_socket"]).parent

    def _rewrite_sidecar_config(self) -> None:
        args = self.sidecar["args"]
        config_path = Path(self.host_path(self.sidecar, args[args.index("--config") + 1]))
        config = yaml.safe_load(self.host_path(self.sidecar, config_path.read_text()))
        config["metrics"].update(address="127.0.0.1", port=self.metrics_port)
        config["nvml"]["enabled"] = False  # no GPU here
        config_path.write_text(yaml.safe_dump(config))
        self.sidecar_config = config

    # -- containers ----------------------------------------------------------------------------

    def argv(self, container: Mapping[str, Any],
             replace: Mapping[str, str | Sequence[str]] | None = None) -> list[str]:
        """The container's command and args, with `replace` applied word by word."""
        words = list(container.get("command", [])) + list(container.get("args", []))
        if not container.get("command"):
            words = ["allocwatch", *words]  # the sidecar image's ENTRYPOINT
        out: list[str] = []
        for word in words:
            new = (replace or {}).get(word, word)
            if isinstance(new, str):
                new = [new]
            for w in new:
                out.extend(self.commands().get(w, [self.host_path(container, w)]))
        return out

    def commands(self) -> dict[str, list[str]]:
        """`allocwatch` and `torchrun` as this interpreter runs them (in an image, both are the
        console scripts of the one environment allocwatch is installed in; here torch, and so
        its torchrun script, comes from the system's site-packages)."""
        allocwatch = ([str(Path(self.python).with_name("allocwatch"))] if self.console_script
                      else [self.python, "-m", "exporter.cli"])
        return {"allocwatch": allocwatch,
                "torchrun": [self.python, "-m", "torch.distributed.run"]}

    def env(self, container: Mapping[str, Any], **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ALLOCWATCH_")}
        for entry in container.get("env", []):
            if "value" in entry:
                env[entry["name"]] = self.host_path(container, entry["value"])
            else:
                path = entry["valueFrom"]["fieldRef"]["fieldPath"]
                if path.startswith("metadata.labels["):
                    env[entry["name"]] = self.labels.get(path.split("'")[1], "")
                else:
                    env[entry["name"]] = FIELDS[path]
        if not self.as_users and "ALLOCWATCH_SIDECAR_UID" in env:
            env["ALLOCWATCH_SIDECAR_UID"] = str(os.geteuid())  # the sidecar runs as we do here
        env.update(extra)
        return env

    def user(self, container: Mapping[str, Any]) -> tuple[int, int] | None:
        security = container.get("securityContext", {})
        if "runAsUser" not in security:
            return None  # the image's user: root, for the examples' trainer image
        return security["runAsUser"], security.get("runAsGroup", security["runAsUser"])

    def as_user(self, container: Mapping[str, Any], argv: list[str]) -> list[str]:
        user = self.user(container)
        if user is None or not self.as_users:
            return argv
        uid, gid = user
        as_user = [setpriv(), f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]
        if interpreter_usable_by(as_user, self.python):
            return [*as_user, *argv]
        # This interpreter lies where the user cannot read it: import first, then drop to it.
        assert argv[:2] == [self.python, "-m"], argv
        return [self.python, str(RUN_AS), str(uid), str(gid), *argv[2:]]

    def start(self, container: Mapping[str, Any], argv: list[str], cwd: Path,
              **env: str) -> subprocess.Popen:
        return subprocess.Popen(self.as_user(container, argv), cwd=cwd,
                                env=self.env(container, **self._home(container), **env),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def run(self, container: Mapping[str, Any], argv: list[str], cwd: Path,
            timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
        """A command in the container, as `kubectl exec -c NAME` runs it (as its user)."""
        return subprocess.run(self.as_user(container, argv), cwd=cwd, capture_output=True,
                              text=True, timeout=timeout,
                              env=self.env(container, **self._home(container), **env))

    def ctl(self, *args: str) -> subprocess.CompletedProcess:
        """`kubectl exec POD -c allocwatch-sidecar -- allocwatch ctl ARGS`: as the sidecar's user,
        with its container's environment (ALLOCWATCH_ADMIN), else at ctl's default address, as
        the sidecar's mounts place them here."""
        extra = {}
        if not any(e["name"] == "ALLOCWATCH_ADMIN" for e in self.sidecar.get("env", [])):
            extra["ALLOCWATCH_ADMIN"] = self.host_path(self.sidecar,
                                                       "unix:///run/allocwatch/admin.sock")
        return self.run(self.sidecar, self.argv({"command": ["allocwatch", "ctl", *args]}),
                        cwd=self.root, **extra)

    def _home(self, container: Mapping[str, Any]) -> dict[str, str]:
        """A user's HOME: the container's writable scratch (its root filesystem is read-only)."""
        if self.user(container) is None:
            return {}
        return {"HOME": self.host_path(container, "/tmp")}


def stop(process: subprocess.Popen, timeout: float = 15) -> str:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.stdout.read() if process.stdout else ""
