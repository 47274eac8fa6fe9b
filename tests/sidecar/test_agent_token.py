"""Agents on TCP authenticate: any local user can reach a loopback port, so a hello there counts
only with the pod's agent token (`authorization: Bearer TOKEN`), or with a client certificate
under mutual TLS. The sidecar creates the token file where it is absent (on the directory
shared with the training container), the agent reads it from ALLOCWATCH_TOKEN_FILE (or takes
ALLOCWATCH_TOKEN), and the token shows in no log line, metric or page."""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import stat
import threading
import urllib.request
from pathlib import Path

import grpc
import pytest
from support.files import MountedVolume
from support.sidecar import FakeSource, scrape, sidecar_config, values
from support.streams import Stream, hello
from support.waiting import wait_for

from allocator_ext.agent import start_agent
from allocator_ext.agent.auth import AgentToken
from exporter.shared.config import ConfigError
from exporter.sidecar.app import SidecarThread
from exporter.sidecar.config import parse_config

pytestmark = pytest.mark.timeout(60)


def tcp_sidecar(tmp_path: Path, **agents: object) -> SidecarThread:
    config = sidecar_config(tmp_path, nvml=False)
    token_file = str(tmp_path / "run" / "agent-token")
    settings = {"tcp_port": 0, "token_file": token_file, **agents}
    return SidecarThread(dataclasses.replace(
        config, agents=dataclasses.replace(config.agents, **settings))).start()


@pytest.fixture
def running(tmp_path: Path):
    sidecar = tcp_sidecar(tmp_path)
    yield sidecar
    sidecar.stop()


def _tcp(running: SidecarThread) -> str:
    return running.sidecar.agent_targets[1]


def test_the_sidecar_creates_the_token_file_readable_by_the_pod_only(running,
                                                                     tmp_path: Path) -> None:
    token_file = tmp_path / "run" / "agent-token"
    token = token_file.read_text().strip()
    assert len(token) >= 32
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o440  # agents.socket_mode 0660, read only


def test_sidecars_starting_together_share_one_whole_token(tmp_path: Path) -> None:
    """Two sidecars of a pod may start at once on one token file: each reads the token the
    first one wrote, never an empty or half-written file, and no staged file is left."""
    from exporter.agents.grpc_server import agent_token

    config = sidecar_config(tmp_path, nvml=False)
    token_file = tmp_path / "run" / "agent-token"
    agents = dataclasses.replace(config.agents, tcp_port=0, token_file=str(token_file))
    def one_sidecar(start: threading.Barrier, tokens: list[bytes | BaseException]) -> None:
        start.wait()
        try:
            token = agent_token(agents)  # type: ignore[arg-type]
            tokens.append(token.current() if token is not None else b"")
        except BaseException as err:  # noqa: BLE001 - reported below
            tokens.append(err)

    for attempt in range(20):
        token_file.unlink(missing_ok=True)
        start = threading.Barrier(8)
        tokens: list[bytes | BaseException] = []
        threads = [threading.Thread(target=one_sidecar, args=(start, tokens)) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert len(set(tokens)) == 1, (attempt, tokens)
        assert tokens[0] == token_file.read_bytes().strip() and len(tokens[0]) == 64
        assert sorted(p.name for p in token_file.parent.iterdir()) == ["agent-token"]


@pytest.mark.parametrize("no_links", [errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS])
def test_a_filesystem_without_hard_links_still_gets_a_token_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_links: int) -> None:
    """vfat, many FUSE volumes and some SMB shares refuse link(): there the token file is
    created in place, with the same mode, and no staged file stays. (link() is made to fail:
    this machine's filesystems all have hard links.)"""
    from exporter.agents import grpc_server

    def refuse(src: object, dst: object) -> None:
        raise OSError(no_links, os.strerror(no_links))

    monkeypatch.setattr(grpc_server.os, "link", refuse)
    config = sidecar_config(tmp_path, nvml=False)
    token_file = tmp_path / "run" / "agent-token"
    agents = dataclasses.replace(config.agents, tcp_port=0, token_file=str(token_file))
    token = grpc_server.agent_token(agents)
    assert token is not None and token.current() == token_file.read_bytes().strip()
    assert len(token_file.read_bytes().strip()) == 64
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o440
    assert sorted(p.name for p in token_file.parent.iterdir()) == ["agent-token"]


