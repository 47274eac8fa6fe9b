"""Start-up under `allocwatch run` changes nothing but the allocator: the hook installed at
interpreter start (allocator_ext/_autostart) imports nothing until the program imports torch,
installs right after that import, and calls no CUDA driver function (CUDA starts when the
program first uses it, as PyTorch's own test_lazy_init checks). Each test runs under both
start-ups, which are one hook: `allocwatch run --`, and `ALLOCWATCH_RUN=1` alone (the installed
`.pth` file; Kubernetes pods whose command cannot be rewritten)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


STARTUPS = {
    "allocwatch run": [sys.executable, "-m", "exporter.cli", "run", "--", "env"],
    "ALLOCWATCH_RUN=1": ["env", "-u", "PYTHONPATH", "ALLOCWATCH_RUN=1"],
}
Run = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture(params=list(STARTUPS))
def run(request: pytest.FixtureRequest) -> Run:
    def run_code(code: str, *env: str) -> subprocess.CompletedProcess[str]:
        command = [*STARTUPS[request.param], *env, sys.executable, "-c", code]
        return subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=180)

    return run_code


def test_a_program_that_never_imports_torch_is_left_as_it_was(run: Run) -> None:
    out = run("import json, sys; print(json.dumps(sorted(m for m in sys.modules "
              "if m.split('.')[0] in ('torch', 'allocator_ext', 'exporter', 'grpc'))))")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []
    assert out.stderr == ""


def test_allocwatch_installs_as_torch_is_imported_and_cuda_stays_uninitialised(run: Run) -> None:
    torch = pytest.importorskip("torch")
    out = run("import sys\n"
              "assert 'allocator_ext' not in sys.modules\n"
              "import torch\n"
              "print('after import:', 'allocator_ext.torch_integration' in sys.modules,"
              " torch.cuda.is_initialized())\n")
    assert out.returncode == 0, out.stderr
    assert "after import: True False" in out.stdout
    # With a CPU build of torch PyTorch's allocator stays, with one line saying why; with a
    # CUDA build allocwatch's is in, and CUDA still waits for the program's first use.
    assert ("keeping PyTorch's CUDA allocator" in out.stderr) == (torch.version.cuda is None)


def test_a_failure_at_start_up_is_one_line_and_the_program_runs_on(run: Run) -> None:
    pytest.importorskip("torch")
    out = run("import torch; print('program ran')",
              "ALLOCWATCH_ALLOC_CONF=expandable_segments:maybe")
    assert out.returncode == 0, out.stderr
    assert "program ran" in out.stdout
    assert "allocwatch: not installed in pid" in out.stderr
    assert "expandable_segments:maybe" in out.stderr


def test_a_submodule_import_installs_too(run: Run) -> None:
    pytest.importorskip("torch")
    out = run("import sys; import torch.nn; "
              "print('allocator_ext.torch_integration' in sys.modules)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
