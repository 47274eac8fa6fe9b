"""The allocators a GPU benchmark compares, and the set-up of a process that runs under one.

Each runs in a fresh process, since the allocator is chosen before CUDA starts: the parent
starts a child with `dict(os.environ, **ALLOCATORS[name])`, and the child calls
`setup_in_child()` before anything touches the GPU.
"""

from __future__ import annotations

import os
from typing import Any

ALLOCATORS = {
    "pytorch": {"PYTORCH_CUDA_ALLOC_CONF": ""},
    "expandable": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    "cudaMallocAsync": {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"},
    # install()'s default: the native back end built against this torch (allocator_ext/native/).
    "allocwatch": {"PYTORCH_CUDA_ALLOC_CONF": "", "ALLOCWATCH_BENCH_INSTALL": "1"},
    # allocwatch with a moved page's old place unmapped by the allocator's own thread
    # (unmap_off_thread): the A/B of that setting against the defaults.
    "allocwatch-unmap-off-thread": {"PYTORCH_CUDA_ALLOC_CONF": "", "ALLOCWATCH_BENCH_INSTALL": "1",
                                    "ALLOCWATCH_ALLOC_CONF": "unmap_off_thread:True"},
    # Single 2 MiB pages, large blocks starting at page boundaries where that costs no page
    # (align_to_pages; Note [page policy], alignment): what `allocwatch tune` offers a decoder.
    "allocwatch-single-pages-aligned": {"PYTORCH_CUDA_ALLOC_CONF": "",
                                        "ALLOCWATCH_BENCH_INSTALL": "1",
                                        "ALLOCWATCH_ALLOC_CONF":
                                            "expandable_chunk_mb:2,align_to_pages:True"},
    # allocwatch's defaults with align_to_pages, which acts where growth maps single pages
    # (under a memory fraction, near the device's ceiling): the A/B of that setting.
    "allocwatch-aligned": {"PYTORCH_CUDA_ALLOC_CONF": "", "ALLOCWATCH_BENCH_INSTALL": "1",
                           "ALLOCWATCH_ALLOC_CONF": "align_to_pages:True"},
    # The same core through PyTorch's CUDAPluggableAllocator, install()'s fallback.
    "allocwatch-pluggable": {"PYTORCH_CUDA_ALLOC_CONF": "", "ALLOCWATCH_BENCH_INSTALL": "1",
                             "ALLOCWATCH_NATIVE": "0"},
    # A control: PyTorch's expandable segments serve, with allocwatch's core and native back end
    # loaded into the process but not installed. Against "expandable" it shows what the libraries'
    # presence costs, apart from what the allocator does.
    "expandable-loaded": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                          "ALLOCWATCH_BENCH_LOAD_ONLY": "1"},
}


def setup_in_child() -> Any:
    """Installs allocwatch's allocator where the environment asks (and the agent, with
    ALLOCWATCH_BENCH_AGENT); returns torch."""
    import torch

    installed = False
    if os.environ.get("ALLOCWATCH_BENCH_LOAD_ONLY") == "1":
        import ctypes

        from allocator_ext import _core
        from allocator_ext.native import library

        # Loaded and never installed. The core goes into the process's global scope (the
        # native back end opens it locally): the stricter case, where anything the core
        # exported would be bindable by the libraries loaded after it.
        ctypes.CDLL(_core.__file__, mode=ctypes.RTLD_GLOBAL)
        ctypes.CDLL(str(library()))
    elif os.environ.get("ALLOCWATCH_BENCH_INSTALL") == "1":
        import allocator_ext

        assert allocator_ext.install(), "allocwatch did not install"
        native = os.environ.get("ALLOCWATCH_NATIVE") != "0"
        path = "the native back end" if native else "the pluggable path"
        assert allocator_ext.torch_integration.native() == native, f"{path} did not install"
        installed = True
    target = os.environ.get("ALLOCWATCH_BENCH_AGENT")
    if target:  # the same loop with the agent publishing every second
        from allocator_ext.agent import start_agent

        start_agent(target, interval=1.0, source="allocwatch" if installed else "pytorch")
    return torch


class Counters:
    """The memory statistics of the allocator serving this process on CUDA device `device`:
    `core` where given (a CPU run's simulated device), else allocwatch's core where it is
    installed (reachable through either back end), else PyTorch's."""

    def __init__(self, torch: Any, device: int = 0, core: Any = None) -> None:
        import allocator_ext

        self.torch = torch
        self.device = device
        self.core = core
        self._installed = core is None and allocator_ext.installed()

    def _allocwatch(self) -> Any:
        """allocwatch's core for the device, once PyTorch has made it: a workload with nothing
        on the device before its first step (the stream pipeline) has none when this is built,
        and PyTorch's statistics lack the core's own (its host waits)."""
        if self.core is None and self._installed:
            import allocator_ext

            self.core = allocator_ext.allocator(self.device)
        return self.core

    def stats(self) -> dict[str, int]:
        if self._allocwatch() is not None:
            return dict(self.core.stats())
        if self.torch.cuda.is_available():
            return dict(self.torch.cuda.memory_stats(self.device))
        return {}

    def reset_peak(self) -> None:
        if self._allocwatch() is not None:
            self.core.reset_peak_stats()
        elif self.torch.cuda.is_available():
            self.torch.cuda.reset_peak_memory_stats(self.device)
