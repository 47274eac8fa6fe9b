"""What agents can make the sidecar hold and serve is bounded: the length of every string from
the wire, the devices of one agent, the departed agents kept, the series exposed. Past a
bound, the stream is refused or the oldest departed agent goes, and each refusal or drop is
counted; the agents within the bounds are served as before."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import grpc
import pytest
from support.sidecar import samples, sidecar_config, start_sidecar, values
from support.streams import Stream, device, hello, report
from support.waiting import wait_for

from exporter.sidecar.app import SidecarThread

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def served(tmp_path: Path):
    running = start_sidecar(tmp_path, nvml=False)
    yield running, running.sidecar.metrics_url, running.sidecar.agent_targets[0]
    running.stop()


def _refused(target: str, *messages) -> grpc.RpcError:
    with Stream(target) as stream:
        return stream.send(*messages).error()


def test_a_long_string_in_a_report_ends_the_stream_and_is_never_served(served) -> None:
    running, url, target = served
    err = _refused(target, hello(rank=3), report(1, [device(gpu_uuid="G" * 15_000)]))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "report.devices[0].gpu_uuid is longer than 256 characters"
    assert values(url, "torch_cuda_allocator_reserved_bytes", rank="3") == []
    assert values(url, "allocwatch_stream_errors_total", reason="bad_report") == [1.0]


@pytest.mark.parametrize("field, length", [("host", 300), ("gpu_uuid", 257),
                                           ("training_job", 10_000)])
def test_a_long_string_in_a_hello_is_refused(served, field: str, length: int) -> None:
    running, url, target = served
    err = _refused(target, hello(**{field: "x" * length}))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == f"hello.identity.{field} is longer than 256 characters"


def test_a_long_string_in_a_command_result_ends_the_stream(served) -> None:
    running, url, target = served
    from allocator_ext.protocol.proto.allocwatch.v1 import agent_pb2 as pb

    result = pb.AgentMessage(command_result=pb.CommandResult(command_id=1,
                                                             snapshot_path="/" * 5000))
    err = _refused(target, hello(), result)
    assert err.details() == "command_result.snapshot_path is longer than 4096 characters"


def test_more_devices_than_one_process_has_end_the_stream(served) -> None:
    running, url, target = served
    devices = [device(cuda_device=i, gpu_uuid=f"GPU-{i}") for i in range(17)]
    err = _refused(target, hello(rank=4), report(1, devices))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "a report has 17 devices, more than 16"
    assert values(url, "torch_cuda_allocator_reserved_bytes", rank="4") == []
    with Stream(target) as stream:  # sixteen are served
        stream.send(hello(rank=5), report(1, devices[:16]))
        wait_for(lambda: len(values(url, "torch_cuda_allocator_reserved_bytes",
                                    rank="5")) == 16, what="16 devices")


@pytest.mark.timeout(120)
def test_departed_agents_are_kept_within_a_bound_the_oldest_dropped_first(
        tmp_path: Path) -> None:
    kept = 16  # a small bound: few streams to pass it (each cycle is a stream of its own)
    config = sidecar_config(tmp_path, nvml=False, expiry=3600)  # none expires meanwhile
    config = dataclasses.replace(config, agents=dataclasses.replace(
        config.agents, max_departed_agents=kept))
    running = SidecarThread(config).start()
    url, target = running.sidecar.metrics_url, running.sidecar.agent_targets[0]
    registry = running.sidecar.registry
    cycles = kept + 44
    try:
        for rank in range(cycles):  # connect, report, leave
            with Stream(target) as stream:
                assert stream.send(hello(rank=rank)).answer().HasField("welcome")
                stream.send(report(1, [device(gpu_uuid=f"GPU-{rank}")]))
                wait_for(lambda rank=rank: any(a.identity.rank == rank
                                               and a.last_report is not None
                                               for a in registry.agents()),
                         what=f"rank {rank}'s report")
            wait_for(lambda: not any(a.connected for a in registry.agents()), what="departure")
        departed = sorted(a.identity.rank for a in registry.agents())
        assert departed == list(range(cycles - kept, cycles))  # the newest stay
        assert values(url, "allocwatch_departed_agents_dropped_total") == [44.0]
        assert len(values(url, "torch_cuda_allocator_reserved_bytes")) == kept
    finally:
        running.stop()


def test_past_the_series_bound_departed_agents_go_first_then_new_agents_are_refused(
        tmp_path: Path) -> None:
    from exporter.shared.registry import SERIES_PER_AGENT, SERIES_PER_DEVICE

    one, two = SERIES_PER_AGENT + SERIES_PER_DEVICE, SERIES_PER_AGENT + 2 * SERIES_PER_DEVICE
    config = sidecar_config(tmp_path, nvml=False)
    bound = 2 * two + one + 5  # two agents of two devices and one of one fit, no more
    config = dataclasses.replace(config, agents=dataclasses.replace(config.agents,
                                                                    max_series=bound))
    running = SidecarThread(config).start()
    url, target = running.sidecar.metrics_url, running.sidecar.agent_targets[0]
    registry = running.sidecar.registry
    two_devices = [device(0, "GPU-a"), device(1, "GPU-b")]
    try:
        for rank in (0, 1):  # two agents come and go: departed, their series kept
            with Stream(target) as stream:
                stream.send(hello(rank=rank), report(1, two_devices))
                wait_for(lambda rank=rank: len(values(
                    url, "torch_cuda_allocator_reserved_bytes", rank=str(rank))) == 2,
                    what=f"rank {rank}")
        wait_for(lambda: not any(a.connected for a in registry.agents()), what="departures")
        live = [Stream(target) for _ in range(3)]
        live[0].send(hello(rank=2), report(1, two_devices))  # room made: rank 0 goes
        wait_for(lambda: len(values(url, "torch_cuda_allocator_reserved_bytes",
                                    rank="2")) == 2, what="rank 2")
        assert sorted(a.identity.rank for a in registry.agents()) == [1, 2]
        assert values(url, "allocwatch_series_dropped_total") == [float(two)]
        live[1].send(hello(rank=3), report(1, two_devices))  # rank 1 goes
        wait_for(lambda: len(values(url, "torch_cuda_allocator_reserved_bytes",
                                    rank="3")) == 2, what="rank 3")
        assert sorted(a.identity.rank for a in registry.agents()) == [2, 3]
        live[2].send(hello(rank=4), report(1, [device(0, "GPU-c")]))
        wait_for(lambda: values(url, "torch_cuda_allocator_reserved_bytes", rank="4"),
                 what="rank 4")
        with Stream(target) as refused:  # nothing departed is left to make room
            err = refused.send(hello(rank=5)).error()
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "agents.max_series" in err.details()
        assert values(url, "allocwatch_agents_refused_total", reason="series_limit") == [1.0]
        assert sorted(a.identity.rank for a in registry.agents()) == [2, 3, 4]
        assert registry.series_count() <= bound
        for stream in live:
            stream.close()
    finally:
        running.stop()


def _full_device(cuda_device: int, gpu_uuid: str):
    """A device with every figure a report can carry, the optional ones included."""
    entry = device(cuda_device, gpu_uuid)
    entry.allocator.largest_free_block_bytes = 1 << 20
    entry.device_memory.total_bytes, entry.device_memory.used_bytes = 80 << 30, 1 << 30
    entry.device_memory.has_process_used_bytes = True
    entry.device_memory.process_used_bytes = 1 << 30
    return entry


def test_the_series_bound_is_what_a_device_and_an_agent_show(served) -> None:
    # SERIES_PER_DEVICE and SERIES_PER_AGENT are counted from the metric table: a real scrape
    # shows exactly that many (the GPU's series by gpu_uuid, the rest by the agent's rank).
    from exporter.shared.registry import SERIES_PER_AGENT, SERIES_PER_DEVICE

    running, url, target = served

    def shown() -> int:
        return sum(1 for (_, labels), _ in samples(url).items()
                   if dict(labels).get("rank") == "7"
                   or dict(labels).get("gpu_uuid", "").startswith("GPU-bound"))

    with Stream(target) as stream:
        stream.send(hello(rank=7), report(1, [_full_device(0, "GPU-bound-0")]))
        wait_for(lambda: values(url, "torch_cuda_allocator_largest_free_block_bytes", rank="7"),
                 what="the first report")
        assert shown() == SERIES_PER_AGENT + SERIES_PER_DEVICE
        stream.send(report(2, [_full_device(0, "GPU-bound-0"), _full_device(1, "GPU-bound-1")]))
        wait_for(lambda: len(values(url, "torch_cuda_allocator_reserved_bytes", rank="7")) == 2,
                 what="the second device")
        assert shown() == SERIES_PER_AGENT + 2 * SERIES_PER_DEVICE
