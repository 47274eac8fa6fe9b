"""GPU memory figures through NVML (pynvml, from the nvidia-ml-py package).

Used by the sidecar (every GPU it can see) and by the agent (its own GPU). Without NVML — no
driver, no GPU, no library — the reader logs one warning and reports nothing, so no device
series appear. A failure mid-run stops the figures (logged once) instead of raising.

The pynvml module can be injected (tests use a fake one: there is no GPU on the CI machine).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import weakref
from types import ModuleType
from typing import Any

log = logging.getLogger("exporter.nvml")

# No fork lands inside one of our NVML calls: a child would inherit NVML's and pynvml's locks
# held by a thread it does not have, and its own first NVML call (torch counts devices through
# NVML) could wait for them forever. A fork waits for the call under way instead, but never
# longer than FORK_WAIT_SECONDS: an NVML call can hang with its GPU, and the fork (a DataLoader
# starting its workers) must not hang with it.
FORK_WAIT_SECONDS = 5.0
_nvml_calls = threading.Lock()
_held_for_fork = False
_readers: weakref.WeakSet[NvmlReader] = weakref.WeakSet()


def _before_fork() -> None:
    global _held_for_fork
    _held_for_fork = _nvml_calls.acquire(timeout=FORK_WAIT_SECONDS)


def _after_fork_in_parent() -> None:
    if _held_for_fork:
        _nvml_calls.release()


def _after_fork_in_child() -> None:
    global _nvml_calls
    _nvml_calls = threading.Lock()
    for reader in list(_readers):  # a reader's lock, too, may have been held by another thread
        reader._lock = threading.Lock()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)


@dataclasses.dataclass(frozen=True)
class GpuMemory:
    index: int
    uuid: str
    total_bytes: int
    used_bytes: int
    # pid -> bytes used on this GPU, as NVML reports them (host PIDs inside containers).
    process_used_bytes: dict[int, int]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlReader:
    def __init__(self, module: ModuleType | Any | None = None, cache_seconds: float = 1.0):
        self._module = module
        self._cache_seconds = cache_seconds
        self._lock = threading.Lock()
        _readers.add(self)
        self._cached: list[GpuMemory] = []
        self._cached_at = -1e18
        self.available = False
        self.started = False
        self.failure: str | None = None

    def start(self) -> bool:
        """Initialise NVML; False (with a logged warning) where it cannot be used."""
        self.started = True
        try:
            if self._module is None:
                import pynvml

                self._module = pynvml
            with _nvml_calls:
                self._module.nvmlInit()
                count = self._module.nvmlDeviceGetCount()
        except Exception as err:  # ImportError, NVMLError (no driver / no GPU), OSError
            self.failure = f"{type(err).__name__}: {err}"
            log.warning(
                "NVML unavailable, no GPU device series will be exported",
                extra={"reason": self.failure},
            )
            return False
        self.available = True
        log.info("NVML initialised", extra={"gpus": count})
        return True

    def read(self) -> list[GpuMemory]:
        """Every visible GPU's memory (cached for cache_seconds); [] when unavailable."""
        if not self.available:
            return []
        with self._lock:
            now = time.monotonic()
            if now - self._cached_at < self._cache_seconds:
                return self._cached
            try:
                with _nvml_calls:
                    self._cached = self._read_all()
            except Exception as err:
                # Device series stop; allocator series carry on. Logged once per outage.
                if self.failure is None:
                    log.warning("NVML read failed, device series stop", extra={"reason": str(err)})
                self.failure = f"{type(err).__name__}: {err}"
                self._cached = []
            else:
                if self.failure is not None:
                    log.info("NVML readable again")
                self.failure = None
            self._cached_at = now
            return self._cached

    def _read_all(self) -> list[GpuMemory]:
        nvml = self._module
        assert nvml is not None
        gpus = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            processes: dict[int, int] = {}
            try:
                for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    used = proc.usedGpuMemory
                    if used is not None:  # None where the driver hides it (e.g. Windows WDDM)
                        processes[int(proc.pid)] = int(used)
            except Exception as err:  # some drivers refuse the process query; totals still count
                log.debug("NVML process query failed", extra={"reason": str(err)})
            gpus.append(
                GpuMemory(
                    index=index,
                    uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                    total_bytes=int(memory.total),
                    used_bytes=int(memory.used),
                    process_used_bytes=processes,
                )
            )
        return gpus

    def find(self, *, uuid: str = "", index: int | None = None) -> GpuMemory | None:
        for gpu in self.read():
            by_index = not uuid and index is not None and gpu.index == index
            if (uuid and gpu.uuid == uuid) or by_index:
                return gpu
        return None

    def close(self) -> None:
        if self.available and self._module is not None:
            try:
                with _nvml_calls:
                    self._module.nvmlShutdown()
            except Exception:
                pass
        self.available = False
