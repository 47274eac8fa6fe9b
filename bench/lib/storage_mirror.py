"""A CPU training process's tensor storages mirrored into allocwatch's core on the simulated
device: what a caching allocator would be asked for on a GPU, where there is none.

    core = allocator_ext.Allocator(allocator_ext.SimDevice(), "native")
    with StorageMirror(core):
        train()                    # every storage created inside is malloc'ed from `core`
    core.stats()["reserved_bytes.all.peak"]

PyTorch's CPU allocator keeps no statistics (no torch.cpu memory_stats; torch.accelerator's
need an accelerator; the profiler's memory events come only after the run), so a CPU run has no
figures of its own to publish. This one has the process's real requests: each storage an
operator creates (found by a dispatch mode, inside tensor subclasses such as FSDP's DTensor
too) is allocated from the core with its size when it appears and freed when it dies;
FSDP's storage resizes (its way to free and re-gather parameters) free and allocate again.
All on stream 0: the simulated device runs no kernels, so there are no cross-stream frees.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


class StorageMirror(TorchDispatchMode):
    def __init__(self, core: Any) -> None:
        super().__init__()
        self.core = core
        self._lock = threading.Lock()  # finalizers run on whichever thread drops a storage
        self._live: dict[int, int] = {}  # id(storage) -> address in the core
        self._resize: Any = None

    # --- tracking

    def _track(self, tensor: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(tensor):
            names, _ = tensor.__tensor_flatten__()
            for name in names:
                inner = getattr(tensor, name)
                if isinstance(inner, torch.Tensor):
                    self._track(inner)
            return
        if tensor.device.type != "cpu" or tensor.is_meta:
            return
        storage = tensor.untyped_storage()
        key = id(storage)
        with self._lock:
            if key in self._live or storage.nbytes() == 0:
                return
            self._live[key] = self.core.malloc(storage.nbytes())
        weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        with self._lock:
            address = self._live.pop(key, None)
        if address is not None:
            self.core.free(address)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        with self._lock:
            address = self._live.pop(key, None)
            if address is not None:
                self.core.free(address)
            if storage.nbytes() == 0:
                return
            self._live[key] = self.core.malloc(storage.nbytes())
        if address is None:
            weakref.finalize(storage, self._release, key)

    # --- the dispatch mode

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._track(leaf)
        return out

    def __enter__(self) -> StorageMirror:
        # FSDP frees and re-gathers parameters with UntypedStorage.resize_, which is no
        # operator: seen here instead, for as long as the mirror is on.
        original = torch.UntypedStorage.resize_
        mirror = self

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            result = original(storage, size)
            mirror._resized(storage)
            return result

        self._resize = original
        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
