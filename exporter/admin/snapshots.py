"""The snapshot files the admin API serves: only regular files it finds in its snapshot
directory, by name, opened without following links.

`open_snapshot(directory, name)` is the one way in: `name` must be one plain file name (no
separator, no leading dot, no NUL), it is opened relative to a descriptor of the directory
with O_NOFOLLOW (a link planted there is refused, not followed) and O_NONBLOCK (a FIFO cannot
hold the caller), and what it opens must be a regular file within the size limit. What an
agent reports is only ever used for its name: a hostile agent naming any path on the machine
gets nothing served from outside the directory.
"""

from __future__ import annotations

import errno
import os
import re
import stat
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


def open_snapshot(directory: str | Path, name: str) -> tuple[int, int]:
    """(an open read-only descriptor, its size) of snapshot `name` in `directory`; the caller
    closes it. SnapshotUnavailable when the name is not a plain file name (400), no such file
    is there (404), or it is a link, not a regular file, too large or unreadable (409)."""
    if not _NAME.fullmatch(name):
        raise SnapshotUnavailable(400, "a snapshot name is one file name of letters, digits, "
                                       "'.', '_' and '-', not starting with '.'")
    try:
        folder = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SnapshotUnavailable(404, f"no snapshot named {name}: the snapshot directory "
                                       f"{directory} does not exist yet") from None
    except OSError as err:
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
    if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_SNAPSHOT_BYTES:
        os.close(fd)
        raise SnapshotUnavailable(409, f"{name} is not a regular file of at most "
                                       f"{MAX_SNAPSHOT_BYTES} bytes")
    return fd, st.st_size
