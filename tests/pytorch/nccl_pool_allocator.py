"""Builds nccl_pool_allocator.cpp (ncclMemAlloc and ncclMemFree behind CUDAPluggableAllocator's
functions) against the NCCL that torch runs with: the header and library of the nvidia-nccl
wheel beside torch ($ALLOCWATCH_NCCL_ROOT names another folder with include/nccl.h and
lib/libnccl.so.2), and the CUDA runtime headers nccl.h includes, a CUDA toolkit's (its
cuda_fp16.h needs CCCL's <nv/target>, which PyPI's runtime wheel lacks). Plain g++, as the
native back end is built (allocator_ext.native.build.compiler).

Used by the GPU scenario nccl_mempool and, without a GPU, by test_nccl_pool_allocator.py."""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path

from allocator_ext.native import build

SOURCE = Path(__file__).resolve().with_name("nccl_pool_allocator.cpp")
LIBRARY = "libnccl.so.2"
ALLOC, FREE = "nccl_pool_alloc", "nccl_pool_free"


class Missing(RuntimeError):
    """What the build needs is not on this machine; the message says what and where."""


def nccl_root() -> Path:
    """The folder with NCCL's include/nccl.h and lib/libnccl.so.2."""
    candidates = []
    configured = os.environ.get("ALLOCWATCH_NCCL_ROOT")
    if configured:
        candidates.append(Path(configured))
    try:
        import nvidia.nccl  # the wheel torch's CUDA builds depend on (nvidia-nccl-cu12/-cu13)

        candidates += [Path(p) for p in nvidia.nccl.__path__]
    except ImportError:
        pass
    for root in candidates:
        if (root / "include" / "nccl.h").is_file() and (root / "lib" / LIBRARY).is_file():
            return root
    raise Missing(f"no NCCL header and library (include/nccl.h, lib/{LIBRARY}) in "
                  f"{[str(c) for c in candidates] or 'the nvidia-nccl wheel (not installed)'}: "
                  f"install torch's nvidia-nccl wheel, or set ALLOCWATCH_NCCL_ROOT")


def cuda_include_dirs() -> list[Path]:
    """A CUDA toolkit's include folder (and CCCL's beside it) that has what nccl.h includes."""
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    for home in filter(None, homes):
        include = Path(home) / "include"
        dirs = [include, *([include / "cccl"] if (include / "cccl").is_dir() else [])]
        if (include / "cuda_runtime.h").is_file() and any((d / "nv" / "target").is_file()
                                                          for d in dirs):
            return dirs
    raise Missing(f"no CUDA toolkit headers with CCCL's <nv/target> (looked in "
                  f"{[h for h in homes if h]}): nccl.h includes cuda_fp16.h, which needs them; "
                  f"set CUDA_HOME")


def command(output: Path, nccl: Path, cuda: list[Path]) -> list[str]:
    lib = nccl / "lib"
    # -isystem: their headers' own warnings are not this file's.
    return [build.compiler(), "-std=c++17", "-O2", "-fPIC", "-shared", "-fvisibility=hidden",
            "-Wall", "-Wextra", "-isystem", str(nccl / "include"),
            *[arg for d in cuda for arg in ("-isystem", str(d))],
            str(SOURCE), "-o", str(output), f"-L{lib}", f"-l:{LIBRARY}", f"-Wl,-rpath,{lib}",
            "-lpthread"]


def build_into(folder: Path) -> Path:
    """The allocator's library in `folder`; raises Missing, or RuntimeError with the compiler's
    words."""
    output = folder / "nccl_pool_allocator.so"
    done = subprocess.run(command(output, nccl_root(), cuda_include_dirs()),
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0 or done.stderr.strip():
        raise RuntimeError(f"building {SOURCE.name} failed or warned:\n{done.stderr[-3000:]}")
    return output


class Counters:
    """What the built allocator counts (nccl_pool_allocator.cpp), read through ctypes."""

    def __init__(self, library: Path) -> None:
        self.lib = ctypes.CDLL(str(library))
        self.lib.nccl_pool_calls.restype = ctypes.c_longlong
        self.lib.nccl_pool_segment.argtypes = [ctypes.c_void_p]
        self.lib.nccl_pool_last_error.restype = ctypes.c_char_p

    def version(self) -> int:
        return int(self.lib.nccl_pool_version())

    def allocations(self) -> int:
        return int(self.lib.nccl_pool_calls(0))

    def frees(self) -> int:
        return int(self.lib.nccl_pool_calls(1))

    def live(self) -> int:
        return int(self.lib.nccl_pool_calls(2))

    def segment(self, ptr: int) -> str:
        """"live", "freed", or "not its own"."""
        return {1: "live", 0: "freed"}.get(self.lib.nccl_pool_segment(ptr), "not its own")

    def last_error(self) -> str:
        return self.lib.nccl_pool_last_error().decode()
