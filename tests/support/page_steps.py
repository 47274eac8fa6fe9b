"""Repeated steps as programs on the simulated device: the page policy's tests run one step
many times on one allocator and read, pass by pass, the memory held and the device calls made.
"""

from __future__ import annotations

import allocator_ext as ae

MiB, GiB = 1 << 20, 1 << 30


def calls(dev: ae.SimDevice, name: str) -> int:
    return dev.counters().get(name, {}).get("count", 0)


HOST_WAITS = ("synchronize", "stream_synchronize", "event_synchronize")


def host_waits(dev: ae.SimDevice) -> int:
    """The host-side waits made on the simulated device (device, stream and event)."""
    return sum(calls(dev, name) for name in HOST_WAITS)


# A step as a program: ("x", 40) allocates 40 MiB as x, ("x",) frees x.
Step = list[tuple[str, int] | tuple[str]]

# The 60 MiB request finds its free memory in a 40 MiB block that does not border the growth.
STEP_BESIDE_A_DISTANT_HOLE: Step = [("x", 40), ("y", 40), ("x",), ("z", 60), ("y",), ("z",)]
# Requests of 4 to 80 MiB freed out of order: the take-backs of the first pass leave holes in
# several places where the next pass's 60 MiB requests could grow.
STEP_AMONG_HOLES: Step = [("w", 20), ("x", 80), ("w",), ("y", 30), ("x",), ("z", 4), ("y",),
                          ("u", 60), ("v", 60), ("v",), ("u",), ("z",)]


def run_step(a: ae.Allocator, step: Step) -> None:
    held: dict[str, int] = {}
    for op in step:
        if len(op) == 2:
            held[op[0]] = a.malloc(op[1] * MiB)
        else:
            a.free(held.pop(op[0]))


def looped_step_page_calls(config: str | None, passes: int, fraction: float = 0.0,
                            step: Step = STEP_BESIDE_A_DISTANT_HOLE) -> list[tuple[int, int]]:
    """`step` repeated on one allocator: per pass, peak reserved (MiB) and the device calls
    that map or unmap pages."""
    dev = ae.SimDevice(capacity=GiB)
    a = ae.Allocator(dev, config)
    if fraction:
        a.set_memory_fraction(fraction)
    rows = []
    for _ in range(passes):
        before = sum(calls(dev, k) for k in ("create", "map_only", "unmap"))
        run_step(a, step)
        assert a.check_invariants() == ""
        rows.append((a.stats()["reserved_bytes.all.peak"] // MiB,
                     sum(calls(dev, k) for k in ("create", "map_only", "unmap")) - before))
    assert a.stats()["num_alloc_retries"] == 0
    return rows


MOVING = "settle_page_moves:False"  # take-backs that recur move their pages again every time
