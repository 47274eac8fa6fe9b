"""Bad input on the agents' endpoint: each bad stream gets a clear status, everyone else is
served on."""

from __future__ import annotations

import os
import queue
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from support.sidecar import FakeSource, start_sidecar, values
from support.waiting import wait_for

from allocator_ext.agent import start_agent
from allocator_ext.agent.identity import build_identity
from allocator_ext.protocol.handshake import local_version
from allocator_ext.protocol.proto.allocwatch.v1 import agent_pb2 as pb
from allocator_ext.protocol.service import CONNECT_METHOD
from allocator_ext.protocol.version import PROTOCOL_MINOR

pytestmark = pytest.mark.timeout(60)
# Short, so that a stream without a hello ends soon, yet past what a loaded machine may take to
# get the hello of a stream that sends it at once through (this process's threads serve both
# ends): a stream timed out for that would end with DEADLINE_EXCEEDED instead of what is tested.
HELLO_TIMEOUT = 2.0


@pytest.fixture
def served(tmp_path: Path):
    """A sidecar with one well-behaved agent; yields (sidecar, url, target, agent)."""
    running = start_sidecar(tmp_path, hello_timeout=HELLO_TIMEOUT, max_message_bytes=64 * 1024)
    url = running.sidecar.metrics_url
    target = running.sidecar.agent_targets[0]
    agent = start_agent(target, interval=0.05, source=FakeSource(), identity={"rank": 0},
                        nvml=False, stop_at_exit=False)
    wait_for(lambda: values(url, "allocwatch_agents_connected") == [1.0], what="good agent")
    yield running, url, target, agent
    agent.stop()
    running.stop()


def _still_served(url: str, agent) -> None:
    """The good agent's reports keep arriving after the bad input."""
    before = agent.sequence
    wait_for(lambda: agent.sequence > before + 3, what="agent sampling")
    received = values(url, "allocwatch_reports_received_total")[0]
    wait_for(lambda: values(url, "allocwatch_reports_received_total")[0] > received + 2,
             what="reports after the bad input")
    assert values(url, "allocwatch_agents_connected") == [1.0]


def _raw_call(target: str, messages: list[bytes], wait_close: bool = False) -> grpc.RpcError:
    """Send raw bytes as request messages; returns the error that ends the call."""
    with grpc.insecure_channel(target) as channel:
        connect = channel.stream_stream(CONNECT_METHOD, request_serializer=lambda b: b,
                                        response_deserializer=lambda b: b)
        pending: queue.Queue[bytes | None] = queue.Queue()
        for m in messages:
            pending.put(m)
        if not wait_close:
            pending.put(None)

        def requests() -> Iterator[bytes]:
            while (item := pending.get()) is not None:
                yield item

        call = connect(requests(), timeout=10)
        with pytest.raises(grpc.RpcError) as err:
            for _ in call:
                pass
        pending.put(None)
        return err.value


def _hello(**identity: object) -> pb.AgentMessage:
    return pb.AgentMessage(hello=pb.Hello(
        protocol_version=local_version(),
        identity=build_identity(backend="allocwatch", overrides=identity)))


def _stream_error(url: str, reason: str) -> float:
    found = values(url, "allocwatch_stream_errors_total", reason=reason)
    return found[0] if found else 0.0


def test_garbage_on_the_socket_itself(served) -> None:
    running, url, target, agent = served
    path = target.removeprefix("unix://")
    for junk in (b"GET / HTTP/1.1\r\n\r\n", os.urandom(4096), b"\x00" * 100):
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(path)
            s.sendall(junk)
            s.settimeout(5)
            try:
                s.recv(1024)  # the server answers (GOAWAY) or closes: either way it is fine
            except OSError:
                pass
    _still_served(url, agent)


def test_undecodable_message_ends_only_that_stream(served) -> None:
    running, url, target, agent = served
    err = _raw_call(target, [b"\xff\xff\xff\xff not a protobuf"])
    assert err.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT,
                          grpc.StatusCode.UNKNOWN)
    _still_served(url, agent)


def test_oversized_message_is_refused(served) -> None:
    running, url, target, agent = served
    huge = _hello(training_job="x" * (200 * 1024)).SerializeToString()
    err = _raw_call(target, [huge])
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in (err.details() or "")
    _still_served(url, agent)


def test_agent_that_never_says_hello_is_dropped(served) -> None:
    running, url, target, agent = served
    err = _raw_call(target, [], wait_close=True)
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert f"no hello within {HELLO_TIMEOUT:g} s" in err.details()
    assert _stream_error(url, "no_hello") >= 1
    _still_served(url, agent)


def test_report_before_hello_is_refused(served) -> None:
    running, url, target, agent = served
    report = pb.AgentMessage(report=pb.Report(sequence=1)).SerializeToString()
    err = _raw_call(target, [report])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "the first message must be hello, got report"
    _still_served(url, agent)


