"""Building the native back end (allocator_ext/native/build.py): against the headers and
libraries of every release allocator_ext/native/releases.py lists (CI fetches them with
.ci/torch_releases.py: each CUDA wheel's include/ and libc10, never installed), once per torch
build whatever the number of processes asking at once, with failures remembered, and a clear
reason (never a crash) where it cannot be built."""

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
from build_in_worker import build_in_worker
from support import torch_releases

from allocator_ext.native import build, releases
from allocator_ext.protocol.files import write_whole

torch = pytest.importorskip("torch")

LOADS = textwrap.dedent("""\
    import ctypes, os, sys
    library = ctypes.CDLL(sys.argv[1], mode=os.RTLD_NOW | os.RTLD_LOCAL)
    print("install:", hasattr(library, "allocwatch_native_install"),
          "settings:", hasattr(library, "allocwatch_native_apply_settings"))
    """)


@pytest.mark.timeout(torch_releases.BUILD_TIMEOUT_S)
@pytest.mark.parametrize("version", torch_releases.VERSIONS)
def test_the_back_end_builds_and_loads_against_each_release(release_builds, version: str) -> None:
    """Compiled with `override` on every function whose declaration differs between releases
    (backend.cpp, "Differences between releases"): a release whose interface moved fails here,
    naming the function. Linked against the release's libc10 and loaded with every symbol
    bound at once, as install() loads it."""
    library = release_builds.library(version)
    log = (library.parent / build.LOG_NAME).read_text()
    assert f"-std={releases.cxx_standard(version)}" in log.splitlines()[0]
    # Every function the back end overrides says so, or the compiler names it here.
    assert "can be marked override" not in log, log[-3000:]
    assert " error" not in log and "warning" not in log, log[-3000:]
    loaded = subprocess.run([sys.executable, "-c", LOADS, str(library)], capture_output=True,
                            text=True, timeout=60)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert loaded.stdout.strip() == "install: True settings: True", loaded.stdout


def test_every_release_of_the_table_is_one_install_serves() -> None:
    from allocator_ext.torch_integration import unsupported_release

    for release in releases.RELEASES:
        assert releases.supported(release.version + "+cu130") == release
    assert releases.supported("2.8.0") is None and releases.supported("2.16.0") is None
    assert releases.supported_range() == "2.9 to 2.15"
    newer, older = unsupported_release("2.16.0+cu132"), unsupported_release("2.8.0")
    assert newer.startswith("torch 2.16.0+cu132 is newer than the releases allocwatch's native "
                            "back end is built for (2.9 to 2.15)"), newer
    assert "older than" in older and "the agent reports PyTorch's own" in older


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


def test_eight_workers_starting_together_build_it_once(tmp_path: Path) -> None:
    plan = _fake_plan(tmp_path, """\
        time.sleep(1.0)  # slow enough that every worker arrives while it runs
        out.write_bytes(b"library")
        """)
    with multiprocessing.get_context("spawn").Pool(8) as pool:
        results = pool.map(build_in_worker, [(plan, str(tmp_path / "cache"))] * 8)
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
