"""Building the native back end (allocator_ext/native/build.py): against torch's headers (the ABI
check CI runs here with torch 2.13's, a CPU build, and PyPI's CUDA runtime headers), once per
torch build whatever the number of processes asking at once, with failures remembered, and a
clear reason (never a crash) where it cannot be built."""

from __future__ import annotations

import errno
import multiprocessing
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from allocator_ext.native import build
from allocator_ext.protocol.files import write_whole

torch = pytest.importorskip("torch")


def _cuda_headers() -> list[str] | None:
    try:
        return build.cuda_include_dirs("13.0")
    except build.BuildError:
        return None


@pytest.fixture
def cpu_build_stand_ins(tmp_path: Path) -> list[str]:
    """CPU builds of torch lack c10/cuda/impl/cuda_cmake_macros.h, which CMake writes for CUDA
    builds; its one line is what a CUDA build's says."""
    macros = tmp_path / "stand_ins" / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    macros.parent.mkdir(parents=True)
    macros.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    return [str(tmp_path / "stand_ins")]


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="no C++ compiler")
@pytest.mark.skipif(_cuda_headers() is None,
                    reason="no CUDA 13 runtime headers (.ci/run installs nvidia-cuda-runtime)")
def test_the_back_end_compiles_against_this_torchs_interface(
        tmp_path: Path, cpu_build_stand_ins: list[str]) -> None:
    plan = build.plan(torch, extra_includes=cpu_build_stand_ins, link=False, cuda_version="13.0")
    built = build.ensure_built(plan, root=tmp_path)
    assert built.stat().st_size > 0
    log = (built.parent / build.LOG_NAME).read_text()
    # The functions some releases lack or declare otherwise are declared without `override`:
    # on this release the compiler must see each override, or PyTorch would never call it.
    major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    overridden = {line.split("AllocwatchAllocator::")[1].split("(")[0]
                  for line in log.splitlines()
                  if "can be marked override" in line and "AllocwatchAllocator::" in line}
    expected = {"snapshot", "getPoolUseCount", "createOrIncrefPool", "setUseOnOOM", "setNoSplit",
                "checkPoolLiveAllocations", "isHistoryEnabled", "recordHistory",
                "recordAnnotation", "pushCompileContext", "popCompileContext",
                "setUserMetadata", "getUserMetadata"}
    if (major, minor) >= (2, 13):
        expected |= {"attachOomRejectionObserver", "getContextForPointer"}
    assert expected <= overridden, sorted(expected - overridden)
    assert " error" not in log


def _fake_plan(tmp_path: Path, body: str) -> build.Plan:
    """A build whose compiler is a Python script: `body` runs with `out` (the library path)
    and `count` (a file that gets one line per compile)."""
    script = tmp_path / "fake_cxx.py"
    script.write_text(textwrap.dedent(f"""\
        import sys, time
        from pathlib import Path
        out, count = Path(sys.argv[1]), Path({str(tmp_path / "compiles")!r})
        with open(count, "a") as f:
            f.write("compile\\n")
        """) + textwrap.dedent(body))
    return build.Plan(key="fake-torch", command=(sys.executable, str(script), "{output}"),
                      describe="a fake torch")


def _build_in_worker(args: tuple[build.Plan, str]) -> str:
    plan, root = args
    try:
        return str(build.ensure_built(plan, root=Path(root)))
    except build.BuildError as e:
        return f"BuildError: {e}"


def test_eight_workers_starting_together_build_it_once(tmp_path: Path) -> None:
    plan = _fake_plan(tmp_path, """\
        time.sleep(1.0)  # slow enough that every worker arrives while it runs
        out.write_bytes(b"library")
        """)
    with multiprocessing.get_context("spawn").Pool(8) as pool:
        results = pool.map(_build_in_worker, [(plan, str(tmp_path / "cache"))] * 8)
    assert len(set(results)) == 1 and results[0].endswith(build.LIBRARY_NAME), results
    assert Path(results[0]).read_bytes() == b"library"
    assert (tmp_path / "compiles").read_text().count("compile") == 1


def test_a_failed_build_is_remembered_until_forced(tmp_path: Path) -> None:
    plan = _fake_plan(tmp_path, """\
        print("backend.cpp:1: error: no member named 'recordHistory'", file=sys.stderr)
        sys.exit(1)
        """)
    root = tmp_path / "cache"
    for _ in range(3):
        with pytest.raises(build.BuildError, match="no member named 'recordHistory'"):
            build.ensure_built(plan, root=root)
    assert (tmp_path / "compiles").read_text().count("compile") == 1  # remembered, not retried
    with pytest.raises(build.BuildError):
        build.ensure_built(plan, root=root, force=True)  # `allocwatch native build` retries
    assert (tmp_path / "compiles").read_text().count("compile") == 2


