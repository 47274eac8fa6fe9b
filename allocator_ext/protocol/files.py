"""Files the sidecar and the agent alike read or write.

Reading a small file named in the settings or the environment (a settings file, a token): such
a path may name a FIFO, which would hold the reader forever, or a device like /dev/zero, which
never ends. Writing a file that others read meanwhile (a snapshot, a build's failure marker):
they must see the whole file or none."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path

# The longest bearer token either side reads (a token is a few dozen characters).
MAX_TOKEN_BYTES = 4096


def read_regular_file(path: str | Path, limit: int) -> bytes:
    """At most `limit` + 1 bytes of the regular file at `path` (links followed: a mounted
    ConfigMap or Secret is one), so that a caller sees a file too large without reading it
    all; OSError when it cannot be read or is no regular file (a FIFO would hold the reader
    forever, a device like /dev/zero never end)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO opens at once
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        chunks: list[bytes] = []
        left = limit + 1
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


Stamp = tuple[int, int, int, int, int]


def content_stamp(path: str | Path) -> Stamp | None:
    """What tells that a file's content may have changed, without reading it: device, inode,
    size, and the modification and change times in nanoseconds (links followed). The change
    time moves on every write, even one that then restores the modification time, as `cp -p`
    does; a rename into place or a Secret's symlink swap changes the inode. None when the path
    is missing or no regular file."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def write_whole(path: Path, data: bytes, mode: int | None = None) -> None:
    """Write `data` to `path` so that a reader sees the whole new file, the old one, or none:
    a staged file of this writer's own beside it (a dot name, which no listing serves; two
    writers never share one), renamed into place, and removed if the write fails. `mode` is set
    whatever the umask; without it the file is created as open() would (0666 less the umask)."""
    staged = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                 0o666 if mode is None else 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            f.write(data)
        os.replace(staged, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(staged)
        raise
