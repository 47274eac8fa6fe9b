"""Where the agent's figures come from, behind one small interface.

- AllocatorSource: allocwatch's own allocator (allocator_ext.Allocator objects, one per device).
- TorchSource: PyTorch's own allocator, through torch.cuda.memory_stats(device) for every device
  the process uses. torch is imported here only, and only when this source is used.

Commands (set_config, reclaim, reset_peaks, snapshot, record_history) go through the same
interface.

Two figures only some sources have are optional methods, not part of Source (the agent asks
with getattr): `interval_peaks(device)`, the allocated and reserved bytes at their highest
since the previous call, without resetting the process's own peaks; and
`largest_free_block(device)`, the largest cached free block in bytes.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from allocator_ext.agent import convert
from allocator_ext.protocol.proto.allocwatch.v1 import agent_pb2 as pb
from allocator_ext.protocol.snapshots import RECORDING_KEY

log = logging.getLogger("allocator_ext.agent")


class UnsupportedCommand(Exception):
    """The source cannot carry out this command; nothing changed."""


class CommandRefusedNow(Exception):
    """The command cannot be carried out at this moment (it would harm the training process);
    nothing changed, and it may be sent again later."""


@runtime_checkable
class Source(Protocol):
    backend: str  # "allocwatch" | "pytorch"

    def devices(self) -> list[int]:
        """CUDA device indices the process uses now."""

    def memory_stats(self, device: int) -> Mapping[str, Any]:
        """torch.cuda.memory_stats()-style keys."""

    def settings(self, device: int) -> pb.AllocatorSettings: ...

    def set_config(self, settings: str) -> None:
        """Change only the named keys; ValueError (naming the key) and nothing changes."""

    def reclaim(self, device: int, empty_cache: bool) -> int:
        """Release cached memory; bytes released."""

    def reset_peaks(self, device: int) -> None: ...

    def snapshot(self, device: int) -> dict[str, Any]:
        """torch.cuda.memory._snapshot() layout."""

    def versions(self) -> tuple[str, str]:
        """(torch version, CUDA version), '' where unknown."""

    # Optional, so that sources written before it keep working (the command then answers
    # UNSUPPORTED): record_history(device, enabled, max_entries), memory history (a snapshot's
    # device_traces) on or off.

    def gpu_uuid(self, device: int) -> str: ...


class AllocatorSource:
    """allocwatch's allocator: `allocators` maps CUDA device index -> allocator_ext.Allocator."""

    backend = "allocwatch"

    def __init__(self, allocators: Any | Mapping[int, Any],
                 gpu_uuids: Mapping[int, str] | None = None):
        if not isinstance(allocators, Mapping):
            allocators = {0: allocators}
        self._allocators: dict[int, Any] = dict(allocators)
        self._uuids = dict(gpu_uuids or {})

    def _allocator(self, device: int) -> Any:
        try:
            return self._allocators[device]
        except KeyError:
            raise ValueError(f"this process has no allocwatch allocator on CUDA device {device}; "
                             f"it has {sorted(self._allocators)}") from None

    def devices(self) -> list[int]:
        return sorted(self._allocators)

    def memory_stats(self, device: int) -> Mapping[str, Any]:
        return self._allocator(device).stats()

    def settings(self, device: int) -> pb.AllocatorSettings:
        allocator = self._allocator(device)
        text = allocator.config_string()
        config = allocator.config()
        return convert.allocator_settings(config, text)

    def set_config(self, settings: str) -> None:
        # Validate against every allocator before changing any: all or nothing.
        allocators = list(self._allocators.values())
        if not allocators:
            raise UnsupportedCommand("no allocator to configure")
        previous = [a.config_string() for a in allocators]
        try:
            for allocator in allocators:
                allocator.set_config(settings)
        except ValueError:
            for allocator, old in zip(allocators, previous, strict=True):
                try:
                    allocator.set_config(old)
                except ValueError:
                    log.exception("could not restore allocator settings %r", old)
            raise

    def reclaim(self, device: int, empty_cache: bool) -> int:
        allocator = self._allocator(device)
        if allocator.capture_underway:
            raise CommandRefusedNow(
                f"a CUDA graph is being captured on cuda:{device}: releasing memory would "
                "invalidate it, so nothing was released; send the reclaim again later")
        return int(allocator.empty_cache() if empty_cache else allocator.garbage_collect())

    def reset_peaks(self, device: int) -> None:
        self._allocator(device).reset_peak_stats()

    def interval_peaks(self, device: int) -> tuple[int, int]:
        """(allocated, reserved) bytes at their highest since the previous call: the core keeps
        these apart from its '.peak' statistics, which stay the user's."""
        peaks = self._allocator(device).take_interval_peaks()
        return int(peaks["allocated_bytes"]), int(peaks["reserved_bytes"])

    def largest_free_block(self, device: int) -> int:
        return int(self._allocator(device).largest_free_block())

    def snapshot(self, device: int) -> dict[str, Any]:
        return dict(self._allocator(device).snapshot())

    def record_history(self, device: int, enabled: bool, max_entries: int) -> None:
        # The core's trace ring buffer. Where the native back end serves torch, PyTorch's own
        # _record_memory_history reaches the same buffer.
        self._allocator(device).record_history(enabled, max_entries)

    def versions(self) -> tuple[str, str]:
        torch = sys.modules.get("torch")  # never imported by us for this source
        if torch is None:
            return "", ""
        return str(getattr(torch, "__version__", "")), str(getattr(torch.version, "cuda", "") or "")

    def gpu_uuid(self, device: int) -> str:
        return self._uuids.get(device, "")


