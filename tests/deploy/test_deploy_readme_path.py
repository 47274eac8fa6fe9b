"""A new user's path, from the README alone: a fresh clone, `pip install -e .` ("Two commands"),
then "On Kubernetes": the example Job's pod as `kubectl kustomize deploy/examples/job` renders
it, started from its own command lines -- the sidecar's, and the trainer's `allocwatch run --
torchrun ... train.py` with train.py replaced by tests/deploy/train_sim.py on two ranks -- and
the README's scrape (`curl -s localhost:9471/metrics | grep METRIC`), which shows both ranks'
allocator figures.

What this machine cannot be, and how the test stands in for it:
- no network: the install uses `--no-build-isolation` (the build tools are already here, in the
  environment the tests run in, which the fresh virtual environment sees, as it sees torch:
  support.venv says how, whether the tests run in a system Python or in a venv of their own);
- no cluster: the pod's volumes are directories, its containers processes (support.pod), run
  as this test's user (tests/deploy/test_deploy_pod_users.py runs them as the manifests'
  users), and the port-forward is a direct connection to the sidecar;
- no GPU, and torch is a CPU build: PyTorch's allocator there has no device to report, so
  train_sim.py runs allocwatch's core on the simulated device and publishes it with an agent of
  its own, on the address the container's environment gives (see its docstring);
- a shared machine: the sidecar listens on a free port of loopback instead of 9471 (the test
  checks that the rendered pod names 9471)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.deploy import require_binary
from support.paths import REPO
from support.pod import LocalPod, stop
from support.venv import make_venv
from support.waiting import wait_for

from bench.lib.ports import free_port

parser = pytest.importorskip("prometheus_client.parser",
                             reason="prometheus_client is not installed")
pytest.importorskip("allocator_ext", reason="allocator_ext is not built")
pytestmark = pytest.mark.timeout(900)

README = (REPO / "README.md").read_text()
TRAIN = Path(__file__).with_name("train_sim.py")
EXAMPLE_COMMAND = "allocwatch run -- torchrun --nproc-per-node=8 train.py"


def readme_says(*commands: str) -> None:
    for command in commands:
        assert command in README, f"the README no longer says `{command}`"


def readme_scrape() -> tuple[int, str]:
    """The port and metric of the README's scrape, `curl -s localhost:PORT/metrics | grep M`."""
    found = re.search(r"curl -s localhost:(\d+)/metrics \| grep (\w+)", README)
    assert found, "the README no longer shows how to scrape the example's pod"
    return int(found.group(1)), found.group(2)


