"""The directory where agents write the snapshots that the admin API serves, made by the sidecar
so that it can read what they write, whichever user they run as.

The agents' default (allocator_ext.agent: `snapshots/` beside the Unix socket) is the sidecar's
default too. In Kubernetes the trainer runs as its image's user (often root) and the sidecar as
65532, with no group in common; a shared `fsGroup` would make the kubelet re-own every volume of
the pod, datasets included. Instead the sidecar creates the directory before any agent can
connect, owned by itself and set-group-ID: every file created in it belongs to the sidecar's
group, whoever creates it, and the agents write their files group-readable (0640). The sticky
bit keeps one agent from removing or replacing another's file. Others may create files (but not
list them) exactly where the socket lets others connect: the directory follows the socket's mode.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

SNAPSHOT_DIR_NAME = "snapshots"


def snapshot_dir_for(agents_socket: str | None) -> Path | None:
    """Where the agents of this socket write snapshots (None without a Unix socket)."""
    return Path(agents_socket).parent / SNAPSHOT_DIR_NAME if agents_socket else None


def snapshot_dir_mode(socket_mode: int) -> int:
    """rwx for the sidecar and its group; -wx for others where others may connect; set-group-ID
    and sticky."""
    others = 0o003 if socket_mode & 0o002 else 0
    return stat.S_ISGID | stat.S_ISVTX | 0o770 | others


def prepare_snapshot_dir(directory: Path, socket_mode: int) -> str | None:
    """Creates (or, where this process owns it, re-modes) the directory; returns why snapshots
    written there may not be readable by this process, or None when they will be."""
    mode = snapshot_dir_mode(socket_mode)
    try:
        if directory.is_symlink() or (directory.exists() and not directory.is_dir()):
            return f"{directory} is not a directory"
        directory.mkdir(parents=True, exist_ok=True)
        info = directory.lstat()
        if info.st_uid != os.geteuid():
            if stat.S_IMODE(info.st_mode) & 0o050 == 0o050 and info.st_gid in _groups():
                return None
            return (f"{directory} was created by uid {info.st_uid} before the sidecar started "
                    f"(mode {stat.S_IMODE(info.st_mode):o}): the sidecar may not be able to "
                    "read the snapshots written there")
        os.chown(directory, -1, os.getegid())
        os.chmod(directory, mode)  # not subject to the umask, unlike mkdir's mode
    except OSError as err:
        return f"cannot prepare {directory}: {err.strerror}"
    return None


def _groups() -> set[int]:
    return {os.getegid(), *os.getgroups()}
