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
from allocator_ext.torch_integration import InstallError, allocator, install, installed, snapshot

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


def __getattr__(name: str) -> object:
    # The agent pulls in gRPC: load it when asked for, so that the core, replay and tune stay
    # quick to import.
    if name in ("start_agent", "maybe_start_from_env"):
        from allocator_ext import agent

        return getattr(agent, name)
    raise AttributeError(f"module 'allocator_ext' has no attribute {name!r}")