@pytest.mark.parametrize("overrides, text", [
    ({"pid": 0}, "identity.pid must be a positive process id"),
    ({"instance_id": ""}, "identity.instance_id is empty"),
    ({"host": "h" * 600}, "hello.identity.host is longer than 256 characters"),
])
def test_bad_identity_is_refused(served, overrides, text) -> None:
    running, url, target, agent = served
    err = _raw_call(target, [_hello(**overrides).SerializeToString()])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details() == text
    _still_served(url, agent)


def test_second_hello_and_empty_message_end_the_stream(served) -> None:
    running, url, target, agent = served
    hello = _hello().SerializeToString()
    err = _raw_call(target, [hello, hello])
    assert err.details() == "hello sent twice on one stream"
    err = _raw_call(target, [_hello().SerializeToString(), b""])
    assert err.details() == "empty AgentMessage (no body set)"
    _still_served(url, agent)


def test_out_of_order_report_is_ignored(served) -> None:
    running, url, target, agent = served
    ident = build_identity(backend="allocwatch", overrides={"rank": 7})
    device = pb.DeviceReport(cuda_device=0, gpu_uuid="GPU-ooo")
    device.allocator.all.reserved_bytes = 100
    newer = pb.Report(sequence=5, devices=[device])
    older_device = pb.DeviceReport(cuda_device=0, gpu_uuid="GPU-ooo")
    older_device.allocator.all.reserved_bytes = 1
    older = pb.Report(sequence=4, devices=[older_device])
    outgoing: queue.Queue[pb.AgentMessage | None] = queue.Queue()
    for message in (pb.AgentMessage(hello=pb.Hello(
            protocol_version=local_version(), identity=ident)),
            pb.AgentMessage(report=newer), pb.AgentMessage(report=older)):
        outgoing.put(message)
    with grpc.insecure_channel(target) as channel:
        connect = channel.stream_stream(CONNECT_METHOD,
                                        request_serializer=pb.AgentMessage.SerializeToString,
                                        response_deserializer=pb.SidecarMessage.FromString)
        call = connect(iter(outgoing.get, None))
        assert next(call).HasField("welcome")
        wait_for(lambda: _stream_error(url, "out_of_order_report") >= 1, what="ooo counted")
        assert values(url, "torch_cuda_allocator_reserved_bytes", rank="7") == [100.0]
        outgoing.put(None)
        call.cancel()


@pytest.mark.parametrize("major, minor, accepted", [
    (1, PROTOCOL_MINOR - 1, True), (1, PROTOCOL_MINOR, True), (1, PROTOCOL_MINOR + 1, True),
    (1, PROTOCOL_MINOR + 2, False), (2, PROTOCOL_MINOR, False), (0, 0, False)])
def test_protocol_version_negotiation(served, major, minor, accepted) -> None:
    running, url, target, agent = served
    hello = pb.AgentMessage(hello=pb.Hello(
        protocol_version=pb.ProtocolVersion(major=major, minor=minor),
        identity=build_identity(backend="allocwatch")))
    outgoing: queue.Queue[pb.AgentMessage | None] = queue.Queue()
    outgoing.put(hello)
    with grpc.insecure_channel(target) as channel:
        connect = channel.stream_stream(CONNECT_METHOD,
                                        request_serializer=pb.AgentMessage.SerializeToString,
                                        response_deserializer=pb.SidecarMessage.FromString)
        call = connect(iter(outgoing.get, None), timeout=10)
        if accepted:
            welcome = next(call).welcome
            assert (welcome.protocol_version.major,
                    welcome.protocol_version.minor) == (1, PROTOCOL_MINOR)
            outgoing.put(None)
            call.cancel()
        else:
            with pytest.raises(grpc.RpcError) as err:
                next(call)
            outgoing.put(None)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert (f"agent protocol version {major}.{minor} is not supported: this side "
                    f"speaks 1.{PROTOCOL_MINOR} and accepts 1.{PROTOCOL_MINOR - 1}–"
                    f"1.{PROTOCOL_MINOR + 1}") in err.value.details()
    _still_served(url, agent)


def test_agent_refused_for_its_version_says_so_and_keeps_training_alive(served) -> None:
    running, url, target, agent = served
    old = start_agent(target, interval=0.05, source=FakeSource(), nvml=False,
                      stop_at_exit=False)
    old.stop()
    refused = __import__("allocator_ext.agent.client", fromlist=["Agent"]).Agent(
        target, FakeSource(), build_identity(backend="allocwatch"), interval=0.05,
        snapshot_dir=Path("/nonexistent"), protocol_version=pb.ProtocolVersion(major=3, minor=0))
    refused.start()
    try:
        wait_for(lambda: refused.last_error and "not supported" in refused.last_error,
                 what="the refusal reason")
        assert "FAILED_PRECONDITION" in refused.last_error
        assert "protocol version 3.0" in refused.last_error
        assert not refused.connected.is_set()
    finally:
        refused.stop()
    _still_served(url, agent)


def test_many_bad_clients_at_once(served) -> None:
    running, url, target, agent = served
    errors: list[BaseException] = []

    def bad(i: int) -> None:
        try:
            _raw_call(target, [os.urandom(64 + i)])
        except BaseException as err:  # noqa: BLE001 (collected for the assertion)
            errors.append(err)

    threads = [threading.Thread(target=bad, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    _still_served(url, agent)
