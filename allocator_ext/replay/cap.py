"""The memory cap a replay runs under: what the command line says, else what the recording kept.

A PyTorch snapshot holds neither the per-process memory fraction of its run nor the device's
total memory, yet an out-of-memory error recorded under a fraction recurs only under the same
cap. allocwatch's recorders keep both in the snapshot (trace.RECORDING_KEY); a replay uses them
unless told otherwise:

- the memory fraction: ``--memory-fraction`` if given, else the recorded one, unless
  ``--device-memory`` is given (a fraction of another device's total is not the recorded cap);
- the device: ``--device-memory`` if given, else, with a fraction in force, the recorded device
  total (the fraction is a fraction of it), else none (unlimited).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from allocator_ext.replay.sizes import format_size
from allocator_ext.replay.trace import Trace

ARGUMENT = "argument"
RECORDING = "recording"


@dataclass(frozen=True)
class ReplayCap:
    device_memory: int              # 0: unlimited
    memory_fraction: float | None
    device_memory_from: str | None  # ARGUMENT, RECORDING or None (no cap)
    memory_fraction_from: str | None

    def sources(self) -> dict[str, Any]:
        return {"device_memory": self.device_memory_from,
                "memory_fraction": self.memory_fraction_from}

    def describe(self) -> str:
        """One line for a report: the cap and where each part came from."""
        device = f"{format_size(self.device_memory)} device (from the {self.device_memory_from})"
        if self.memory_fraction is None:
            return device if self.device_memory else "none"
        fraction = (f"memory fraction {self.memory_fraction:g} (from the "
                    f"{self.memory_fraction_from})")
        if not self.device_memory:
            return fraction
        allowed = format_size(int(self.memory_fraction * self.device_memory))
        return f"{allowed} allowed: {fraction} of a {device}"


def resolve_cap(trace: Trace, device_memory: int | None = None,
                memory_fraction: float | None = None) -> ReplayCap:
    """The cap for replaying `trace`: the arguments given (None: not given), then the
    recording's limits, as the module's docstring says."""
    limits = trace.limits
    fraction, fraction_from = memory_fraction, ARGUMENT if memory_fraction is not None else None
    if fraction is None and device_memory is None and limits.memory_fraction is not None:
        fraction, fraction_from = limits.memory_fraction, RECORDING
    if device_memory is not None:
        return ReplayCap(device_memory, fraction, ARGUMENT if device_memory else None,
                         fraction_from)
    if fraction is not None and limits.device_total_bytes:
        return ReplayCap(limits.device_total_bytes, fraction, RECORDING, fraction_from)
    return ReplayCap(0, fraction, None, fraction_from)
