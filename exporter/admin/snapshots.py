"""The snapshot files the admin API serves: only regular files it finds in its snapshot
directory, by name, opened without following links, of one link, written by an agent's user.

`open_snapshot(directory, name, owners)` is the one way in: `name` must be one plain file name
(no separator, no leading dot, no NUL); the directory is opened one component at a time from the
root, each with O_NOFOLLOW (a directory swapped for a link, anywhere on its path, is refused, not
followed); the file is opened relative to it with O_NOFOLLOW (a link planted there is refused)
and O_NONBLOCK (a FIFO cannot hold the caller), and must be a regular file within the size
limit, with one link (a hard link planted there, even by root, to a file elsewhere has two) and
an owner in `owners` (the users agents run as). What an agent reports is only ever used for its
name: a hostile agent naming any path on the machine gets nothing served from outside the
directory.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Container
from pathlib import Path

MAX_SNAPSHOT_BYTES = 256 << 20
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")


class SnapshotUnavailable(Exception):
    """Why a snapshot cannot be served; `status` is the HTTP status that says so."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def snapshot_name(path_or_name: str) -> str:
    """The file name a reported snapshot path is served under."""
    return Path(path_or_name).name


def _open_directory(directory: str | Path) -> int:
    """A descriptor of `directory`, reached one component at a time without following a
    link; OSError (ELOOP, ENOTDIR for a link) otherwise."""
    path = os.path.abspath(directory)
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open("/", flags)
    try:
        for part in [p for p in path.split("/") if p]:
            child = os.open(part, flags, dir_fd=fd)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_snapshot(directory: str | Path, name: str,
                  owners: Container[int] | None = None) -> tuple[int, int]:
    """(an open read-only descriptor, its size) of snapshot `name` in `directory`; the caller
    closes it. SnapshotUnavailable when the name is not a plain file name (400), no such file
    is there (404), or it is a link (in its path too), not a regular file, linked elsewhere,
    not owned by one of `owners` (None: any), too large or unreadable (409)."""
    if not _NAME.fullmatch(name):
        raise SnapshotUnavailable(400, "a snapshot name is one file name of letters, digits, "
                                       "'.', '_' and '-', not starting with '.'")
    try:
        folder = _open_directory(directory)
    except FileNotFoundError:
        raise SnapshotUnavailable(404, f"no snapshot named {name}: the snapshot directory "
                                       f"{directory} does not exist yet") from None
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR):
            raise SnapshotUnavailable(409, f"the snapshot directory {directory} is reached "
                                           "through a link, which is not followed") from None
        raise SnapshotUnavailable(409, f"the snapshot directory {directory} cannot be opened: "
                                       f"{err.strerror}") from None
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=folder)
    except FileNotFoundError:
        raise SnapshotUnavailable(404, f"no snapshot named {name} in the snapshot directory "
                                       f"{directory}") from None
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise SnapshotUnavailable(409, f"{name} is a link: links in the snapshot directory "
                                           "are not followed") from None
        raise SnapshotUnavailable(409, f"cannot read {name} in {directory}: {err.strerror} "
                                       "(the sidecar needs read access to the agents' "
                                       "snapshot directory)") from None
    finally:
        os.close(folder)
    st = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_SNAPSHOT_BYTES:
        problem = f"{name} is not a regular file of at most {MAX_SNAPSHOT_BYTES} bytes"
    elif st.st_nlink != 1:
        problem = f"{name} has {st.st_nlink} links: a snapshot an agent wrote has one"
    elif owners is not None and st.st_uid not in owners:
        problem = (f"{name} belongs to uid {st.st_uid}, not to a user agents run as "
                   "(agents.allowed_uids, or one seen on the agents' socket)")
    if problem is not None:
        os.close(fd)
        raise SnapshotUnavailable(409, problem)
    return fd, st.st_size
