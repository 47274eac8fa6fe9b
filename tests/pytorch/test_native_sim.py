"""The native back end on the simulated device, through PyTorch's own C++ allocator interface:
the back end is built exactly as `install()` builds it (allocator_ext/native/build.py), against
a CUDA build of torch's headers and libraries, and driven by c10's allocator calls
(native_sim/allocator_calls.cpp) while a stand-in CUDA runtime answers the few runtime calls c10
makes (native_sim/cuda_runtime_stand_in.c) and the core allocates on its simulated device
(ALLOCWATCH_TORCH_DEVICE=sim). So the paths a GPU run takes through the native back end,
native_core.cpp and the core run here: out of memory, the memory fraction, private pools, raw
allocations.

The torch libraries are those of the releases CI fetches (tests/support/torch_releases.py): every
scenario runs against 2.11's, the release measured on the GPU; those whose interface differs
between releases run against each release's."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support import kept_builds, torch_releases

from allocator_ext.native import build, releases

# One worker under pytest-xdist: each release's allocator_calls.so is compiled once (_built).
pytestmark = [pytest.mark.timeout(torch_releases.BUILD_TIMEOUT_S),
              pytest.mark.xdist_group("native_sim")]

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
         "pytorchs_settings_tests_in_one_process", "a_pool_with_its_own_allocator",
         "a_pool_allocator_that_calls_back_into_pytorch", "pools_used_on_oom"]


def _compiled(command: list[str], source: Path, root: Path, name: str) -> Path:
    """`command` (all but its output) run once: into the session's `root`, or kept between runs
    in a folder named by the command and the source (support.kept_builds)."""
    kept = kept_builds.kept_root()
    where = kept_builds.folder(kept / "native_sim", command, [source]) if kept else root
    target = where / name
    if not target.is_file():
        partial = where / f".{name}.{os.getpid()}"
        done = subprocess.run([*command, "-o", str(partial)], capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        os.replace(partial, target)
    return target


_BUILT: dict[str, tuple[Path, Path, Path]] = {}


def _built(release_builds, root: Path, version: str) -> tuple[Path, Path, Path]:
    """The back end, allocator_calls.so and the runtime stand-in, for one release."""
    if version in _BUILT:
        return _BUILT[version]
    backend = release_builds.library(version)
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    assert cxx is not None
    plan = release_builds.plan(version)
    lib = torch_releases.folder(version) / "torch" / "lib"
    includes = [arg for arg in plan.command if arg.startswith("-I")]
    calls_source = HERE / "allocator_calls.cpp"
    calls = _compiled([cxx, f"-std={releases.cxx_standard(version)}", "-O1", "-fPIC", "-shared",
                       "-D_GLIBCXX_USE_CXX11_ABI=1", *includes, str(calls_source),
                       f"-L{lib}", "-lc10", "-lc10_cuda", f"-Wl,-rpath,{lib}"],
                      calls_source, root, f"allocator_calls-{version}.so")
    runtime_source = HERE / "cuda_runtime_stand_in.c"
    runtime = _compiled([cxx, "-x", "c", "-O1", "-fPIC", "-shared", str(runtime_source)],
                        runtime_source, root, "cuda_runtime_stand_in.so")
    _BUILT[version] = backend, calls, runtime
    return _BUILT[version]


@pytest.fixture(scope="module")
def sim_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("native_sim")


@pytest.fixture
def built(release_builds, sim_root: Path) -> tuple[Path, Path, Path]:
    return _built(release_builds, sim_root, torch_releases.GPU_RELEASE)


def _run_scenario(backend: Path, calls: Path, runtime: Path, name: str,
                  environment: dict[str, str] | None = None) -> None:
    env = {**os.environ, "ALLOCWATCH_TORCH_DEVICE": "sim",
           "ALLOCWATCH_TORCH_SIM_BYTES": str(CAPACITY), "LD_PRELOAD": str(runtime),
           "ALLOCWATCH_ALLOC_CONF": "", "PYTORCH_CUDA_ALLOC_CONF": "", **(environment or {})}
    out = subprocess.run([sys.executable, str(SCENARIOS), str(backend), str(calls), name],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert out.stdout.startswith(f"PASS {name}"), out.stdout


@pytest.mark.parametrize("name", NAMES)
def test_native_back_end_on_the_simulated_device(built: tuple[Path, Path, Path],
                                                  name: str) -> None:
    _run_scenario(*built, name)


# What every release runs, beyond building and loading (test_native_build.py): the calls whose
# declarations differ between releases (snapshots, private pools, a MemPool's own allocator, the
# settings' route) and the out-of-memory path.
EVERY_RELEASE = ["out_of_memory", "private_pools_have_plain_segments",
                 "set_allocator_settings_as_torch_calls_it", "a_pool_with_its_own_allocator"]


@pytest.mark.parametrize("version", torch_releases.VERSIONS)
def test_each_release_serves_c10s_calls(release_builds, sim_root: Path, version: str) -> None:
    built_for_release = _built(release_builds, sim_root, version)
    for name in EVERY_RELEASE:
        _run_scenario(*built_for_release, name)


def test_a_compiler_that_links_its_own_libstdcxx_statically(
        release_builds, built: tuple[Path, Path, Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiler whose libstdc++ is an archive (as on the GPU machine, emulated here with
    -static-libstdc++) still gives a back end that runs on the process's C++ runtime and shows
    no copy of its own: with one visible, the process's runtime interposed on part of it and
    every out-of-memory message, which holds numbers, crashed while it was written."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm (binutils) to read the library's symbols")
    _backend, calls, runtime = built
    # Kept between runs (support.kept_builds) where builds are: the wrapper too, at a path of
    # its own, since its path is the build's command.
    kept = kept_builds.kept_root()
    home = kept / "static_libstdcxx" if kept else tmp_path
    home.mkdir(parents=True, exist_ok=True)
    wrapper = home / "g++-static-libstdc++"
    script = (f'#!/bin/sh\nexec {shutil.which(os.environ.get("CXX", "g++"))} "$@" '
              f"-static-libstdc++\n")
    if not wrapper.is_file() or wrapper.read_text() != script:
        partial = home / f".{wrapper.name}.{os.getpid()}"
        partial.write_text(script)
        partial.chmod(0o755)
        os.replace(partial, wrapper)
    monkeypatch.setenv("CXX", str(wrapper))
    # The build links the C++ runtime the process runs on (loaded by conftest.py, as torch
    # loads it in a training process).
    assert build.process_libstdcxx() is not None
    plan = release_builds.plan(torch_releases.GPU_RELEASE)
    backend = (kept_builds.ensure_built(plan, home, [wrapper]) if kept
               else build.ensure_built(plan, root=tmp_path / "cache"))
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


FIND_IT = textwrap.dedent("""\
    import shutil, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    from support import kept_builds, torch_releases
    from allocator_ext.native import build

    torch = torch_releases.torch_module(Path(sys.argv[2]))
    print("compilers:", [c for c in ("g++", "c++", "gcc", "cc") if shutil.which(c)])
    try:
        build.plan(torch)
    except build.BuildError as e:
        print("no build here:", e)
    print("found:", build.built(torch))
    sys.modules["torch"] = torch  # what `allocwatch native status` imports
    from argparse import Namespace
    from exporter.commands import native
    print("status exit:", native.run(Namespace(action="status")))
    """)


def test_a_back_end_built_in_one_environment_serves_in_another_without_a_compiler(
        release_builds, built: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """A training image's final stage has no compiler: the back end built in its builder stage
    (`allocwatch native build` into ALLOCWATCH_NATIVE_DIR) is copied over, and the same torch
    build finds it there, loads it and is served by it (docs/deploy.md)."""
    backend, calls, runtime = built
    final = tmp_path / "final-stage" / "native"
    shutil.copytree(backend.parent, final / backend.parent.name)  # COPY --from=builder
    bare = tmp_path / "bin"  # the final stage's PATH: Python, no compiler
    bare.mkdir()
    (bare / "python3").symlink_to(sys.executable)
    environment = {"PATH": str(bare), "CXX": "", "ALLOCWATCH_NATIVE_DIR": str(final)}
    release = torch_releases.folder(torch_releases.GPU_RELEASE)
    out = subprocess.run([sys.executable, "-c", FIND_IT, str(HERE.parents[1]), str(release)],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, **environment})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "compilers: []" in out.stdout, out.stdout
    assert "no build here: no C++ compiler (g++ not found)" in out.stdout, out.stdout
    found = Path(out.stdout.split("found: ")[1].splitlines()[0].strip())
    assert found == final / backend.parent.name / build.LIBRARY_NAME, out.stdout
    assert f"built for torch {torch_releases.GPU_RELEASE}+cu130 (CUDA 13.0, C++ ABI 1): " \
           f"{found}" in out.stdout and "status exit: 0" in out.stdout, out.stdout
    _run_scenario(found, calls, runtime, "out_of_memory", environment)
