"""What a client of the agents' endpoint can make the sidecar hold or build, bounded: health Watch
streams (which never end on their own) are limited, and a connection that carries them but no
agent is closed at the hello deadline; fields the sidecar does not know are never kept; a
command's answer with more device entries than a process has ends the agent's stream, and the
admin API's reply to a command stays small; agents whose series labels coincide cost one count
and one slot each, not one per pair."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.admin import connection
from support.control import metric, start_control_sidecar
from support.sidecar import start_sidecar, values
from support.streams import Stream, device, hello, report
from support.waiting import wait_for

from allocator_ext.agent.identity import build_identity
from allocator_ext.protocol.proto.allocwatch.v1 import agent_pb2 as pb
from exporter.agents.grpc_server import MAX_HEALTH_WATCHES
from exporter.agents.screening import MAX_DEVICES_PER_REPORT
from exporter.shared.registry import Registry

pytestmark = pytest.mark.timeout(120)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _with_unknown_field(message, size: int):
    """`message` carrying a length-delimited field numbered 1000 (unknown) of `size` bytes."""
    unknown = _varint((1000 << 3) | 2) + _varint(size) + b"u" * size
    copy = type(message)()
    copy.ParseFromString(message.SerializeToString() + unknown)
    return copy


def test_health_watch_streams_are_limited_and_end_with_their_connection(tmp_path: Path) -> None:
    running = start_sidecar(tmp_path, nvml=False, hello_timeout=8.0)
    target = running.sidecar.agent_targets[0]
    # Four streams a connection, within its limit (MAX_STREAMS_PER_CONNECTION: a client queues
    # the streams past it); a connection each (gRPC shares one between channels otherwise).
    channels = [grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(MAX_HEALTH_WATCHES)]
    try:
        calls = [health_pb2_grpc.HealthStub(channels[n % len(channels)]).Watch(
                     health_pb2.HealthCheckRequest(service=f"svc-{n}"), timeout=30)
                 for n in range(4 * MAX_HEALTH_WATCHES)]
        watching, refused = 0, 0
        for call in calls:
            try:
                next(call)
                watching += 1
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
                refused += 1
        # Before, every Watch was kept, for as long as its client liked.
        assert watching <= MAX_HEALTH_WATCHES and refused >= 3 * MAX_HEALTH_WATCHES
        assert values(running.sidecar.metrics_url, "allocwatch_refused_total",
                      reason="health_watch_limit") == [float(refused)]
        # A connection with Watch streams and no agent is closed at the hello deadline.
        started = time.monotonic()
        ended = 0
        for call in calls:
            try:
                for _ in call:
                    pass
            except grpc.RpcError:
                ended += 1
        assert ended == len(calls) and time.monotonic() - started < 15
        wait_for(lambda: running.sidecar.agents_endpoint.health.watching == 0, timeout=10,
                 what="the sidecar's end of the Watch streams")
    finally:
        for channel in channels:
            channel.close()
        running.stop()


def test_fields_the_sidecar_does_not_know_are_never_kept(tmp_path: Path) -> None:
    running = start_sidecar(tmp_path, nvml=False)
    try:
        with Stream(running.sidecar.agent_targets[0]) as stream:
            key = stream.send(hello(rank=4)).answer().welcome.agent_key
            entry = _with_unknown_field(device(), 256 << 10)
            sent = _with_unknown_field(pb.Report(sequence=1, devices=[entry]), 256 << 10)
            stream.send(pb.AgentMessage(report=sent))
            stored = None

            def received():
                nonlocal stored
                state = running.sidecar.registry.get(key)
                stored = state.last_report if state is not None else None
                return stored is not None

            deadline = time.monotonic() + 10
            while not received() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert stored is not None
            assert sent.ByteSize() > 512 << 10
            # What is kept is what the sidecar uses: the known fields alone.
            assert stored.ByteSize() < 1024
            assert stored.devices[0].allocator.all.reserved_bytes == 100
    finally:
        running.stop()


def _answer_with(stream: Stream, result: pb.CommandResult) -> None:
    """Answer the next command on `stream` with `result` (its id set)."""
    message = stream.answer()
    while not message.HasField("command"):
        message = stream.answer()
    result.command_id = message.command.id
    stream.send(pb.AgentMessage(command_result=result))


def _settings_command(address: str, out: dict) -> None:
    conn = connection(address, timeout=30)
    conn.request("POST", "/v1/settings", body=json.dumps(
        {"settings": "garbage_collection_threshold:0.7"}).encode(),
        headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    out["status"], out["body"] = response.status, response.read()
    conn.close()


def test_an_answer_with_more_device_entries_than_a_process_has_ends_the_stream(
        tmp_path: Path) -> None:
    running = start_control_sidecar(tmp_path, admin={"command_timeout_seconds": 10})
    (address,) = running.sidecar.admin.addresses()
    try:
        with Stream(running.sidecar.agent_targets[0]) as stream:
            stream.send(hello(rank=2)).answer()
            stream.send(report(1, [device()]))
            time.sleep(0.2)
            out: dict = {}
            caller = threading.Thread(target=_settings_command, args=(address, out))
            caller.start()
            # Empty entries: two bytes each on the wire, a JSON object each in the reply.
            flood = pb.CommandResult(status=pb.CommandResult.OK,
                                     settings_in_force=[pb.DeviceSettings()] * 100_000)
            _answer_with(stream, flood)
            err = stream.error()
            caller.join(30)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "settings_in_force" in err.details()
        assert out["status"] == 200
        answer = json.loads(out["body"])
        assert [r["status"] for r in answer["results"]] == ["disconnected"]
        # Before, the 200 kB answer became a reply of megabytes, built on the event loop.
        assert len(out["body"]) < 4096
    finally:
        running.stop()


def test_the_admin_reply_to_an_answer_at_the_limits_stays_small(tmp_path: Path) -> None:
    running = start_control_sidecar(tmp_path, admin={"command_timeout_seconds": 10})
    (address,) = running.sidecar.admin.addresses()
    try:
        with Stream(running.sidecar.agent_targets[0]) as stream:
            stream.send(hello(rank=2)).answer()
            out: dict = {}
            caller = threading.Thread(target=_settings_command, args=(address, out))
            caller.start()
            # The longest strings the screening lets through, of characters JSON escapes.
            settings = pb.AllocatorSettings(config_string='"' * 8192)
            result = pb.CommandResult(
                status=pb.CommandResult.OK, message="\\" * 8192,
                settings_in_force=[pb.DeviceSettings(cuda_device=n, settings=settings)
                                   for n in range(MAX_DEVICES_PER_REPORT)])
            _answer_with(stream, result)
            caller.join(30)
            wire = result.ByteSize()
        assert out["status"] == 200
        assert json.loads(out["body"])["results"][0]["status"] == "ok"
        assert len(out["body"]) <= 2 * wire + 8192, (len(out["body"]), wire)
    finally:
        running.stop()


def test_agents_with_the_same_labels_cost_one_count_each(
        caplog: pytest.LogCaptureFixture) -> None:
    registry = Registry(expiry_seconds=60, max_agents=2000, max_departed=256,
                        max_series=10_000_000)
    same = pb.Report(sequence=1, devices=[device()])
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="exporter.registry"):
        states = []
        for n in range(1000):
            identity = build_identity(backend="allocwatch", overrides={"pid": 1000 + n})
            state = registry.connect(identity, "1.2", "test")
            registry.record_report(state, same)
            states.append(state)
    took = time.monotonic() - started
    # Each agent after the first is one collision, placed in its own slot.
    assert registry.series_collisions() == 999
    assert sorted(s.series_slot for s in states) == list(range(1, 1001))
    assert sum(len(r.getMessage()) + len(str(r.__dict__)) for r in caplog.records) < 200_000
    assert took < 10


def test_colliding_agents_are_counted_once_through_the_endpoint(tmp_path: Path) -> None:
    running = start_sidecar(tmp_path, nvml=False)
    try:
        streams = []
        for n in range(6):
            stream = Stream(running.sidecar.agent_targets[0])
            stream.send(hello(identity=build_identity(backend="allocwatch",
                                                      overrides={"pid": 500 + n}))).answer()
            stream.send(report(1, [device()]))
            streams.append(stream)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and metric(
                running, "allocwatch_agent_series_collisions_total") < 5:
            time.sleep(0.05)
        assert metric(running, "allocwatch_agent_series_collisions_total") == 5.0
        for stream in streams:
            stream.close()
    finally:
        running.stop()


@pytest.mark.parametrize("field, value", [
    ("host", "node\x1b[2J"), ("training_job", "job\rrow"), ("backend", "a\x07"),
    ("host", "csi\x9b31m")])
def test_a_control_character_in_what_an_agent_sends_ends_its_stream(
        tmp_path: Path, field: str, value: str) -> None:
    running = start_sidecar(tmp_path, nvml=False)
    try:
        with Stream(running.sidecar.agent_targets[0]) as stream:
            err = stream.send(hello(**{field: value})).error()
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"identity.{field} holds a control character" in err.details()
        assert running.sidecar.registry.agents() == []
    finally:
        running.stop()