def test_a_rotated_token_secret_admits_the_new_token_on_the_next_stream(
        tmp_path: Path) -> None:
    """The agent reads its token file at every connection; the sidecar reads the token again
    when its file changes (the kubelet's symlink swap), so an agent that reconnects after a
    Secret rotation is let in with the new token, and the old one no longer is."""
    secret = MountedVolume(tmp_path / "secret", "token")

    old, new = "a" * 32, "b" * 32
    secret.publish(old + "\n")
    running = tcp_sidecar(tmp_path, token_file=str(secret.path))

    def admitted(token: str, rank: int) -> bool:
        with Stream(_tcp(running), metadata=(("authorization", f"Bearer {token}"),)) as stream:
            try:
                return stream.send(hello(rank=rank)).answer().HasField("welcome")
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err
                return False

    try:
        assert admitted(old, 1)
        secret.publish(new + "\n")
        assert not admitted(old, 2)
        assert admitted(new, 3)
    finally:
        running.stop()


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong-token-0123456789"),),
                                      (("authorization", "wrong"),)],
                         ids=["none", "wrong", "no scheme"])
def test_a_hello_on_tcp_without_the_token_is_refused(running, metadata) -> None:
    url = running.sidecar.metrics_url
    with Stream(_tcp(running), metadata=metadata) as stream:
        err = stream.send(hello(rank=9)).error()
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "agents.token_file" in err.details()
    assert running.sidecar.registry.agents() == []
    assert values(url, "allocwatch_refused_total", reason="agent_token") == [1.0]


def test_an_agent_with_the_token_file_reports_and_never_shows_it(
        running, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    token_file = tmp_path / "run" / "agent-token"
    token = token_file.read_text().strip()
    monkeypatch.setenv("ALLOCWATCH_TOKEN_FILE", str(token_file))
    url = running.sidecar.metrics_url
    with caplog.at_level(logging.DEBUG):
        agent = start_agent(_tcp(running), interval=0.05, source=FakeSource(),
                            identity={"rank": 1}, nvml=False, stop_at_exit=False)
        try:
            wait_for(lambda: values(url, "torch_cuda_allocator_reserved_bytes", rank="1"),
                     what="a report over TCP")
        finally:
            agent.stop()
    assert token not in repr(agent.token) and token not in repr(vars(agent))
    with urllib.request.urlopen(url + "/", timeout=5) as page:
        assert token not in page.read().decode()
    assert token not in scrape(url)[0]
    for record in caplog.records:
        assert token not in repr(vars(record))


def test_the_token_from_the_environment_and_none_needed_on_the_unix_socket(
        running, tmp_path: Path) -> None:
    token = (tmp_path / "run" / "agent-token").read_text().strip()
    url = running.sidecar.metrics_url
    agents = [start_agent(_tcp(running), interval=0.05, source=FakeSource(),
                          identity={"rank": 2}, nvml=False, stop_at_exit=False,
                          token=AgentToken.from_env({"ALLOCWATCH_TOKEN": token})),
              start_agent(running.sidecar.agent_targets[0], interval=0.05, source=FakeSource(),
                          identity={"rank": 3}, nvml=False, stop_at_exit=False)]
    try:
        for rank in ("2", "3"):
            wait_for(lambda rank=rank: values(url, "torch_cuda_allocator_reserved_bytes",
                                              rank=rank), what=f"rank {rank}")
    finally:
        for agent in agents:
            agent.stop()


def test_a_token_file_given_is_read_not_replaced(tmp_path: Path) -> None:
    given = tmp_path / "run" / "agent-token"
    given.parent.mkdir()
    given.write_text("a" * 40 + "\n")
    os.chmod(given, 0o400)
    sidecar = tcp_sidecar(tmp_path)
    try:
        with Stream(_tcp(sidecar), metadata=(("authorization", "Bearer " + "a" * 40),)) as s:
            assert s.send(hello()).answer().HasField("welcome")
    finally:
        sidecar.stop()
    assert given.read_text() == "a" * 40 + "\n"


@pytest.mark.parametrize("agents, message", [
    ({"tcp_port": 7070}, "agents.tcp_port: agents on TCP must authenticate"),
    ({"tcp_port": 7070, "token_file": "/x", "token_env": "Y"}, "not both"),
    ({"tcp_port": 7070, "token_env": "AW_SURELY_UNSET_VARIABLE"}, "token is empty"),
])
def test_tcp_without_a_way_to_authenticate_is_refused(agents: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"agents": agents})
    assert message in str(err.value)


@pytest.mark.parametrize("kind", ["fifo", "endless device", "too long"])
def test_a_token_file_that_is_no_token_holds_up_and_fills_nothing_of_the_agent(
        tmp_path: Path, kind: str) -> None:
    """The path comes from the environment of the training process: a FIFO there would hold
    the agent's connection thread for good (and its stop), /dev/zero fill the process's
    memory. Either reads as no token at once, and the agent keeps retrying."""
    path = tmp_path / "agent-token"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "too long":
        path.write_text("a" * 5000)
    token = AgentToken(file="/dev/zero" if kind == "endless device" else str(path))
    assert token.read() == "" and token.metadata() == ()
