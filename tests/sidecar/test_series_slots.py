"""Slots of agents whose series labels coincide (exporter.shared.series): placing an agent costs
the same however many agents already show its labels; a departed agent's slot goes to the next
one; an agent that comes back keeps its slot where it is still free; an agent of several devices
takes a slot free in each of its label sets."""

from __future__ import annotations

import sys

from support.streams import device

from allocator_ext.agent.identity import build_identity
from allocator_ext.protocol.proto.allocwatch.v1 import agent_pb2 as pb
from exporter.shared.registry import AgentState, Registry

SAME = pb.Report(sequence=1, devices=[device()])


def _registry() -> Registry:
    return Registry(expiry_seconds=600, max_agents=10_000, max_departed=10_000,
                    max_series=10**9)


def _identity(n: int, **overrides: object) -> pb.Identity:
    return build_identity(backend="allocwatch", overrides={"pid": 1000 + n, **overrides})


def _join(registry: Registry, n: int, *devices: pb.DeviceReport) -> AgentState:
    """Agent `n` of `devices` (one of SAME's when none), its primary device the first."""
    devices = devices or tuple(SAME.devices)
    state = registry.connect(_identity(n, cuda_device=devices[0].cuda_device,
                                       gpu_uuid=devices[0].gpu_uuid), "1.2", "test")
    registry.record_report(state, pb.Report(sequence=1, devices=devices))
    return state


def _calls_to_join(registry: Registry, n: int) -> tuple[int, AgentState]:
    """Python and built-in function calls made while agent `n` connects and its first report
    is stored (what a pass over the agents already there would multiply), and the agent."""
    identity = _identity(n)
    calls = 0

    def profile(frame: object, event: str, arg: object) -> None:
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    sys.setprofile(profile)
    try:
        state = registry.connect(identity, "1.2", "test")
        registry.record_report(state, SAME)
    finally:
        sys.setprofile(None)
    return calls, state


def test_the_thousandth_agent_of_one_label_set_costs_what_the_tenth_does() -> None:
    registry = _registry()
    for n in range(10):
        _join(registry, n)
    # The least of five: a collision's warning goes out now and then (rate-limited), and
    # costs calls of its own.
    early = min(_calls_to_join(registry, 10 + n)[0] for n in range(5))
    for n in range(15, 3000):
        _join(registry, n)
    late = [_calls_to_join(registry, 3000 + n) for n in range(5)]
    assert min(calls for calls, _ in late) == early, (early, [calls for calls, _ in late])
    assert registry.series_collisions() == 3004
    assert late[-1][1].series_slot == 3005


def test_a_departed_agents_slot_goes_to_the_next_and_a_returning_agent_keeps_a_free_one() -> None:
    registry = _registry()
    first, second, third = (_join(registry, n) for n in range(3))
    assert [s.series_slot for s in (first, second, third)] == [1, 2, 3]
    registry.disconnect(second)
    fourth = _join(registry, 3)
    assert fourth.series_slot == 2  # the lowest free
    # The third comes back after its stream broke: its slot is still its own.
    registry.disconnect(third)
    back = registry.connect(third.identity, "1.2", "test")
    registry.record_report(back, pb.Report(sequence=2, devices=[device()]))
    assert back.series_slot == 3
    # The second comes back too late: its slot went to the fourth, so it takes the lowest free.
    back = registry.connect(second.identity, "1.2", "test")
    registry.record_report(back, pb.Report(sequence=2, devices=[device()]))
    assert back.series_slot == 4
    assert registry.series_collisions() == 3  # each agent placed beside a rival, once


def test_an_agent_of_two_devices_takes_a_slot_free_in_both() -> None:
    registry = _registry()
    # Agents of one pod without ranks: one on GPU 0, two on GPU 1.
    on_0 = _join(registry, 0, device(0, "GPU-a"))
    on_1 = [_join(registry, n, device(1, "GPU-b")) for n in (1, 2)]
    assert [on_0.series_slot, *(s.series_slot for s in on_1)] == [1, 1, 2]
    both = _join(registry, 3, device(0, "GPU-a"), device(1, "GPU-b"))
    assert both.series_slot == 3
    # The agent of GPU 0 leaves, and one comes in its place: slot 1 there is free again.
    registry.disconnect(on_0)
    assert _join(registry, 4, device(0, "GPU-a")).series_slot == 1
    assert registry.series_collisions() == 3
