"""Builds the native back end (backend.cpp, capture_graphs.cpp, ipc.cpp) against the torch
installed here: once per torch build and C++ ABI, cached, and locked so that the workers of one
job starting together build it once and the others wait for it.

Needs a C++ compiler (``$CXX``, else g++), torch's headers and libraries, and the CUDA runtime
headers that CUDA builds of torch bring from PyPI (``nvidia-cuda-runtime``; CUDA 13 also
``nvidia-cuda-crt``), or a CUDA toolkit's. No nvcc and no torch.utils.cpp_extension. A failed
build is remembered with its reason, so that every later process falls back at once instead of
compiling again; ``allocwatch native build`` retries it. A library built before for the same
torch build is found without a compiler (``built``): a container image builds it in a builder
stage with ``allocwatch native build`` and copies the cache into its final stage, which needs
no compiler (docs/deploy.md).

Where: ``$ALLOCWATCH_NATIVE_DIR``, else ``$XDG_CACHE_HOME/allocwatch/native``, else
``~/.cache/allocwatch/native``; a folder that cannot be written falls back to the temporary
directory.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import shutil
import struct
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from allocator_ext.native import releases
from allocator_ext.protocol.files import write_whole

HERE = Path(__file__).resolve().parent
# The back end's translation units: PyTorch's allocator interface, CUDA graph walking, IPC.
UNITS = (HERE / "backend.cpp", HERE / "capture_graphs.cpp", HERE / "ipc.cpp")
CSRC = HERE.parent / "csrc"
# Host-only stand-ins for CUDA headers that PyPI's runtime wheel lacks (cuda_include_dirs).
STAND_INS = HERE / "stand_ins"
# Everything a build depends on in this package: its units and what they include, and how they
# are compiled (this file, and the releases' table, which chooses the C++ standard).
SOURCES = (*UNITS, *sorted(HERE.glob("*.h")), CSRC / "native_core.h",
           *sorted((CSRC / "core").glob("*.h")), *sorted(STAND_INS.glob("crt/*.h")),
           Path(__file__).resolve(), HERE / "releases.py")
LIBRARY_NAME = "allocwatch_native.so"
FAILED_NAME = "failed.txt"
LOG_NAME = "build.log"
COMPILE_TIMEOUT_S = 600
WAIT_FOR_OTHERS_S = 900
_UNKNOWN_REASON = ("an earlier build of the native back end failed ({log}); "
                   "`allocwatch native build` tries again")


class BuildError(RuntimeError):
    """The back end cannot be built here; the message says why and what would help."""


@dataclass(frozen=True)
class Plan:
    """One build: its cache key, the compiler command ("{output}" stands for the library being
    written) and a line saying what it builds against."""

    key: str
    command: tuple[str, ...]
    describe: str


def cache_dir() -> Path:
    configured = os.environ.get("ALLOCWATCH_NATIVE_DIR")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "allocwatch" / "native"


def _writable(folder: Path) -> Path:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".probe-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
        return folder
    except OSError:
        fallback = _fallback_dir()
        fallback.mkdir(parents=True, exist_ok=True)
        return fallback


def _fallback_dir() -> Path:
    """Where builds go when the cache folder cannot be written."""
    return Path(tempfile.gettempdir()) / f"allocwatch-native-{os.getuid()}"


def _sources_digest() -> str:
    digest = hashlib.sha256()
    for path in SOURCES:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]




def _nvidia_roots() -> list[Path]:
    try:
        import nvidia  # the namespace package of NVIDIA's PyPI wheels
    except ImportError:
        return []
    return [Path(p) for p in getattr(nvidia, "__path__", [])]


def _header_version(include: Path) -> str | None:
    text = (include / "cuda_runtime_api.h").read_text(errors="replace")
    found = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", text)
    return str(int(found.group(1)) // 1000) if found else None


def cuda_include_dirs(cuda_version: str) -> list[str]:
    """The CUDA runtime headers for torch's CUDA version: a folder with cuda_runtime_api.h of
    that major version (PyPI's wheels first, then a toolkit), and one with crt/host_config.h
    (which CUDA 13 ships apart, in nvidia-cuda-crt)."""
    major = cuda_version.split(".")[0]
    candidates: list[Path] = []
    configured = os.environ.get("ALLOCWATCH_CUDA_INCLUDE")
    if configured:
        candidates.append(Path(configured))
    for root in _nvidia_roots():
        candidates += [root / f"cu{major}" / "include", root / "cuda_runtime" / "include",
                       root / "cuda_crt" / "include", root / "cuda_nvcc" / "include"]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            candidates.append(Path(home) / "include")
    candidates += sorted(Path("/usr/local").glob(f"cuda-{major}*/include"), reverse=True)
    runtime = [c for c in candidates if (c / "cuda_runtime_api.h").is_file()]
    matching = [c for c in runtime if _header_version(c) == major]
    if not matching:
        found = ", ".join(f"{c} (CUDA {_header_version(c)})" for c in runtime) or "none"
        raise BuildError(
            f"no CUDA {major} runtime headers (found: {found}): "
            f"pip install 'nvidia-cuda-runtime{'' if int(major) >= 13 else '-cu' + major}"
            f"=={major}.*', or set ALLOCWATCH_CUDA_INCLUDE")
    include = matching[0]
    dirs = [str(include)]
    if not (include / "crt" / "host_config.h").is_file():
        # CUDA 13 ships crt/ apart (nvidia-cuda-crt, which torch does not depend on): NVIDIA's
        # where installed, else allocwatch's host-only stand-ins, so that torch's own
        # dependencies are enough to build.
        crt = [c for c in candidates if (c / "crt" / "host_config.h").is_file()]
        dirs.append(str(crt[0]) if crt else str(STAND_INS))
    return dirs


def compiler() -> str:
    name = os.environ.get("CXX") or "g++"
    path = shutil.which(name)
    if path is None:
        raise BuildError(f"no C++ compiler ({name} not found): install one (apt-get install "
                         f"g++), or build once where there is one with `allocwatch native build` "
                         f"and share {cache_dir()}")
    return path


def process_libstdcxx() -> Path | None:
    """The libstdc++ this process runs on, torch's own (None where none is loaded)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address, perms, offset, device, inode, path
        if len(fields) == 6 and Path(fields[5]).name.startswith("libstdc++.so"):
            return Path(fields[5])
    return None


def needed_libraries(library: Path) -> list[str]:
    """The DT_NEEDED names of an ELF64 little-endian shared object (what ldd starts from)."""
    data = library.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise BuildError(f"{library}: not a 64-bit little-endian ELF file")
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    loads, dynamic = [], None
    for i in range(phnum):
        kind, _, offset, vaddr, _, filesz = struct.unpack_from("<IIQQQQ", data,
                                                               phoff + i * phentsize)
        if kind == 1:  # PT_LOAD: maps file offsets to addresses
            loads.append((vaddr, offset, filesz))
        elif kind == 2:  # PT_DYNAMIC
            dynamic = (offset, filesz)
    if dynamic is None:
        return []
    entries = [struct.unpack_from("<qQ", data, dynamic[0] + i * 16)
               for i in range(dynamic[1] // 16)]
    strtab = next((value for tag, value in entries if tag == 5), None)  # DT_STRTAB, an address
    if strtab is None:
        return []
    base = next((offset + strtab - vaddr for vaddr, offset, size in loads
                 if vaddr <= strtab < vaddr + size), None)
    if base is None:
        raise BuildError(f"{library}: its string table lies outside every loaded segment")
    return [data[base + value:data.index(b"\0", base + value)].decode()
            for tag, value in entries if tag == 1]  # DT_NEEDED


def _runtime_link(libstdcxx: Path | None) -> list[str]:
    # The back end includes c10's headers, whose error messages are built with ostringstream
    # and whose exceptions cross into torch: it must run on torch's libstdc++. Some compilers'
    # specs link libstdc++ statically (one GPU image's g++ does); the copy of its own that gives
    # the library crashed the first out-of-memory message. Naming the process's libstdc++
    # before the compiler's own libraries resolves every symbol from it, so the static archive
    # contributes nothing; _compile checks that the result depends on it. Whatever the archive
    # of a newer compiler still adds (what the process's libstdc++ lacks) is kept private to
    # the library (--exclude-libs), so that nothing of it interposes or is interposed on.
    return [*([str(libstdcxx)] if libstdcxx is not None else []), "-Wl,--exclude-libs,ALL"]


def identity(torch: Any) -> tuple[str, str]:
    """The cache key of the back end for `torch`, and a line saying what it is built against:
    the same whichever compiler builds it, so that a library built elsewhere (an image's
    builder stage) is found where there is none."""
    cuda = torch.version.cuda
    if cuda is None:
        raise BuildError(f"torch {torch.__version__} is a CPU build: no CUDA allocator to replace")
    abi = int(bool(torch._C._GLIBCXX_USE_CXX11_ABI))
    identity = "|".join([torch.__version__, str(torch.version.git_version), str(cuda),
                         f"abi{abi}", _sources_digest()])
    key = (f"torch{torch.__version__.replace('+', '-')}-cuda{cuda}-abi{abi}-"
           f"{hashlib.sha256(identity.encode()).hexdigest()[:12]}")
    return key, f"torch {torch.__version__} (CUDA {cuda}, C++ ABI {abi})"


def plan(torch: Any) -> Plan:
    """The build for `torch`."""
    cxx = compiler()
    key, describe = identity(torch)
    torch_dir = Path(torch.__file__).resolve().parent
    lib = torch_dir / "lib"
    if not any(lib.glob("libc10_cuda.so*")):
        raise BuildError(f"torch {torch.__version__} has no libc10_cuda in {lib}")
    abi = int(bool(torch._C._GLIBCXX_USE_CXX11_ABI))
    includes = [str(torch_dir / "include"), *cuda_include_dirs(str(torch.version.cuda)),
                str(CSRC)]
    command = [cxx, f"-std={releases.cxx_standard(torch.__version__)}", "-O2", "-fPIC",
               "-fvisibility=hidden", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-Wall",
               "-Wno-unused-parameter", "-Wsuggest-override"]
    command += [f"-I{d}" for d in includes]
    command += ["-shared", *map(str, UNITS), "-o", "{output}",
                *_runtime_link(process_libstdcxx()), f"-L{lib}", "-lc10", "-lc10_cuda",
                f"-Wl,-rpath,{lib}", "-ldl"]
    return Plan(key=key, command=tuple(command), describe=describe)


@contextmanager
def _locked(path: Path, wait_s: float) -> Iterator[None]:
    with open(path, "a+") as handle:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() > deadline:
                    raise BuildError(f"another process has been building the native back end "
                                     f"for over {wait_s:.0f} s (lock {path})") from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _compile(p: Plan, folder: Path) -> Path:
    target = folder / LIBRARY_NAME
    partial = folder / f".{LIBRARY_NAME}.{os.getpid()}"
    command = [part.replace("{output}", str(partial)) for part in p.command]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise BuildError(f"compiling the native back end took over {COMPILE_TIMEOUT_S} s") from None
    except OSError as e:
        raise BuildError(f"cannot run the compiler: {e}") from None
    (folder / LOG_NAME).write_text(" ".join(command) + "\n" + done.stdout + done.stderr)
    if done.returncode != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        errors = [line for line in done.stderr.splitlines() if "error" in line][:3]
        raise BuildError(f"compiling the native back end for {p.describe} failed ("
                         f"{folder / LOG_NAME}): {' / '.join(errors) or done.stderr[-400:]}")
    if "-shared" in command and not any(name.startswith("libstdc++.so")
                                        for name in needed_libraries(partial)):
        partial.unlink(missing_ok=True)
        raise BuildError(f"{command[0]} linked a copy of libstdc++ into the native back end "
                         f"for {p.describe}, which must share torch's: set CXX to a compiler "
                         f"that links libstdc++ as a shared library")
    os.replace(partial, target)  # readers see the whole library or none
    return target


def ensure_built(p: Plan, root: Path | None = None, force: bool = False,
                 wait_s: float = WAIT_FOR_OTHERS_S) -> Path:
    """The library of plan `p`, built now if no process built it before. A remembered failure
    raises BuildError at once, unless `force` (which also rebuilds a library already there)."""
    folder = _writable(root or cache_dir()) / p.key
    target, failed = folder / LIBRARY_NAME, folder / FAILED_NAME
    if not force:
        if target.is_file():
            return target
        _raise_remembered_failure(failed)
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(folder.parent / f"{p.key}.lock", wait_s):
        if not force:  # another process may have finished while this one waited
            if target.is_file():
                return target
            _raise_remembered_failure(failed)
        failed.unlink(missing_ok=True)
        try:
            return _compile(p, folder)
        except BuildError as e:
            reason = str(e) or _UNKNOWN_REASON.format(log=folder / LOG_NAME)
            try:
                write_whole(failed, reason.encode())
            except OSError:
                pass  # not remembered: the next process tries again; this one still says why
            raise


def remembered_failure(failed: Path) -> str | None:
    """Why the last build failed, if a failure is remembered in `failed`; None otherwise.
    Unlocked callers may race a forced rebuild that removes the marker: a marker gone is no
    marker. BuildError where the marker exists and cannot be read."""
    try:
        reason = failed.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise BuildError(f"an earlier build of the native back end failed, and its reason "
                         f"cannot be read ({failed}: {e.strerror})") from None
    return reason or _UNKNOWN_REASON.format(log=failed.parent / LOG_NAME)


def _raise_remembered_failure(failed: Path) -> None:
    if (reason := remembered_failure(failed)) is not None:
        raise BuildError(reason)


def built(torch: Any, root: Path | None = None) -> Path | None:
    """The back end for `torch` where one was built before (here, or in an image's builder
    stage whose cache was copied here), found without a compiler; None where there is none."""
    key, _ = identity(torch)
    for folder in (root or cache_dir(), _fallback_dir()):
        candidate = folder / key / LIBRARY_NAME
        if candidate.is_file():
            return candidate
    return None


def library(force: bool = False) -> Path:
    """The back end for the torch installed here: the one built before, else built now."""
    import torch

    if not force and (found := built(torch)) is not None:
        return found
    return ensure_built(plan(torch), force=force)
