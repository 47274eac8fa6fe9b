"""A stand-in for the pynvml module, for the NVML reader of the sidecar and of the agent.

There is no GPU (and no NVML library) on the CI machine, so the GPU itself is faked: this
answers the calls allocator_ext.protocol.nvml.NvmlReader makes, for the GPUs it is given.
"""

from __future__ import annotations

from types import SimpleNamespace


class FakePynvml:
    """Mimics the pynvml calls NvmlReader makes. `fail` makes every call raise (NVML lost)."""

    def __init__(self, gpus: list[tuple[str, int, int, dict[int, int]]]):
        self.gpus = gpus
        self.fail = False

    def _check(self) -> None:
        if self.fail:
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")

    def nvmlInit(self) -> None:  # noqa: N802 (pynvml's names)
        self._check()

    def nvmlShutdown(self) -> None:  # noqa: N802
        pass

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        self._check()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:  # noqa: N802
        self._check()
        return index

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:  # noqa: N802
        self._check()
        _, total, used, _ = self.gpus[handle]
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetUUID(self, handle: int) -> bytes:  # noqa: N802
        return self.gpus[handle][0].encode()  # older pynvml returns bytes

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[SimpleNamespace]:  # noqa: N802
        self._check()
        return [SimpleNamespace(pid=p, usedGpuMemory=u) for p, u in self.gpus[handle][3].items()]