class TorchSource:
    """PyTorch's own caching allocator.

    Only devices with CUDA initialised and memory reserved at some point are reported, so the
    agent never creates a CUDA context (which costs device memory) on a device the job ignores.
    """

    backend = "pytorch"

    def __init__(self, torch_module: Any | None = None):
        if torch_module is None:
            import torch

            torch_module = torch
        self._torch = torch_module
        # PyTorch resets every key it is not given: keep the whole settings string here and send
        # it in full on each change.
        initial = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        self._settings = convert.parse_settings_string(initial)

    def devices(self) -> list[int]:
        cuda = self._torch.cuda
        if not cuda.is_initialized():
            return []
        used = []
        for device in range(cuda.device_count()):
            stats = cuda.memory_stats(device)
            if stats.get("reserved_bytes.all.peak", 0) > 0 or device == cuda.current_device():
                used.append(device)
        return used

    def memory_stats(self, device: int) -> Mapping[str, Any]:
        return self._torch.cuda.memory_stats(device)

    def settings(self, device: int) -> pb.AllocatorSettings:
        return convert.allocator_settings(self._settings, convert.format_settings(self._settings))

    def set_config(self, settings: str) -> None:
        merged = dict(self._settings)
        merged.update(convert.parse_settings_string(settings))
        text = convert.format_settings(merged)
        # torch >= 2.9 moved the setter to the accelerator API and deprecated the CUDA one.
        setter = getattr(getattr(self._torch, "_C", None), "_accelerator_setAllocatorSettings",
                         None) or getattr(self._torch.cuda.memory, "_set_allocator_settings", None)
        if setter is None:
            raise UnsupportedCommand("this torch cannot change allocator settings at run time")
        try:
            setter(text)
        except RuntimeError as err:  # PyTorch's parser rejects before applying anything
            raise ValueError(str(err)) from None
        self._settings = merged

    def reclaim(self, device: int, empty_cache: bool) -> int:
        # PyTorch has no reclaim-to-threshold call: both modes release every unused cached block.
        cuda = self._torch.cuda
        before = cuda.memory_reserved(device)
        with cuda.device(device):
            cuda.empty_cache()
        return max(0, int(before - cuda.memory_reserved(device)))

    def reset_peaks(self, device: int) -> None:
        self._torch.cuda.reset_peak_memory_stats(device)

    def snapshot(self, device: int) -> dict[str, Any]:
        snapshot = dict(self._torch.cuda.memory._snapshot())
        snapshot[RECORDING_KEY] = self.recorded_limits(device)
        return snapshot

    def recorded_limits(self, device: int) -> dict[str, Any]:
        """The memory fraction in force and the device total it is a fraction of, which
        PyTorch's snapshot does not keep and a replay needs for an out-of-memory error to
        recur (allocator_ext.replay.cap); None for what this torch cannot say. PyTorch reports
        1.0 where no fraction is set, else its limit over the total; the fraction kept gives
        that limit back to the byte, as a replay computes it."""
        cuda = self._torch.cuda
        limits: dict[str, Any] = {"memory_fraction": None, "device_total_bytes": None}
        try:
            total = int(cuda.get_device_properties(device).total_memory)
        except Exception:
            return limits
        limits["device_total_bytes"] = total
        getter = getattr(cuda, "get_per_process_memory_fraction", None)
        try:
            fraction = float(getter(device)) if getter is not None else 1.0
        except Exception:
            return limits
        if 0 < fraction < 1:
            from allocator_ext._core import fraction_for_limit

            limits["memory_fraction"] = fraction_for_limit(round(fraction * total), total)
        return limits

    def record_history(self, device: int, enabled: bool, max_entries: int) -> None:
        # "all": allocations with their Python and C++ stacks, and the trace's every action.
        self._torch.cuda.memory._record_memory_history(
            "all" if enabled else None, max_entries=max_entries, device=device)

    def versions(self) -> tuple[str, str]:
        return str(self._torch.__version__), str(self._torch.version.cuda or "")

    def gpu_uuid(self, device: int) -> str:
        try:
            uuid = str(self._torch.cuda.get_device_properties(device).uuid)
        except Exception:
            return ""
        return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
