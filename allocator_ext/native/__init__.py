"""The native back end: allocwatch's allocator as PyTorch's CUDA allocator through PyTorch's own
C++ interface (c10::cuda::CUDACachingAllocator::CUDAAllocator), so that every caller reaches it
(backend.cpp says how; build.py how it is built and cached).

It is what ``allocator_ext.install()`` and ``allocwatch run`` use; where it cannot be built or
loaded, install() falls back to PyTorch's pluggable path with a warning naming what that path
does not serve.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

from allocator_ext.native.build import BuildError, library

__all__ = ["BuildError", "NativeError", "apply_settings", "install", "set_allocator_settings"]

_loaded: ctypes.CDLL | None = None


class NativeError(RuntimeError):
    """The back end could not be built, loaded or installed here."""


def _call(function: Any, *args: bytes) -> None:
    message = ctypes.create_string_buffer(4096)
    function.argtypes = [ctypes.c_char_p] * len(args) + [ctypes.c_char_p, ctypes.c_size_t]
    if function(*args, message, len(message)) != 0:
        raise NativeError(message.value.decode(errors="replace"))


def install(core_library: str, so: Path | None = None) -> None:
    """Makes the core in `core_library` (allocator_ext._core's path) PyTorch's CUDA allocator.
    Before CUDA is initialised, as any allocator change."""
    global _loaded
    try:
        path = so or library()
    except BuildError as e:
        raise NativeError(str(e)) from None
    try:
        handle = ctypes.CDLL(str(path))
    except OSError as e:
        raise NativeError(f"cannot load the native back end {path}: {e}") from None
    _call(handle.allocwatch_native_install, core_library.encode())
    _loaded = handle


def apply_settings(settings: str) -> None:
    """PyTorch settings allocwatch's core has no key for but the back end serves
    (per_process_memory_fraction), as a run-time change would apply them."""
    if _loaded is None:
        raise NativeError("the native back end is not installed")
    _call(_loaded.allocwatch_native_apply_settings, settings.encode())


def set_allocator_settings(settings: str) -> None:
    """A _set_allocator_settings call with PyTorch's semantics (the keys it does not name that
    PyTorch's parser resets return to their defaults), for releases whose call does not reach
    the back end's parser hook (torch 2.9)."""
    if _loaded is None:
        raise NativeError("the native back end is not installed")
    _call(_loaded.allocwatch_native_set_allocator_settings, settings.encode())
