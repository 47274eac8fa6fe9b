"""The native back end on the simulated device, through PyTorch's own C++ allocator interface:
the back end is built exactly as `install()` builds it (allocator_ext/native/build.py), against
a CUDA build of torch's headers and libraries, and driven by c10's allocator calls
(native_sim/allocator_calls.cpp) while a stand-in CUDA runtime answers the few runtime calls c10
makes (native_sim/cuda_runtime_stand_in.c) and the core allocates on its simulated device
(ALLOCWATCH_SHIM_DEVICE=sim). So the paths a GPU run takes through backend.cpp, torch_backend.cpp
and the core run here: out of memory, the memory fraction, private pools, raw allocations.

Needs a C++ compiler and a CUDA build of torch's libraries: the installed torch where it is one,
else the torch folder named by ALLOCWATCH_TEST_CUDA_TORCH (a CUDA wheel of torch unpacked, with
include/, lib/libc10_cuda.so and version.py); skips saying so otherwise."""

from __future__ import annotations

import os
import re
import runpy
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from allocator_ext.native import build

HERE = Path(__file__).resolve().parent / "native_sim"
SCENARIOS = HERE / "scenarios.py"
CAPACITY = 2 << 30  # scenarios.py's CAPACITY
NAMES = ["out_of_memory", "out_of_memory_under_fraction", "out_of_memory_in_a_private_pool",
         "private_pools_have_plain_segments", "empty_cache_leaves_no_segment",
         "nested_pools_serve_the_innermost",
         "reuse_in_a_capture_once_the_graph_orders_the_uses",
         "reuse_in_a_capture_once_every_use_is_joined",
         "no_reuse_in_a_capture_without_the_setting", "raw_allocations_are_counted",
         "every_setting_through_set_allocator_settings",
         "pytorchs_settings_tests_in_one_process"]


def _cuda_torch() -> types.SimpleNamespace | None:
    """What build.plan() reads of a torch module, for a CUDA build of torch on disk."""
    configured = os.environ.get("ALLOCWATCH_TEST_CUDA_TORCH")
    if configured:
        folder = Path(configured)
    else:
        try:
            import torch
        except ImportError:
            return None
        if torch.version.cuda is None:
            return None
        folder = Path(torch.__file__).resolve().parent
    if not (folder / "lib" / "libc10_cuda.so").is_file() or not (folder / "version.py").is_file():
        return None
    version = runpy.run_path(str(folder / "version.py"))
    if not version.get("cuda"):
        return None
    return types.SimpleNamespace(
        __file__=str(folder / "__init__.py"), __version__=version["__version__"],
        version=types.SimpleNamespace(cuda=version["cuda"], git_version=version["git_version"]),
        _C=types.SimpleNamespace(_GLIBCXX_USE_CXX11_ABI=True))


def _compile(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        pytest.skip("no C++ compiler")
    torch = _cuda_torch()
    if torch is None:
        pytest.skip("no CUDA build of torch's libraries (set ALLOCWATCH_TEST_CUDA_TORCH to an "
                    "unpacked CUDA wheel of torch)")
    try:
        plan = build.plan(torch)
    except build.BuildError as e:
        pytest.skip(f"the native back end cannot be built here: {e}")
    root = tmp_path_factory.mktemp("native_sim")
    backend = build.ensure_built(plan, root=root)
    torch_dir = Path(torch.__file__).parent
    includes = [arg for arg in plan.command if arg.startswith("-I")]
    calls = root / "allocator_calls.so"
    _compile([cxx, "-std=c++17", "-O1", "-fPIC", "-shared", "-D_GLIBCXX_USE_CXX11_ABI=1",
              *includes, str(HERE / "allocator_calls.cpp"), "-o", str(calls),
              f"-L{torch_dir / 'lib'}", "-lc10", "-lc10_cuda",
              f"-Wl,-rpath,{torch_dir / 'lib'}"])
    runtime = root / "cuda_runtime_stand_in.so"
    _compile([cxx, "-x", "c", "-O1", "-fPIC", "-shared", str(HERE / "cuda_runtime_stand_in.c"),
              "-o", str(runtime)])
    return backend, calls, runtime


def _run_scenario(backend: Path, calls: Path, runtime: Path, name: str) -> None:
    env = {**os.environ, "ALLOCWATCH_SHIM_DEVICE": "sim",
           "ALLOCWATCH_SHIM_SIM_BYTES": str(CAPACITY), "LD_PRELOAD": str(runtime),
           "ALLOCWATCH_ALLOC_CONF": "", "PYTORCH_CUDA_ALLOC_CONF": ""}
    out = subprocess.run([sys.executable, str(SCENARIOS), str(backend), str(calls), name],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert out.stdout.startswith(f"PASS {name}"), out.stdout


@pytest.mark.parametrize("name", NAMES)
def test_native_back_end_on_the_simulated_device(built: tuple[Path, Path, Path],
                                                  name: str) -> None:
    _run_scenario(*built, name)


def test_a_compiler_that_links_its_own_libstdcxx_statically(
        built: tuple[Path, Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiler whose libstdc++ is an archive (as on the GPU machine, emulated here with
    -static-libstdc++) still gives a back end that runs on the process's C++ runtime and shows
    no copy of its own: with one visible, the process's runtime interposed on part of it and
    every out-of-memory message, which holds numbers, crashed while it was written."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm (binutils) to read the library's symbols")
    _backend, calls, runtime = built
    wrapper = tmp_path / "g++-static-libstdc++"
    wrapper.write_text(f'#!/bin/sh\nexec {shutil.which(os.environ.get("CXX", "g++"))} "$@" '
                       f"-static-libstdc++\n")
    wrapper.chmod(0o755)
    monkeypatch.setenv("CXX", str(wrapper))
    torch = _cuda_torch()
    assert torch is not None
    backend = build.ensure_built(build.plan(torch), root=tmp_path / "cache")
    exported = subprocess.run([nm, "-D", "--defined-only", str(backend)], capture_output=True,
                              text=True, check=True).stdout
    # std::ostream's number insertion (the function that crashed), or any function of
    # libstdc++ itself (" T "; the templates the back end instantiates are weak, " W ").
    assert "_ZNSo9_M_insertIlEERSoT_" not in exported
    assert not re.findall(r" T _ZNK?St\w+", exported)
    needed = subprocess.run([shutil.which("readelf") or "readelf", "-d", str(backend)],
                            capture_output=True, text=True).stdout
    assert "libstdc++.so.6" in needed, needed
    _run_scenario(backend, calls, runtime, "out_of_memory")
