"""The hello's version negotiation: which protocol versions accept each other."""

from __future__ import annotations

from allocator_ext.protocol.proto.allocwatch.v1 import agent_pb2 as pb
from allocator_ext.protocol.version import PROTOCOL_MAJOR, PROTOCOL_MINOR


def local_version() -> pb.ProtocolVersion:
    return pb.ProtocolVersion(major=PROTOCOL_MAJOR, minor=PROTOCOL_MINOR)


def format_version(version: pb.ProtocolVersion) -> str:
    return f"{version.major}.{version.minor}"


def incompatibility(peer: pb.ProtocolVersion, ours: pb.ProtocolVersion | None = None) -> str | None:
    """Why a peer speaking ``peer`` cannot talk to us, or None when it can.

    Peers work together when they share the major version and their minor versions are at most
    one apart: each side keeps reading the fields of the previous minor version.
    """
    ours = ours or local_version()
    if peer.major == ours.major and abs(int(peer.minor) - int(ours.minor)) <= 1:
        return None
    return (
        f"protocol version {format_version(peer)} is not supported: this side speaks "
        f"{format_version(ours)} and accepts {ours.major}.{max(0, ours.minor - 1)}"
        f"–{ours.major}.{ours.minor + 1}"
    )
