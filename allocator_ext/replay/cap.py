"""The memory cap a replay runs under: what the command line says, else what the recording kept.

A PyTorch snapshot holds neither the per-process memory fraction of its run nor the device's
total memory, yet an out-of-memory error recorded under a fraction recurs only under the same
cap. allocwatch keeps both in the snapshot (trace.RECORDING_KEY): its recorders, its allocator's
snapshots, and the agent's snapshots of PyTorch's allocator. A replay uses them unless told
otherwise:

- the memory fraction: ``--memory-fraction`` if given, else the recorded one, unless
  ``--device-memory`` is given (a fraction of another device's total is not the recorded cap);
- the device: ``--device-memory`` if given, else, with a fraction in force, the recorded device
  total (the fraction is a fraction of it), else none (unlimited).

A trace that holds out-of-memory errors but no cap (PyTorch's own snapshot of a run, taken
by hand when it failed) keeps what its errors say of the device: PyTorch's `oom` event keeps the
device's free memory after the allocator's flush, so what the run could reserve at each error
is its reserved memory then plus that. The least of those is the device such a trace replays on
(``device_memory_from`` INFERRED), so that its errors can recur, as `ctl diagnose` replays an
agent's snapshot; ``--device-memory none`` replays it uncapped. Where the device still had room
for the request's segment, a memory fraction the snapshot does not keep was in force instead:
the trace replays with no cap, and the cap's description says so and what to give.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import allocator_ext._core as ae
from allocator_ext.replay.replayer import recorded_figures
from allocator_ext.replay.sizes import format_size
from allocator_ext.replay.trace import Trace

ARGUMENT = "argument"
RECORDING = "recording"
INFERRED = "recorded out-of-memory errors"


@dataclass(frozen=True)
class ReplayCap:
    device_memory: int              # 0: unlimited
    memory_fraction: float | None
    device_memory_from: str | None  # ARGUMENT, RECORDING, INFERRED or None (no cap)
    memory_fraction_from: str | None
    note: str | None = None  # why the trace's out-of-memory errors cannot recur without a cap

    def sources(self) -> dict[str, Any]:
        return {"device_memory": self.device_memory_from,
                "memory_fraction": self.memory_fraction_from}

    def describe(self) -> str:
        """One line for a report: the cap and where each part came from."""
        device = f"{format_size(self.device_memory)} device (from the {self.device_memory_from})"
        if self.device_memory_from == INFERRED:
            device = (f"{format_size(self.device_memory)} device, what the recorded run could "
                      "reserve at its out-of-memory errors (reserved plus the device's free "
                      "memory at each; --device-memory none for no cap)")
        if self.memory_fraction is None:
            return device if self.device_memory else "none" + (f": {self.note}"
                                                                if self.note else "")
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
                         fraction_from, None if device_memory or fraction is not None
                         else _uncapped_ooms_note(trace, memory_at_recorded_ooms(trace)))
    if fraction is not None and limits.device_total_bytes:
        return ReplayCap(limits.device_total_bytes, fraction, RECORDING, fraction_from)
    if fraction is not None:
        return ReplayCap(0, fraction, None, fraction_from)
    at_errors = memory_at_recorded_ooms(trace)
    if at_errors is not None:
        return ReplayCap(at_errors, None, INFERRED, None)
    return ReplayCap(0, None, None, None, _uncapped_ooms_note(trace, at_errors))


def memory_at_recorded_ooms(trace: Trace) -> int | None:
    """What the recorded run could reserve at its out-of-memory errors: at each, its reserved
    memory (after the allocator's flush) plus the device's free memory then; the least of them.
    None where the trace holds no error, or where the device still had room for the failed
    request's segment at one (a memory fraction failed it, not the device)."""
    # The trace reader keeps an oom event's device_free where other events have an address.
    ooms = [e for e in trace.events if e.action == "oom"]
    if not ooms or any(ae.segment_size_for(e.size) <= e.addr for e in ooms):
        return None
    reserved = recorded_figures(trace).reserved_at_ooms
    return min(r + e.addr for r, e in zip(reserved, ooms, strict=True))


def _uncapped_ooms_note(trace: Trace, at_errors: int | None) -> str | None:
    """Why `trace`'s errors cannot recur uncapped, and what to give; `at_errors`:
    memory_at_recorded_ooms(trace)."""
    ooms = recorded_figures(trace).num_ooms
    if not ooms:
        return None
    held = (f"the trace holds {ooms} out-of-memory error(s) but keeps no cap, and without one "
            "none can recur")
    if at_errors is None:
        return (f"{held}; the device had room for a failed request, so a memory fraction was in "
                "force: give it with --memory-fraction and the device's total with "
                "--device-memory")
    return f"{held} (without --device-memory none, the replay runs on the device they imply)"
