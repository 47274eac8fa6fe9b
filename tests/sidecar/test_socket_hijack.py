"""The sockets' directory against another user of the pod. The sidecar keeps its sockets in a
directory only its user can write (moving aside one another user made first, refusing to start
where none can be made safe); an agent talks only to a socket in such a directory, owned by the
sidecar's user and listened on by a process of that user (SO_PEERCRED), so an impostor's socket
in a shared directory gets no hello and sets nothing; and the sidecar admits on its socket only
the users agents.allowed_uids names (SO_PEERCRED again)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import grpc
import pytest
from support.sidecar import FakeSource, sidecar_config, values
from support.waiting import wait_for

from allocator_ext.agent import start_agent
from allocator_ext.protocol.handshake import local_version
from allocator_ext.protocol.proto.allocwatch.v1 import agent_pb2 as pb
from allocator_ext.protocol.service import SERVICE_NAME
from exporter.agents.config import AgentsConfig
from exporter.sidecar.app import SidecarThread
from exporter.sidecar.config import parse_config

pytestmark = pytest.mark.timeout(90)
NOBODY = 65534


def _needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("acting as another user of the pod needs root")


class Impostor:
    """A gRPC server posing as the sidecar: it welcomes any agent and sends it the settings
    the issue's attacker applied; it notes every hello and every result it gets."""

    def __init__(self, path: Path):
        self.hellos: list[pb.Hello] = []
        self.results: list[pb.CommandResult] = []
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(4))
        handler = grpc.stream_stream_rpc_method_handler(
            self._connect, request_deserializer=pb.AgentMessage.FromString,
            response_serializer=pb.SidecarMessage.SerializeToString)
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, {"Connect": handler}),))
        self.server.add_insecure_port(f"unix://{path}")
        self.server.start()

    def _connect(self, requests, context):
        first = next(requests)
        self.hellos.append(first.hello)
        yield pb.SidecarMessage(welcome=pb.Welcome(protocol_version=local_version(),
                                                   agent_key="impostor"))
        yield pb.SidecarMessage(command=pb.Command(id=1, cuda_device=-1, set_config=pb.SetConfig(
            settings="garbage_collection_threshold:0.01,max_split_size_mb:20")))
        for message in requests:
            if message.HasField("command_result"):
                self.results.append(message.command_result)

    def stop(self) -> None:
        self.server.stop(0)


def test_an_impostors_socket_in_a_shared_directory_gets_no_hello_and_sets_nothing(
        tmp_path: Path) -> None:
    shared = tmp_path / "emptydir"
    shared.mkdir()
    shared.chmod(0o777)  # a Kubernetes emptyDir: anyone may replace what is there
    impostor = Impostor(shared / "agent.sock")
    source = FakeSource()
    agent = start_agent(f"unix://{shared / 'agent.sock'}", interval=0.05, source=source,
                        nvml=False, stop_at_exit=False, connect_at_start=True)
    try:
        wait_for(lambda: agent.last_error is not None, timeout=10, what="the agent's refusal")
        time.sleep(0.5)
        assert "writable by other users" in agent.last_error
        assert impostor.hellos == [] and impostor.results == []
        assert not any(call[0] == "set_config" for call in source.calls)
    finally:
        agent.stop()
        impostor.stop()


def test_a_listener_of_another_user_is_not_the_sidecar(tmp_path: Path) -> None:
    """Where the expected user is known (ALLOCWATCH_SIDECAR_UID, as the manifests set it), a
    socket of another user, in a directory of its own, is refused too."""
    directory = tmp_path / "sidecar"
    directory.mkdir(mode=0o755)
    impostor = Impostor(directory / "agent.sock")
    agent = start_agent(f"unix://{directory / 'agent.sock'}", interval=0.05, source=FakeSource(),
                        nvml=False, stop_at_exit=False, connect_at_start=True,
                        sidecar_uid=NOBODY)
    try:
        wait_for(lambda: agent.last_error is not None, timeout=10, what="the agent's refusal")
        assert f"not to the sidecar's user (uid {NOBODY})" in agent.last_error
        assert impostor.hellos == []
    finally:
        agent.stop()
        impostor.stop()