def fresh_clone(target: Path) -> Path:
    """The files a clone of this tree has: tracked and new ones, nothing git ignores (no
    build directory, no compiled extension)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], cwd=REPO, capture_output=True, check=True)
    for name in filter(None, listed.stdout.decode().split("\0")):
        source = REPO / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    return target


@pytest.fixture(scope="module")
def installed() -> Iterator[tuple[Path, Path]]:
    """A clone, and the interpreter of a fresh virtual environment it is installed in."""
    require_binary("kubectl")
    readme_says("pip install -e .")
    root = Path(tempfile.mkdtemp(prefix="allocwatch-readme-", dir="/tmp"))
    try:
        clone = fresh_clone(root / "allocwatch")
        python = make_venv(root / "venv")
        install = subprocess.run([str(python), "-m", "pip", "install", "-q",
                                  "--no-build-isolation", "-e", "."], cwd=clone,
                                 capture_output=True, text=True, timeout=800)
        assert install.returncode == 0, install.stdout + install.stderr
        yield clone, python
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_fresh_venv_sees_the_packages_of_the_venv_the_tests_run_in(tmp_path) -> None:
    """The user's venv holds what its base interpreter lacks (torch, there): a venv made for a
    test from inside it must see it (`venv --system-site-packages` would see the base's)."""
    outer = make_venv(tmp_path / "users-venv")
    purelib = subprocess.run([str(outer), "-c", "import sysconfig; "
                              "print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    (Path(purelib) / "only_in_the_users_venv.py").write_text("HERE = True\n")
    inner = make_venv(tmp_path / "fresh", python=str(outer))
    seen = subprocess.run([str(inner), "-c", "import sys, only_in_the_users_venv as m; "
                           "print(m.HERE, sys.prefix)"], capture_output=True, text=True)
    assert seen.returncode == 0, seen.stderr
    assert seen.stdout.split() == ["True", str(tmp_path / "fresh")]


PLOT_EXTRA = "pip install --no-build-isolation -e '.[plot]'"


def test_adding_the_plot_extra_to_a_checkout_reuses_its_compiled_extension(installed) -> None:
    """README, "What-if on a recorded trace": the extra added with --no-build-isolation to a
    checkout installed that way builds nothing again (the build folder, pyproject.toml's
    build-dir, is kept and reused; under build isolation it would be cleared)."""
    clone, python = installed
    readme_says(PLOT_EXTRA)
    again = subprocess.run([str(python), "-m", *PLOT_EXTRA.split()[:-1], ".[plot]", "-v"],
                           cwd=clone, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "Building CXX object" not in again.stdout, again.stdout[-3000:]
    assert "clearing cache" not in again.stdout + again.stderr
    plotted = subprocess.run([str(python), "-c", "import matplotlib, allocator_ext._core"],
                             cwd=clone.parent, capture_output=True, text=True, timeout=120)
    assert plotted.returncode == 0, plotted.stderr


def test_from_a_fresh_clone_to_a_scrape_of_the_example_job(installed) -> None:
    clone, python = installed
    readme_says("kubectl apply -k deploy/examples/job", "kubectl kustomize deploy/examples/job",
                EXAMPLE_COMMAND)
    port, metric = readme_scrape()
    work = clone.parent
    pod = LocalPod(work / "pod", "job", metrics_port=free_port(), deploy=clone / "deploy",
                   python=str(python), as_users=False, console_script=True)
    allocwatch = str(python.with_name("allocwatch"))
    trainer_command = pod.trainer["command"] + pod.trainer.get("args", [])
    assert " ".join(trainer_command) == EXAMPLE_COMMAND  # what the README says it runs
    rendered = {p["name"]: p["containerPort"] for p in pod.sidecar["ports"]}
    assert rendered["metrics"] == port and pod.sidecar_config["metrics"]["port"] != port

    sidecar = pod.start(pod.sidecar, pod.argv(pod.sidecar), cwd=work)
    trainer = None
    try:
        url = f"http://127.0.0.1:{pod.metrics_port}"
        wait_for(lambda: sidecar.poll() is not None or urllib.request.urlopen(
            f"{url}/readyz", timeout=2).status == 200, timeout=60, what="the sidecar ready")
        assert sidecar.poll() is None, stop(sidecar)
        argv = pod.argv(pod.trainer, replace={
            "--nproc-per-node=8": ["--nproc-per-node=2", "--standalone"],
            "train.py": [str(TRAIN), "--seconds", "120", "--stop-file", str(work / "stop")]})
        assert argv[:3] == [allocwatch, "run", "--"]
        trainer = pod.start(pod.trainer, argv, cwd=work)

        def ranks_published() -> dict[str, float]:
            text = urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
            found = {}
            for family in parser.text_string_to_metric_families(text):
                if family.name == metric:
                    for sample in family.samples:
                        if sample.value > 0:
                            found[sample.labels["rank"]] = sample.value
            return found if set(found) == {"0", "1"} else {}

        reserved = wait_for(lambda: ranks_published() or trainer.poll() is not None,
                            timeout=120, interval=0.5,
                            what=f"both ranks' {metric} on the metrics endpoint")
        assert isinstance(reserved, dict), stop(trainer)  # not: the trainer exited first
        assert min(reserved.values()) >= 148 << 20  # the script's weights, at least
        info = urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
        assert re.search(r'torch_cuda_allocator_info\{[^}]*training_job="llm-pretrain"', info)
        # README, "In a training job": `allocwatch ctl agents`, as the sidecar's container runs it.
        agents = pod.ctl("agents", "--json")
        assert agents.returncode == 0, agents.stderr
        pods = {a["pod"] for a in json.loads(agents.stdout)["agents"]}
        assert pods == {"llm-pretrain-x7k2p"}  # the downward API's pod name, on every agent

        (work / "stop").touch()
        assert trainer.wait(timeout=120) == 0
    finally:
        print(stop(sidecar))
        if trainer is not None:
            print(stop(trainer))
