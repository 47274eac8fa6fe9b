"""Agent streams driven by hand, over the real gRPC endpoint: a hello with any identity, any
report, read back what the sidecar answers. For the tests of what a broken or hostile agent
can (and cannot) make the sidecar do."""

from __future__ import annotations

import queue
from collections.abc import Sequence

import grpc

from allocator_ext.agent.identity import build_identity
from allocator_ext.protocol.handshake import local_version
from allocator_ext.protocol.proto.allocwatch.v1 import agent_pb2 as pb
from allocator_ext.protocol.service import CONNECT_METHOD


def hello(identity: pb.Identity | None = None, **overrides: object) -> pb.AgentMessage:
    """A hello speaking this protocol version, for `identity` or a fresh one with overrides."""
    if identity is None:
        identity = build_identity(backend="allocwatch", overrides=overrides)
    return pb.AgentMessage(hello=pb.Hello(protocol_version=local_version(), identity=identity))


def report(sequence: int, devices: Sequence[pb.DeviceReport]) -> pb.AgentMessage:
    return pb.AgentMessage(report=pb.Report(sequence=sequence, devices=list(devices)))


def device(cuda_device: int = 0, gpu_uuid: str = "GPU-hand", reserved: int = 100,
           allocated: int = 50) -> pb.DeviceReport:
    entry = pb.DeviceReport(cuda_device=cuda_device, gpu_uuid=gpu_uuid)
    entry.allocator.all.reserved_bytes = reserved
    entry.allocator.all.allocated_bytes = allocated
    return entry


class Stream:
    """One AgentService.Connect stream: `send` messages, `answer()` the next from the sidecar,
    `error()` how the sidecar ended it."""

    def __init__(self, target: str, metadata: Sequence[tuple[str, str]] = (),
                 credentials: grpc.ChannelCredentials | None = None, timeout: float = 30):
        self._channel = (grpc.secure_channel(target, credentials) if credentials is not None
                         else grpc.insecure_channel(target))
        self._outgoing: queue.Queue[pb.AgentMessage | None] = queue.Queue()
        connect = self._channel.stream_stream(
            CONNECT_METHOD, request_serializer=pb.AgentMessage.SerializeToString,
            response_deserializer=pb.SidecarMessage.FromString)
        self._call = connect(iter(self._outgoing.get, None), metadata=tuple(metadata),
                             timeout=timeout)

    def send(self, *messages: pb.AgentMessage) -> Stream:
        for message in messages:
            self._outgoing.put(message)
        return self

    def answer(self) -> pb.SidecarMessage:
        return next(self._call)

    def error(self) -> grpc.RpcError:
        """Read to the end of the stream; the error that ended it (AssertionError if none)."""
        try:
            for _ in self._call:
                pass
        except grpc.RpcError as err:
            return err
        raise AssertionError("the sidecar ended the stream without an error")

    def close(self) -> None:
        self._outgoing.put(None)
        self._call.cancel()
        self._channel.close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