def test_the_sidecar_makes_its_socket_directory_its_own(tmp_path: Path) -> None:
    config = sidecar_config(tmp_path, nvml=False)
    directory = tmp_path / "run"
    if os.geteuid() == 0:  # another user's directory there first: moved aside
        directory.mkdir()
        os.chown(directory, NOBODY, NOBODY)
        (directory / "agent.sock").touch()
    with SidecarThread(config) as running:
        info = directory.lstat()
        assert info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) == 0o750
        assert stat.S_ISSOCK((directory / "agent.sock").lstat().st_mode)
        if os.geteuid() == 0:
            [aside] = tmp_path.glob("run.untrusted-*")
            assert aside.lstat().st_uid == NOBODY
        agent = start_agent(running.sidecar.agent_targets[0], interval=0.05,
                            source=FakeSource(), nvml=False, stop_at_exit=False)
        try:
            wait_for(lambda: values(running.sidecar.metrics_url, "allocwatch_agents_connected")
                     == [1.0], timeout=15, what="the agent, on the sidecar's own socket")
        finally:
            agent.stop()


def test_a_socket_directory_others_can_write_is_refused_at_start(tmp_path: Path) -> None:
    shared = tmp_path / "emptydir"
    shared.mkdir()
    shared.chmod(0o777)
    config = sidecar_config(tmp_path, nvml=False)
    config = dataclasses.replace(config, agents=AgentsConfig(
        unix_socket=str(shared / "agent.sock")))
    thread = SidecarThread(config)
    with pytest.raises(Exception, match="writable by other users") as refused:
        thread.start()
    assert str(shared / "sidecar" / "agent.sock") in str(refused.value)
    assert not (shared / "agent.sock").exists()


def test_a_user_agents_allowed_uids_does_not_name_is_refused_on_the_socket(
        tmp_path: Path) -> None:
    _needs_root()
    # Not pytest's tmp_path: it lies under a directory only root may enter.
    pod = Path(tempfile.mkdtemp(prefix="allocwatch-pod-", dir="/tmp"))
    pod.chmod(0o755)
    parsed = parse_config({"agents": {"unix_socket": str(pod / "run" / "agent.sock"),
                                      "socket_mode": "0666", "allowed_uids": [0]}})
    config = dataclasses.replace(sidecar_config(tmp_path, nvml=False), agents=parsed.agents)
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, pod, ignore_errors=True)
        running = cleanup.enter_context(SidecarThread(config))
        path = pod / "run" / "agent.sock"
        as_nobody = textwrap.dedent(f"""\
            import os, socket
            os.setgroups([]); os.setresgid({NOBODY}, {NOBODY}, {NOBODY})
            os.setresuid({NOBODY}, {NOBODY}, {NOBODY})
            s = socket.socket(socket.AF_UNIX)
            s.connect({str(path)!r})
            s.settimeout(5)
            try:
                s.sendall(b"PRI * HTTP/2.0\\r\\n\\r\\nSM\\r\\n\\r\\n")
                print(len(s.recv(100)))
            except (BrokenPipeError, ConnectionResetError):  # closed already
                print(0)
            """)
        done = subprocess.run([sys.executable, "-c", as_nobody], capture_output=True,
                              text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "0"  # closed at once: not a byte of gRPC
        assert values(running.sidecar.metrics_url, "allocwatch_refused_total",
                      reason="peer_user") == [1.0]
        # root (the manifests' trainer) is admitted
        agent = start_agent(running.sidecar.agent_targets[0], interval=0.05,
                            source=FakeSource(), nvml=False, stop_at_exit=False)
        try:
            wait_for(lambda: values(running.sidecar.metrics_url, "allocwatch_agents_connected")
                     == [1.0], timeout=15, what="root's agent")
        finally:
            agent.stop()
