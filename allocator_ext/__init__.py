"""allocwatch's caching allocator and in-process agent.

Importable without torch and without a GPU: the core runs on a simulated device.

    import allocator_ext as ae
    dev = ae.SimDevice(capacity=80 << 30)
    alloc = ae.Allocator(dev)                 # allocwatch's defaults
    ptr = alloc.malloc(1 << 20, stream=0)
    alloc.free(ptr)
    alloc.stats()["reserved_bytes.all.current"]
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

__all__ = [
    "DEFAULT_CONFIG",
    "NATIVE_CONFIG",
    "Allocator",
    "OutOfMemoryError",
    "SimDevice",
    "parse_config",
    "round_size",
    "segment_size_for",
]
