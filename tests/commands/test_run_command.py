"""allocwatch run: every Python process it starts — and their children, as torchrun's workers
are — installs allocwatch when it imports torch, before the user's next line, without code
changes. The processes here see no GPU (CUDA_VISIBLE_DEVICES is emptied, also on a machine with
one), so install() keeps PyTorch's allocator and says why, once in each process that installs:
the count of those lines is the count of installing processes. tests/pytorch/test_startup_hook.py
says what start-up leaves alone; tests/pytorch/test_native_gpu.py what it does on a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import REPO

CHILD = ("import sys, torch; print('torch-loaded' if 'allocator_ext.torch_integration' in "
         "sys.modules else 'torch-absent')")


def allocwatch_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "exporter.cli", "run", *args],
                          capture_output=True, text=True, cwd=REPO, timeout=120,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})


def test_the_command_runs_with_allocwatch_installed_at_start_up() -> None:
    pytest.importorskip("torch")
    out = allocwatch_run("--", sys.executable, "-c", CHILD)
    assert out.returncode == 0, out.stderr
    assert "torch-loaded" in out.stdout          # allocwatch installed as torch was imported
    assert "allocwatch" in out.stderr            # and said what it did (no GPU: kept PyTorch's)


def test_grandchildren_install_too_as_torchrun_workers_do() -> None:
    pytest.importorskip("torch")
    spawn = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {CHILD!r}])"
    out = allocwatch_run("--", sys.executable, "-c", spawn)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("torch-loaded") == 1
    assert out.stderr.count("keeping PyTorch's CUDA allocator") == 1   # the child: it imports torch


def test_under_torchrun_the_workers_install_and_the_launcher_does_not(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    # torchrun as `python -m torch.distributed.run` of this interpreter: the `torchrun` script on
    # PATH may belong to another Python (a virtual environment has none of its own).
    script = tmp_path / "worker.py"
    script.write_text(CHILD)
    out = allocwatch_run("--", sys.executable, "-m", "torch.distributed.run", "--standalone",
                         "--nproc-per-node", "2", str(script))
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("torch-loaded") == 2                       # both workers
    assert out.stderr.count("keeping PyTorch's CUDA allocator") == 2   # not the launcher


@pytest.mark.parametrize("launcher", ["deepspeed.launcher.launch", "accelerate.commands.launch"])
def test_under_deepspeeds_or_accelerates_launcher_only_the_worker_installs(
        tmp_path: Path, launcher: str) -> None:
    # DeepSpeed and Accelerate are not installed here: a stand-in module of the same name
    # does what their launchers do, imports torch and starts the worker as a child process.
    pytest.importorskip("torch")
    package = tmp_path.joinpath(*launcher.split(".")[:-1])
    package.mkdir(parents=True)
    for level in range(len(launcher.split(".")) - 1):
        tmp_path.joinpath(*launcher.split(".")[:level + 1], "__init__.py").touch()
    (package / f"{launcher.split('.')[-1]}.py").write_text(
        "import subprocess, sys, torch\n"
        "sys.exit(subprocess.run([sys.executable, sys.argv[1]]).returncode)\n")
    script = tmp_path / "worker.py"
    script.write_text(CHILD)
    out = subprocess.run([sys.executable, "-m", "exporter.cli", "run", "--", sys.executable,
                          "-m", launcher, str(script)], capture_output=True, text=True, cwd=REPO,
                         timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": "",
                                           "PYTHONPATH": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("torch-loaded") == 1                       # the worker
    assert out.stderr.count("keeping PyTorch's CUDA allocator") == 1   # not the launcher


def test_the_exit_status_is_the_commands() -> None:
    out = allocwatch_run("--", sys.executable, "-c", "raise SystemExit(7)")
    assert out.returncode == 7


def test_a_bad_setting_or_no_command_is_refused() -> None:
    out = allocwatch_run("--config", "expandable_segments:perhaps", "--", "true")
    assert out.returncode == 2 and "expandable_segments:perhaps" in out.stderr
    out = allocwatch_run()
    assert out.returncode == 2 and "no command given" in out.stderr


def _cpu_build() -> None:
    torch = pytest.importorskip("torch")
    if torch.version.cuda is not None:
        pytest.skip(f"torch {torch.__version__} is a CUDA build: these lines are a CPU build's")


def test_without_cuda_one_line_says_why_and_no_source_line_follows() -> None:
    _cpu_build()
    out = allocwatch_run("--", sys.executable, "-c", "import torch")
    assert out.returncode == 0, out.stderr
    # One line, not a warning's two (its second would echo allocwatch's own source line).
    assert out.stderr.splitlines() == [
        f"allocwatch: keeping PyTorch's CUDA allocator: torch {_torch_version()} is a CPU build"]


def test_keeping_pytorchs_allocator_without_cuda_says_the_agent_does_not_start() -> None:
    _cpu_build()
    out = allocwatch_run("--keep-pytorch-allocator", "--", sys.executable, "-c", "import torch")
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines() == [
        f"allocwatch: keeping PyTorch's CUDA allocator, as asked; torch {_torch_version()} is a "
        "CPU build, so there is no GPU memory to watch and the agent does not start"]


def _torch_version() -> str:
    import torch

    return str(torch.__version__)
