"""The admin API serves only files it finds in its snapshot directory, by name, opened without
following links (in the directory's path too), of one link and owned by a user agents run as.
An agent's answer names a path, and a hostile agent may name any file (the sidecar's TLS key,
say): the path is never opened, only a name in that directory is; and a directory swapped for a
link, or a hard link planted there, serves nothing."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from support.admin import call
from support.control import connect_agent, start_control_sidecar
from support.sidecar import FakeSource
from support.streams import Stream, device, hello, report
from support.waiting import wait_for

from allocator_ext.protocol.proto.allocwatch.v1 import agent_pb2 as pb
from exporter.admin.snapshots import SnapshotUnavailable, open_snapshot

pytestmark = pytest.mark.timeout(60)
SECRET = b"-----BEGIN PRIVATE KEY-----\nnot for agents\n"


@pytest.fixture
def sidecar(tmp_path: Path):
    running = start_control_sidecar(tmp_path)
    yield running
    running.stop()


def _answer_a_snapshot_with(running, path: str) -> dict:
    """A hostile agent that answers the snapshot command with `path`; the API's answer."""
    (admin,) = running.sidecar.admin.addresses()
    answers: list = []
    with Stream(running.sidecar.agent_targets[0]) as agent:
        agent.send(hello(rank=6, host="evil"), report(1, [device()]))
        assert agent.answer().HasField("welcome")
        wait_for(lambda: any(a.identity.rank == 6 and a.last_report is not None
                             for a in running.sidecar.registry.agents()), what="the agent")
        asking = threading.Thread(target=lambda: answers.append(
            call(admin, "POST", "/v1/snapshot", {"rank": 6})))
        asking.start()
        command = agent.answer().command
        agent.send(pb.AgentMessage(command_result=pb.CommandResult(
            command_id=command.id, status=pb.CommandResult.OK, snapshot_path=path,
            snapshot_bytes=len(SECRET))))
        asking.join(30)
    status, answer = answers[0]
    assert status == 200, answer
    return answer


def test_a_path_outside_the_snapshot_directory_is_never_served(sidecar, tmp_path: Path) -> None:
    key = tmp_path / "tls.key"
    key.write_bytes(SECRET)
    answer = _answer_a_snapshot_with(sidecar, str(key))
    (admin,) = sidecar.sidecar.admin.addresses()
    status, body = call(admin, "GET", answer["results"][0]["snapshot"]["download"])
    assert status == 404 and SECRET not in repr(body).encode()
    assert "snapshot directory" in body["error"]


def test_a_link_in_the_snapshot_directory_is_not_followed(sidecar, tmp_path: Path) -> None:
    key = tmp_path / "tls.key"
    key.write_bytes(SECRET)
    directory = tmp_path / "run" / "snapshots"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "snapshot-evil.pickle.gz").symlink_to(key)
    os.mkfifo(directory / "snapshot-fifo.pickle.gz")  # would block a plain open()
    answer = _answer_a_snapshot_with(sidecar, str(directory / "snapshot-evil.pickle.gz"))
    (admin,) = sidecar.sidecar.admin.addresses()
    status, body = call(admin, "GET", answer["results"][0]["snapshot"]["download"])
    assert status == 409 and "link" in body["error"] and SECRET not in repr(body).encode()
    status, body = call(admin, "GET", "/v1/snapshots/snapshot-fifo.pickle.gz")
    assert status == 409 and "not a regular file" in body["error"]


@pytest.mark.parametrize("name", ["..%2Ftls.key", "..", ".", "%2Fetc%2Fpasswd", ".hidden",
                                  "a%00b", "x" * 300])
def test_a_name_that_is_not_one_plain_file_name_is_refused(sidecar, name: str) -> None:
    (admin,) = sidecar.sidecar.admin.addresses()
    status, body = call(admin, "GET", f"/v1/snapshots/{name}")
    assert status in (400, 404) and "error" in body


def test_a_snapshot_the_agent_wrote_there_is_served(sidecar, tmp_path: Path) -> None:
    agent = connect_agent(sidecar, tmp_path, FakeSource(), rank=0)
    (admin,) = sidecar.sidecar.admin.addresses()
    try:
        status, answer = call(admin, "POST", "/v1/snapshot", {"rank": 0})
        path = Path(answer["results"][0]["snapshot"]["path"])
        assert path.parent == tmp_path / "run" / "snapshots"
        status, data = call(admin, "GET", answer["results"][0]["snapshot"]["download"])
        assert status == 200 and data == path.read_bytes()
    finally:
        agent.stop()


def test_the_snapshot_directory_swapped_for_a_link_is_not_followed(
        sidecar, tmp_path: Path) -> None:
    """Renamed, and a link to the sidecar's own files put in its place: nothing is served."""
    secrets_dir = tmp_path / "tls"
    secrets_dir.mkdir()
    (secrets_dir / "srv.key").write_bytes(SECRET)
    directory = tmp_path / "run" / "snapshots"
    directory.mkdir(parents=True, exist_ok=True)
    directory.rename(directory.with_name("snapshots.old"))
    directory.symlink_to(secrets_dir)
    (admin,) = sidecar.sidecar.admin.addresses()
    status, body = call(admin, "GET", "/v1/snapshots/srv.key")
    assert status == 409 and "link" in body["error"] and SECRET not in repr(body).encode()
    # A link higher up the path is not followed either.
    (tmp_path / "linked").symlink_to(tmp_path)
    with pytest.raises(SnapshotUnavailable) as refused:
        open_snapshot(tmp_path / "linked" / "tls", "srv.key")
    assert refused.value.status == 409 and "link" in str(refused.value)


def test_a_hard_link_planted_there_is_not_served(sidecar, tmp_path: Path) -> None:
    key = tmp_path / "tls.key"
    key.write_bytes(SECRET)
    directory = tmp_path / "run" / "snapshots"
    directory.mkdir(parents=True, exist_ok=True)
    os.link(key, directory / "snapshot-linked.pickle.gz")  # root could, to any file
    (admin,) = sidecar.sidecar.admin.addresses()
    status, body = call(admin, "GET", "/v1/snapshots/snapshot-linked.pickle.gz")
    assert status == 409 and "2 links" in body["error"] and SECRET not in repr(body).encode()


def test_a_file_of_a_user_no_agent_runs_as_is_not_served(sidecar, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    directory = tmp_path / "run" / "snapshots"
    directory.mkdir(parents=True, exist_ok=True)
    stranger = directory / "snapshot-stranger.pickle.gz"
    stranger.write_bytes(SECRET)
    os.chown(stranger, 65534, 65534)  # nobody: no agent runs as nobody here
    (admin,) = sidecar.sidecar.admin.addresses()
    status, body = call(admin, "GET", "/v1/snapshots/snapshot-stranger.pickle.gz")
    assert status == 409 and "uid 65534" in body["error"] and SECRET not in repr(body).encode()
