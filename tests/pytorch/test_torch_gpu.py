"""allocwatch's allocator inside PyTorch on a real GPU (marker gpu; skipped without one).
Each scenario runs in a fresh process: install() must precede CUDA's initialisation."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from support.paths import REPO

SCENARIOS = REPO / "tests" / "pytorch" / "gpu_scenarios.py"


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["record_stream", "waiting_frees",
                                  "waiting_frees_across_streams", "graph_capture",
                                  "expandable_and_empty_cache", "out_of_memory", "statistics"])
def test_scenario_on_the_gpu(name: str) -> None:
    """Through the pluggable path, the fallback where the native back end cannot be built: the
    scenarios it serves (the native back end runs them all, test_native_gpu.py)."""
    out = subprocess.run([sys.executable, str(SCENARIOS), name], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "ALLOCWATCH_NATIVE": "0"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"PASS {name}" in out.stdout


def test_install_after_cuda_started_is_refused_on_cpu_too() -> None:
    torch = pytest.importorskip("torch")
    import allocator_ext

    if torch.cuda.is_available():
        pytest.skip("covered by the GPU scenarios")
    # Without a driver, install() falls back with a warning and changes nothing.
    with pytest.warns(UserWarning, match="keeping PyTorch's CUDA allocator"):
        assert allocator_ext.install() is False
    assert not allocator_ext.torch_integration.installed()


def test_bad_settings_are_refused_before_anything_changes(monkeypatch) -> None:
    pytest.importorskip("torch")
    import allocator_ext

    monkeypatch.setenv("ALLOCWATCH_ALLOC_CONF", "expandable_segments:maybe")
    monkeypatch.setattr("ctypes.CDLL", lambda *a, **k: None)  # pretend a driver exists
    with pytest.raises(ValueError, match="expandable_segments:maybe"):
        allocator_ext.install()
    assert not allocator_ext.torch_integration.installed()


def test_disable_keeps_pytorchs_allocator(monkeypatch) -> None:
    pytest.importorskip("torch")
    import allocator_ext

    monkeypatch.setenv("ALLOCWATCH_DISABLE", "1")
    with pytest.warns(UserWarning, match="ALLOCWATCH_DISABLE"):
        assert allocator_ext.install() is False
