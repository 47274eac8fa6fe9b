"""The bearer tokens the sidecar checks (the admin API's, the agents' on TCP), read again when
their file changes: a rotated Kubernetes Secret (the kubelet swaps the mounted file's symlink)
takes effect at the next request or stream, no restart. The agent reads its token file at
every connection, so both sides follow a rotation.

Each check stats the file (a few microseconds, once per admin request or agent stream) and
reads it only when its content stamp moved. A token that cannot be read, or is too short,
leaves the one in force, logged once per change of the file; a file that changed while it was
read (perhaps caught mid-write, a cut token of 16 bytes or more) is read again at the next
check.

The servers check from their event loop, which also answers every scrape: the file is stat'ed
and read in a thread of its own, and a check that has not finished within
FILE_CHECK_TIMEOUT_S (a hung network mount) leaves the token in force to answer, at once for
as long as that check still hangs. Logged once per hang.

A changed file is trusted as the file at start was, and no further: it must belong to root,
to the sidecar's user or to the owner of the file at start, and be writable by no one the file
at start was not writable by. Otherwise anyone who may write in its directory, though not the
file, could swap in a token of their own while the sidecar runs."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from allocator_ext.protocol.files import Stamp, content_stamp
from exporter.shared.config import ConfigError, read_token

T = TypeVar("T")
log = logging.getLogger("exporter.tokens")

# How long a check from the event loop waits for the token file before the token in force
# answers (FILE_CHECK_TIMEOUT_S in the module's docstring).
FILE_CHECK_TIMEOUT_S = 0.5


def in_daemon_thread(work: Callable[[], T], name: str) -> concurrent.futures.Future[T]:
    """`work()` on a thread of its own, its result or error in the future returned (for an
    event loop: `await asyncio.wrap_future(...)`). A daemon thread, not a pool's such as
    asyncio.to_thread's: one hung reading a token file (a network mount that stopped answering)
    must not hold up the sidecar's exit, which waits for the pool's threads."""
    done: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        try:
            done.set_result(work())
        except BaseException as err:  # handed to whoever waits on it
            done.set_exception(err)

    threading.Thread(target=run, name=name, daemon=True).start()
    return done


class RotatingToken:
    """The token a settings section names (`token_file`, else `token_env`; `path` is the
    section's name in messages, "admin" or "agents"). `current()` is the token in force: None
    where none is configured."""

    def __init__(self, section: Any, path: str):
        self._config = section
        self._path = path
        self._lock = threading.Lock()
        self._stamp = self._file_stamp()
        self._token = read_token(section, path)  # ConfigError at start: the sidecar refuses
        self._owners = {0, os.geteuid()}
        self._writable_by = 0o022  # group and others, where the file at start allowed them
        if section.token_file:
            with contextlib.suppress(OSError):
                at_start = os.stat(section.token_file)
                self._owners.add(at_start.st_uid)
                self._writable_by = 0o022 & ~at_start.st_mode
        # The check in flight and when it started: a lock of their own, since the checking
        # thread holds `_lock` for as long as the file takes to answer.
        self._check_lock = threading.Lock()
        self._check: concurrent.futures.Future[bytes | None] | None = None
        self._check_started = 0.0  # time.monotonic()
        self._hang_logged = False

    def _untrusted(self) -> str | None:
        """Why the changed file is not trusted as the file at start was; None if it is."""
        try:
            st = os.stat(self._config.token_file)
        except OSError:
            return None  # read_token names what is wrong with it
        if st.st_uid not in self._owners:
            return (f"{self._path}.token_file: owned by uid {st.st_uid}, neither root, the "
                    "sidecar's user nor the owner of the file at start")
        if st.st_mode & self._writable_by:
            return (f"{self._path}.token_file: writable by more users (mode "
                    f"{stat.S_IMODE(st.st_mode):04o}) than the file at start")
        return None

    def _file_stamp(self) -> Stamp | None:
        return content_stamp(self._config.token_file) if self._config.token_file else None

    def current(self) -> bytes | None:
        if not self._config.token_file:  # none, or from the environment: fixed for the process
            return self._token
        with self._lock:
            stamp = self._file_stamp()
            if stamp == self._stamp:
                return self._token
            try:
                if (untrusted := self._untrusted()) is not None:
                    raise ConfigError(untrusted)
                token = read_token(self._config, self._path)
            except ConfigError as err:
                self._stamp = stamp  # logged once for this content; a new write reads again
                log.error("the changed token file cannot be used; the token in force stays",
                          extra={"section": self._path, "reason": str(err)})
                return self._token
            if self._file_stamp() == stamp:
                if token != self._token:
                    log.info("token file changed; the new token is in force",
                             extra={"section": self._path, "path": self._config.token_file})
                self._token, self._stamp = token, stamp
            return self._token

    async def current_from_loop(self) -> bytes | None:
        """current() for an event loop: the file is read in a thread of its own; a check still
        running after FILE_CHECK_TIMEOUT_S leaves the token in force to answer."""
        if not self._config.token_file:
            return self._token
        with self._check_lock:
            if self._check is None or self._check.done():
                self._check, self._check_started = self._start_check(), time.monotonic()
            check, started = self._check, self._check_started
        waited = time.monotonic() - started
        if waited < FILE_CHECK_TIMEOUT_S:
            with contextlib.suppress(asyncio.TimeoutError):
                # shield: a request that stops waiting leaves the check running for the next
                return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(check)),
                                              FILE_CHECK_TIMEOUT_S - waited)
        if not self._hang_logged:
            self._hang_logged = True
            log.error("the token file has not answered; the token in force stays until it does",
                      extra={"section": self._path, "path": self._config.token_file,
                             "waited_seconds": FILE_CHECK_TIMEOUT_S})
        return self._token

    def _start_check(self) -> concurrent.futures.Future[bytes | None]:
        def check() -> bytes | None:
            token = self.current()
            self._hang_logged = False
            return token

        return in_daemon_thread(check, f"allocwatch-{self._path}-token-file")

    async def admits(self, authorization: object) -> bool:
        """Whether an `Authorization` value presents the token in force (`Bearer TOKEN`,
        compared in constant time: the comparison does not stop at the first differing byte);
        False where none is configured. From an event loop, which the file never holds up."""
        expected = await self.current_from_loop()
        if expected is None:
            return False
        presented = b""
        if isinstance(authorization, str) and authorization[:7].lower() == "bearer ":
            presented = authorization[7:].strip().encode("utf-8", "replace")
        return hmac.compare_digest(presented, expected)
