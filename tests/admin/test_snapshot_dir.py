"""The agents' snapshot directory, made by the sidecar so that it can read what agents of any user
write there: set-group-ID (files take the sidecar's group), sticky (an agent cannot remove
another's file), open to others exactly where the socket is; the agents' files group-readable
whatever their umask. The whole path under the manifests' users:
tests/deploy/test_deploy_pod_users.py."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from allocator_ext.agent import _default_snapshot_dir
from allocator_ext.agent.snapshots import FILE_MODE, write_snapshot
from exporter.admin.snapshot_dir import prepare_snapshot_dir, snapshot_dir_for, snapshot_dir_mode


def test_the_agents_and_the_sidecar_agree_where_snapshots_go() -> None:
    socket = "/run/allocwatch/agent.sock"
    assert _default_snapshot_dir(f"unix://{socket}") == snapshot_dir_for(socket)
    assert snapshot_dir_for(None) is None


@pytest.mark.parametrize(("socket_mode", "expected"), [
    (0o666, stat.S_ISGID | stat.S_ISVTX | 0o773),  # the manifests: any user of the pod
    (0o660, stat.S_ISGID | stat.S_ISVTX | 0o770),  # the default: owner and group
    (0o600, stat.S_ISGID | stat.S_ISVTX | 0o770),
])
def test_the_directory_follows_the_sockets_mode(socket_mode: int, expected: int) -> None:
    assert snapshot_dir_mode(socket_mode) == expected


def test_prepared_whatever_the_umask_and_again_at_a_restart(tmp_path: Path) -> None:
    directory = tmp_path / "run" / "snapshots"
    old = os.umask(0o077)
    try:
        assert prepare_snapshot_dir(directory, 0o666) is None
    finally:
        os.umask(old)
    assert stat.S_IMODE(directory.stat().st_mode) == snapshot_dir_mode(0o666)
    directory.chmod(0o700)  # a sidecar restarted in the same pod finds its own directory
    assert prepare_snapshot_dir(directory, 0o666) is None
    assert stat.S_IMODE(directory.stat().st_mode) == snapshot_dir_mode(0o666)


def test_a_directory_another_user_made_is_reported_not_taken_over(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("making a directory owned by another user needs root")
    directory = tmp_path / "snapshots"
    directory.mkdir(mode=0o750)
    os.chown(directory, 4242, 4242)
    problem = prepare_snapshot_dir(directory, 0o666)
    assert problem is not None and "uid 4242" in problem and "750" in problem
    assert stat.S_IMODE(directory.stat().st_mode) == 0o750  # left as it was


def test_a_path_that_is_not_a_directory_is_reported(tmp_path: Path) -> None:
    (tmp_path / "snapshots").write_text("")
    assert "not a directory" in (prepare_snapshot_dir(tmp_path / "snapshots", 0o666) or "")


def test_the_agents_file_is_group_readable_under_a_umask_of_077(tmp_path: Path) -> None:
    code = ("import os, sys; from pathlib import Path; os.umask(0o077)\n"
            "from allocator_ext.agent.snapshots import write_snapshot\n"
            "path, _ = write_snapshot(Path(sys.argv[1]), {'segments': [], 'device_traces': []},"
            " rank=0, device=0, include_frames=False, max_bytes=1 << 20)\n"
            "print(path)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert stat.S_IMODE(Path(out.stdout.strip()).stat().st_mode) == FILE_MODE == 0o640


def test_files_take_the_directorys_group(tmp_path: Path) -> None:
    directory = tmp_path / "snapshots"
    assert prepare_snapshot_dir(directory, 0o666) is None
    path, _ = write_snapshot(directory, {"segments": [], "device_traces": []}, rank=0, device=0,
                             include_frames=False, max_bytes=1 << 20)
    assert path.stat().st_gid == directory.stat().st_gid == os.getegid()
