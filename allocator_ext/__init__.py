"""allocwatch's caching allocator and in-process agent.

Importable without torch and without a GPU: the core runs on a simulated device.

    import allocator_ext as ae
    dev = ae.SimDevice(capacity=80 << 30)
    alloc = ae.Allocator(dev)                 # allocwatch's defaults
    ptr = alloc.malloc(1 << 20, stream=0)
    alloc.free(ptr)
    alloc.stats()["reserved_bytes.all.current"]

In a training script, before the first CUDA tensor:

    import allocator_ext
    allocator_ext.install()                   # allocwatch's allocator becomes PyTorch's
    allocator_ext.start_agent()               # or set ALLOCWATCH_TARGET
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers only: at run time each name loads when first used
    from allocator_ext import _core as _core
    from allocator_ext import torch_integration as torch_integration
    from allocator_ext._core import (
        DEFAULT_CONFIG,
        NATIVE_CONFIG,
        Allocator,
        OutOfMemoryError,
        SimDevice,
        parse_config,
        round_size,
        segment_size_for,
    )
    from allocator_ext.agent import maybe_start_from_env, start_agent
    from allocator_ext.torch_integration import (
        InstallError,
        allocator,
        install,
        installed,
        snapshot,
    )

# Each public name and the module it comes from. Nothing is imported with the package itself:
# the protocol (allocator_ext.protocol), which the sidecar imports, must not load the compiled
# core, torch or gRPC's agent side.
_SOURCES = {
    **dict.fromkeys(("DEFAULT_CONFIG", "NATIVE_CONFIG", "Allocator", "OutOfMemoryError",
                     "SimDevice", "parse_config", "round_size", "segment_size_for"),
                    "allocator_ext._core"),
    **dict.fromkeys(("InstallError", "allocator", "install", "installed", "snapshot"),
                    "allocator_ext.torch_integration"),
    **dict.fromkeys(("start_agent", "maybe_start_from_env"), "allocator_ext.agent"),
}

# Submodules that `allocator_ext.<name>` reaches without importing them first.
_SUBMODULES = ("_core", "torch_integration")

__all__ = [
    "DEFAULT_CONFIG",
    "NATIVE_CONFIG",
    "Allocator",
    "InstallError",
    "OutOfMemoryError",
    "SimDevice",
    "allocator",
    "install",
    "installed",
    "maybe_start_from_env",
    "parse_config",
    "round_size",
    "segment_size_for",
    "snapshot",
    "start_agent",
]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"allocator_ext.{name}")
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module 'allocator_ext' has no attribute {name!r}")
    value = getattr(importlib.import_module(source), name)
    globals()[name] = value  # found directly next time
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_SOURCES))
