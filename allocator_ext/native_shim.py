"""The optional native shim: allocwatch's allocator as PyTorch's CUDA allocator without the
pluggable path's limits (allocator_ext/native/native_shim.cpp says which).

PyTorch's C++ allocator interface changes between releases, so the shim is compiled on the
machine that uses it, against the torch installed there, with torch.utils.cpp_extension (a C++
compiler and the CUDA headers are needed; the first build takes about a minute and is cached in
torch's extension directory, $TORCH_EXTENSIONS_DIR). Turned on by ALLOCWATCH_NATIVE=1 or
``install(native=True)``; when it cannot be built, install() says why and uses the pluggable
path.

Status: compiled against torch 2.13's headers on a CPU machine; built and run on an H200 with
torch 2.11 (the GPU scenarios of tests/test_torch_gpu.py, cuDNN benchmark mode included).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SOURCE = Path(__file__).resolve().parent / "native" / "native_shim.cpp"


class NativeShimError(RuntimeError):
    """The shim could not be built or loaded here."""


def build(verbose: bool = False) -> Any:
    """Compiles the shim against the installed torch (cached after the first time)."""
    import torch
    from torch.utils import cpp_extension

    version = torch.__version__.split("+")[0].replace(".", "_")
    try:
        return cpp_extension.load(
            name=f"allocwatch_native_shim_{version}", sources=[str(SOURCE)],
            extra_cflags=["-O2", "-std=c++17"], with_cuda=True, verbose=verbose)
    except (OSError, RuntimeError, ImportError) as err:  # no compiler, no CUDA headers, ...
        raise NativeShimError(f"cannot build the native shim against torch "
                              f"{torch.__version__}: {str(err).strip()[:400]}") from None


def install(core_library: str, verbose: bool = False) -> None:
    """Makes the core in `core_library` (allocator_ext/_core's path) PyTorch's allocator
    through the shim. Before CUDA is initialised, as any allocator change."""
    build(verbose).install(core_library)
