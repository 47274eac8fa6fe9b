"""Before an agent speaks to the sidecar on a Unix socket: is it the sidecar's?

In a shared directory any user of the pod could have replaced the socket with one of their own,
and an agent (often root, in the training process) would then take its commands. The sidecar
keeps its sockets in a directory only its user can write (exporter.shared.socket_dir); the
agent checks, on every connection, that:

- the socket's directory is a directory (not a link) that no other user can write (or whose
  sticky bit keeps them from others' files), owned by the sidecar's user or root;
- the socket is a socket, owned by the sidecar's user;
- the process listening on it runs as that user (SO_PEERCRED on a connection of its own).

The sidecar's user is ALLOCWATCH_SIDECAR_UID where set (the manifests set it: without it, a user
who made the directory before the sidecar did would pass as the sidecar), else the owner of the
socket. A failed check is the connection's error (logged, retried with the backoff); nothing is
sent.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
from collections.abc import Mapping

_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def sidecar_uid_from_env(environ: Mapping[str, str] = os.environ) -> int | None:
    """ALLOCWATCH_SIDECAR_UID, or None where unset; ValueError naming it where not a uid."""
    text = environ.get("ALLOCWATCH_SIDECAR_UID", "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) >= 2**32 - 1:
        raise ValueError(f"ALLOCWATCH_SIDECAR_UID: expected a user id, got {text[:40]!r}")
    return int(text)


def unix_path(target: str) -> str | None:
    """The socket's path of a gRPC target `unix:PATH` or `unix:///PATH`; None for others."""
    if not target.startswith("unix:"):
        return None
    path = target[len("unix:"):]
    return "/" + path.lstrip("/") if path.startswith("//") else path


def socket_problem(path: str, sidecar_uid: int | None, timeout: float = 2.0) -> str | None:
    """Why the socket at `path` is not to be trusted as the sidecar's, or None."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        folder = os.lstat(directory)
        entry: os.stat_result | None = os.lstat(path)
    except FileNotFoundError:
        # Nobody listens yet: gRPC's connection fails, and says so. Where the directory is safe,
        # what appears in it before gRPC connects is the sidecar's user's.
        entry = None
        try:
            folder = os.lstat(directory)
        except FileNotFoundError:
            return None
        except OSError as err:
            return f"cannot check {directory}: {err.strerror}"
    except OSError as err:
        return f"cannot check {path}: {err.strerror}"
    if not stat.S_ISDIR(folder.st_mode):
        return f"the socket's directory {directory} is not a directory (a link?)"
    owner = sidecar_uid if sidecar_uid is not None else (
        entry.st_uid if entry is not None else folder.st_uid)
    if folder.st_uid not in (owner, 0):
        return (f"the socket's directory {directory} belongs to uid {folder.st_uid}, not to the "
                f"sidecar's user (uid {owner})")
    if folder.st_mode & 0o022 and not folder.st_mode & stat.S_ISVTX:
        return (f"the socket's directory {directory} is writable by other users (mode "
                f"{stat.S_IMODE(folder.st_mode):o}): any of them could have replaced the socket")
    if entry is None:
        return None
    if not stat.S_ISSOCK(entry.st_mode):
        return f"{path} is not a socket"
    if entry.st_uid != owner:
        return f"{path} belongs to uid {entry.st_uid}, not to the sidecar's user (uid {owner})"
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(timeout)
        probe.connect(path)
        pid, uid, _ = _PEERCRED.unpack(probe.getsockopt(
            socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    except OSError as err:
        return f"cannot connect to {path}: {err.strerror or err}"
    finally:
        probe.close()
    if uid != owner:
        return (f"the process listening on {path} (pid {pid}) runs as uid {uid}, not as the "
                f"sidecar's user (uid {owner})")
    return None
