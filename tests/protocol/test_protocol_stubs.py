"""The checked-in Python stubs match protos/ (a test fails when someone forgets to regenerate)."""

from __future__ import annotations

import filecmp
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2
from support.paths import REPO

from allocator_ext.protocol.proto.allocwatch.v1 import agent_pb2

STUBS = REPO / "allocator_ext" / "protocol" / "proto"
PROTO = REPO / "protos" / "allocwatch" / "v1" / "agent.proto"


def test_stubs_are_byte_identical_to_a_fresh_generation(tmp_path: Path) -> None:
    # generate.sh uses the pinned generator (installing it under build/ when absent).
    if shutil.which("bash") is None:
        pytest.skip("bash is needed to run protos/generate.sh")
    run = subprocess.run(["bash", str(REPO / "protos" / "generate.sh"), str(tmp_path)],
                         capture_output=True, text=True, timeout=240,
                         env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert run.returncode == 0, run.stderr
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file()
                   and "__pycache__" not in p.parts)
    checked_in = sorted(p.relative_to(STUBS) for p in STUBS.rglob("*") if p.is_file()
                        and "__pycache__" not in p.parts)
    assert fresh == checked_in, "allocator_ext/protocol/proto/ files differ: run protos/generate.sh"
    stale = [str(p) for p in fresh if not filecmp.cmp(tmp_path / p, STUBS / p, shallow=False)]
    assert not stale, f"stale stubs {stale}: run protos/generate.sh and commit the result"


def _normalised(file: descriptor_pb2.FileDescriptorProto) -> descriptor_pb2.FileDescriptorProto:
    # Descriptor sets carry json_name, which the embedded descriptor leaves out.
    def clean(message: descriptor_pb2.DescriptorProto) -> None:
        for field in message.field:
            field.ClearField("json_name")
        for nested in message.nested_type:
            clean(nested)

    for message in file.message_type:
        clean(message)
    return file


def test_stub_descriptor_matches_the_proto_file(tmp_path: Path) -> None:
    # Independent of the generator's version: compile the .proto with whatever grpc_tools is
    # installed and compare the schema itself.
    grpc_tools = pytest.importorskip("grpc_tools.protoc", reason="grpcio-tools not installed")
    out = tmp_path / "set.pb"
    code = grpc_tools.main(["protoc", f"-I{REPO / 'protos'}", f"--descriptor_set_out={out}",
                            "allocwatch/v1/agent.proto"])
    assert code == 0
    compiled = _normalised(descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0])
    embedded = _normalised(
        descriptor_pb2.FileDescriptorProto.FromString(agent_pb2.DESCRIPTOR.serialized_pb))
    assert len(embedded.message_type) > 10
    assert compiled == embedded, "allocator_ext/protocol/proto/ is stale: run protos/generate.sh"


def test_the_stubs_need_no_newer_protobuf_than_pyproject_allows() -> None:
    # Code from protoc >= 5.27 refuses older runtimes; ours must load under protobuf 5.26.
    text = (STUBS / "allocwatch" / "v1" / "agent_pb2.py").read_text()
    assert "ValidateProtobufRuntimeVersion" not in text
    assert "# Protobuf Python Version: 5.26" in text
