"""The directory of the sidecar's Unix sockets (the agents', the admin API's): one that only the
sidecar's user can write, so that no other user of the pod can replace a socket there.

A Kubernetes emptyDir is mode 0777 without the sticky bit: any user of the pod may rename or
remove what another created in it, and bind a socket of its own in its place. So the sockets go
in a directory the sidecar creates inside it (`/run/allocwatch/sidecar/` in the manifests),
owned by the sidecar's user and writable by it alone; who may reach the sockets is its search
permission (from the sockets' mode: `dir_mode`) and, on the agents' socket, the peer's user
(exporter.agents.front).

A directory there that another user made first (before the sidecar, or while it restarted) is
moved aside, named, and logged; one that cannot be moved (the volume's root itself) is an error
that says where to put the sockets instead. A directory whose only other writers are kept from
each other's files by its sticky bit (`/tmp`), owned by root or the sidecar's user, is used as
it is.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path

log = logging.getLogger("exporter.sidecar")


class SocketDirError(RuntimeError):
    """The sockets' directory cannot be made safe; the message says why and what to do."""


def dir_mode(socket_mode: int) -> int:
    """The directory's mode for sockets of `socket_mode`: rwx for the sidecar's user, and search
    (and listing) for the group and others where the sockets admit them."""
    mode = 0o700
    if socket_mode & 0o060:
        mode |= 0o050
    if socket_mode & 0o006:
        mode |= 0o005
    return mode


def unsafe(info: os.stat_result, uid: int) -> str | None:
    """Why a directory with this `lstat` is no safe home for a socket of user `uid`, or None."""
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    sticky = bool(info.st_mode & stat.S_ISVTX)
    if info.st_uid not in (uid, 0):
        return f"belongs to uid {info.st_uid}"
    if info.st_mode & 0o022 and not sticky:
        return (f"is writable by other users (mode {stat.S_IMODE(info.st_mode):o}, no sticky "
                "bit): any of them could replace a socket there")
    return None


def prepare_socket_dir(directory: Path, socket_mode: int, setting_name: str,
                       exact: bool = True) -> None:
    """Make `directory` (and its missing parents) a safe home for the sidecar's sockets of
    `socket_mode`; SocketDirError naming `setting_name` where it cannot be. `exact`: an
    existing directory of the sidecar's gets the mode of these sockets (the agents'), else it
    keeps the one it has, if safe (the admin API's socket beside them)."""
    uid = os.geteuid()
    mode = dir_mode(socket_mode)
    try:
        info = os.lstat(directory)
    except FileNotFoundError:
        info = None
    except OSError as err:
        raise SocketDirError(f"{setting_name}: cannot create the socket directory {directory}: "
                             f"{err.strerror}") from None
    if info is not None and (stat.S_ISLNK(info.st_mode) or info.st_uid not in (uid, 0)):
        _move_aside(directory, info, setting_name)
        info = None
    try:
        if info is None:
            directory.parent.mkdir(parents=True, exist_ok=True)
            os.mkdir(directory, mode & 0o700)  # the rest once it is surely the sidecar's
            info = os.lstat(directory)
            exact = True
        # Made here, or the sidecar's own safe one: exactly this mode (mkdir's went through the
        # umask). One others may write is never narrowed: they may be using it.
        if (exact and info.st_uid == uid and not info.st_mode & stat.S_ISVTX
                and unsafe(info, uid) is None):
            os.chmod(directory, mode)
            info = os.lstat(directory)
    except OSError as err:
        raise SocketDirError(f"{setting_name}: cannot create the socket directory {directory}: "
                             f"{err.strerror} (uid {uid})") from None
    problem = unsafe(info, uid)
    if problem is not None:
        raise SocketDirError(
            f"{setting_name}: the socket's directory {directory} {problem}. Put the sockets in "
            "a directory of their own that the sidecar creates, e.g. "
            f"{directory / 'sidecar' / 'agent.sock'}")


def _move_aside(directory: Path, info: os.stat_result, setting_name: str) -> None:
    aside = directory.with_name(f"{directory.name}.untrusted-{secrets.token_hex(4)}")
    try:
        os.rename(directory, aside)
    except OSError as err:
        raise SocketDirError(
            f"{setting_name}: {directory} belongs to uid {info.st_uid}, not to the sidecar "
            f"(uid {os.geteuid()}), and cannot be moved aside: {err.strerror}") from None
    log.warning("the socket directory was made by another user; moved aside", extra={
        "directory": str(directory), "moved_to": str(aside), "owner_uid": info.st_uid})