def test_a_failure_marker_removed_as_it_is_read_is_no_marker(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = _fake_plan(tmp_path, "out.write_bytes(b'library')\n")
    root = tmp_path / "cache"
    failed = root / plan.key / build.FAILED_NAME
    failed.parent.mkdir(parents=True)
    failed.write_text("an earlier failure")
    read_text = Path.read_text

    def removed_by_a_forced_rebuild_first(self: Path, *args, **kwargs) -> str:
        if self == failed:
            self.unlink(missing_ok=True)  # `allocwatch native build` starting in another process
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", removed_by_a_forced_rebuild_first)
    built = build.ensure_built(plan, root=root)
    assert built.read_bytes() == b"library"


def test_a_failure_marker_is_never_seen_empty_or_partial(tmp_path: Path) -> None:
    failed = tmp_path / build.FAILED_NAME
    reason = "compiling the native back end failed: " + "x" * (1 << 20)
    write_whole(failed, reason.encode())
    stop = threading.Event()

    def rewrite() -> None:
        while not stop.is_set():
            write_whole(failed, reason.encode())

    writer = threading.Thread(target=rewrite)
    writer.start()
    try:
        for _ in range(200):
            with pytest.raises(build.BuildError) as raised:
                build._raise_remembered_failure(failed)
            assert str(raised.value) == reason
    finally:
        stop.set()
        writer.join()
    assert [p.name for p in tmp_path.iterdir()] == [build.FAILED_NAME]


def test_an_empty_failure_marker_still_says_why(tmp_path: Path) -> None:
    plan = _fake_plan(tmp_path, "out.write_bytes(b'library')\n")
    failed = tmp_path / "cache" / plan.key / build.FAILED_NAME
    failed.parent.mkdir(parents=True)
    failed.write_text("")  # as a process killed while writing it, before markers were atomic
    with pytest.raises(build.BuildError, match="an earlier build .* failed .*native build"):
        build.ensure_built(plan, root=tmp_path / "cache")


def test_a_failure_that_cannot_be_remembered_is_still_a_build_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = _fake_plan(tmp_path, """\
        print("backend.cpp:1: error: no member named 'recordHistory'", file=sys.stderr)
        sys.exit(1)
        """)

    def disk_full(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(build, "write_whole", disk_full)
    for _ in range(2):
        with pytest.raises(build.BuildError, match="no member named 'recordHistory'"):
            build.ensure_built(plan, root=tmp_path / "cache")
    assert (tmp_path / "compiles").read_text().count("compile") == 2  # not remembered: retried


def test_a_library_is_replaced_whole_or_not_at_all(tmp_path: Path) -> None:
    plan = _fake_plan(tmp_path, """\
        out.write_bytes(b"half")
        sys.exit(1)  # the compiler dies after writing part of its output
        """)
    with pytest.raises(build.BuildError):
        build.ensure_built(plan, root=tmp_path / "cache")
    folder = tmp_path / "cache" / plan.key
    assert not (folder / build.LIBRARY_NAME).exists()
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == []


def test_no_compiler_is_a_clear_build_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    with pytest.raises(build.BuildError, match="no C.. compiler .no-such-compiler-here"):
        build.plan(torch)


def test_a_cpu_build_of_torch_has_nothing_to_replace() -> None:
    if torch.version.cuda is not None:
        pytest.skip("a CUDA build of torch")
    with pytest.raises(build.BuildError, match="CPU build"):
        build.plan(torch)


def test_an_unwritable_cache_falls_back_to_the_temporary_directory(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        target = Path("/proc/allocwatch-cannot-write-here")
    else:
        target = tmp_path / "read-only"
        target.mkdir(mode=0o500)
    plan = _fake_plan(tmp_path, "out.write_bytes(b'library')\n")
    built = build.ensure_built(plan, root=target)
    assert built.is_file() and not str(built).startswith(str(target))


FAKE_DRIVER = r"""
// libcuda.so.1 for a test on a machine without one: cuDeviceGetCount answers as the real
// driver does before cuInit (CUDA_ERROR_NOT_INITIALIZED = 3), and 0 after it.
static int initialised = 0;
int cuInit(unsigned int flags) { initialised = 1; return 0; }
int cuDeviceGetCount(int* count) { if (!initialised) return 3; *count = 0; return 0; }
"""


@pytest.fixture
def fake_driver(tmp_path: Path) -> Path:
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        pytest.skip("no C++ compiler for the stand-in driver")
    source = tmp_path / "fake_libcuda.c"
    source.write_text(FAKE_DRIVER)
    subprocess.run([cxx, "-x", "c", "-shared", "-fPIC", str(source), "-o",
                    str(tmp_path / "libcuda.so.1")], check=True)
    return tmp_path


def test_without_a_compiler_install_falls_back_and_calls_no_driver_function(
        fake_driver: Path, tmp_path: Path) -> None:
    # This machine has a CPU build of torch and no driver: the script says torch is a CUDA
    # build (version.cuda) and a stand-in libcuda.so.1 records whether cuInit was called.
    script = textwrap.dedent("""\
        import ctypes, warnings
        import torch
        torch.version.cuda = "13.0"
        import allocator_ext
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ok = allocator_ext.install()
        for w in caught:
            print("WARNING", w.message)
        count = ctypes.c_int(-1)
        print("cuDeviceGetCount", ctypes.CDLL("libcuda.so.1").cuDeviceGetCount(ctypes.byref(count)))
        print("installed", ok, allocator_ext.torch_integration.native())
        """)
    env = {**os.environ, "LD_LIBRARY_PATH": str(fake_driver), "CXX": "no-such-compiler",
           "ALLOCWATCH_NATIVE_DIR": str(tmp_path / "cache")}
    for key in ("ALLOCWATCH_DISABLE", "ALLOCWATCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        env.pop(key, None)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "native back end unavailable: no C++ compiler (no-such-compiler not found)" in out.stdout
    assert "cuDeviceGetCount 3" in out.stdout  # CUDA_ERROR_NOT_INITIALIZED: no cuInit
    # This CPU torch has no pluggable allocator either: PyTorch's stays, said so, no crash.
    assert "keeping PyTorch's CUDA allocator: neither the native back end nor the pluggable" \
        in out.stdout
    assert "installed False False" in out.stdout


STREAMING_LIBRARY = """
#include <sstream>
#include <string>
extern "C" int message_length(long n) {
  std::ostringstream s;
  s << "n=" << n;
  return (int)s.str().size();
}
"""


def _static_libstdcxx_link(tmp_path: Path, extra: list[str]) -> list[str]:
    """A link of a small library that streams, by a compiler told to link libstdc++ statically,
    as some images' g++ is by its specs."""
    source = tmp_path / "streams.cpp"
    source.write_text(STREAMING_LIBRARY)
    return [build.compiler(), "-std=c++17", "-fPIC", "-static-libstdc++", "-shared", str(source),
            "-o", "{output}", *extra]


def test_the_dependencies_of_a_shared_object_are_read_from_its_elf_header() -> None:
    needed = build.needed_libraries(Path(torch._C.__file__))
    assert any(name.startswith("libtorch_python") for name in needed), needed
    with pytest.raises(build.BuildError, match="not a 64-bit"):
        build.needed_libraries(Path(__file__))


def test_the_back_end_runs_on_torchs_libstdcxx() -> None:
    libstdcxx = build.process_libstdcxx()
    assert libstdcxx is not None and libstdcxx.is_file()
    needed = build.needed_libraries(Path(torch._C.__file__).parent / "lib" / "libc10.so")
    assert libstdcxx.name in needed or "libstdc++.so.6" in needed, needed


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="no C++ compiler")
def test_a_compiler_that_links_libstdcxx_statically_still_gives_a_library_on_torchs(
        tmp_path: Path) -> None:
    runtime = build._runtime_link(build.process_libstdcxx())
    p = build.Plan(key="streams", command=tuple(_static_libstdcxx_link(tmp_path, runtime)),
                   describe="a library that streams")
    built = build.ensure_built(p, root=tmp_path / "cache")
    assert any(n.startswith("libstdc++.so") for n in build.needed_libraries(built))


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="no C++ compiler")
def test_a_library_with_a_copy_of_libstdcxx_of_its_own_is_refused(tmp_path: Path) -> None:
    p = build.Plan(key="streams", command=tuple(_static_libstdcxx_link(tmp_path, [])),
                   describe="a library that streams")
    with pytest.raises(build.BuildError, match="linked a copy of libstdc[+][+] into"):
        build.ensure_built(p, root=tmp_path / "cache")
    assert not (tmp_path / "cache" / "streams" / build.LIBRARY_NAME).exists()
