"""Hot reload: the sidecar polls its YAML file and applies a valid new version without a restart;
SIGHUP reads it at once (as Prometheus does), also where polling is off (reload.enabled: false).

Polling, not inotify: a Kubernetes ConfigMap volume updates by swapping the `..data` symlink to a
new directory, which inotify watches on the file itself miss, and polling costs one small read
every few seconds. Each poll reads the file the path resolves to (following symlinks) and
hashes its content; the content hash decides, so a swapped symlink, an in-place edit and a
same-second rewrite are all seen, and a file rewritten with the same content is not a change.

New content must read the same on two polls in a row before it counts. A file rewritten in place
(`cat > file`, an editor that truncates, `kubectl cp`) is empty or cut short for a moment, and an
empty document is valid (all defaults): read at that moment, it would drop every policy rule and
then be replaced again a poll later. A change therefore takes effect one to two intervals after it
is written. The kubelet's symlink swap is atomic and needs no settling, but the rule costs it only
one interval.

The file is read, hashed and parsed on a worker thread; only installing new settings runs on the
event loop. An invalid file is refused, logged once per distinct content, counted
(allocwatch_config_reloads_total{result="invalid"}), and the settings in force stay.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import logging
import threading
from collections.abc import Callable
from pathlib import Path

from allocator_ext.protocol.files import read_regular_file
from exporter.shared.config import MAX_FILE_BYTES, ConfigError
from exporter.sidecar.config import SidecarConfig, config_from_bytes

log = logging.getLogger("exporter.reload")


def content_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclasses.dataclass(frozen=True)
class Change:
    """What one poll found: new content (parsed, or why it was refused), or an unreadable
    file."""

    digest: str = ""
    config: SidecarConfig | None = None
    refusal: str | None = None
    unreadable: OSError | None = None


class ConfigWatcher:
    """`run()` polls forever from the event loop: each poll reads, hashes and parses the file
    on a worker thread (`poll`), so that no file, however hostile, holds up the loop, and only
    installing the result (`settle`) runs on it. `check()` is one poll, inline (tests).

    `apply(config)` installs valid settings and returns the fields it could not change without a
    restart (listeners, ports), which keep their old values. `in_force` is the settings the
    caller read from the file earlier; a file that no longer holds them is a change.
    """

    def __init__(self, path: str | Path, apply: Callable[[SidecarConfig], list[str]],
                 interval_seconds: float = 5.0, in_force: SidecarConfig | None = None):
        self.path = Path(path)
        self.apply = apply
        self.interval_seconds = interval_seconds
        self.current_hash: str | None = None
        self._refused_hash: str | None = None
        self._unsettled_hash: str | None = None  # new content seen once, not yet twice
        self._unreadable = False
        self.last_successful = True
        self._lock = threading.Lock()
        self.reloads_total: collections.Counter[str] = collections.Counter()
        try:
            data = read_regular_file(self.path, MAX_FILE_BYTES)
        except OSError:
            return
        if in_force is None or self._parses_to(data, in_force):
            self.current_hash = content_hash(data)
        # Otherwise the file changed after the settings in force were read from it: no hash is
        # current, so the first polls settle and apply (or refuse) what it holds now.

    @staticmethod
    def _parses_to(data: bytes, in_force: SidecarConfig) -> bool:
        try:
            return config_from_bytes(data) == in_force
        except ConfigError:
            return False

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_seconds)
            try:
                change = await asyncio.to_thread(self.poll)
                if change is not None:
                    self.settle(change)
            except Exception:  # never let a reload bug stop the sidecar
                log.exception("settings reload failed unexpectedly")

    def _read(self) -> bytes | OSError:
        try:
            return read_regular_file(self.path, MAX_FILE_BYTES)  # follows the symlinks
        except OSError as err:  # missing, unreadable, or no regular file (a FIFO)
            return err

    def poll(self, data: bytes | OSError | None = None) -> Change | None:
        """Read (unless given), hash and parse; None when nothing changed, or when new content
        has not yet read the same twice in a row."""
        if data is None:
            data = self._read()
        if isinstance(data, OSError):
            self._unsettled_hash = None
            return None if self._unreadable else Change(unreadable=data)
        digest = content_hash(data)
        if digest in (self.current_hash, self._refused_hash):
            self._unreadable = False
            self._unsettled_hash = None
            return None
        if digest != self._unsettled_hash:  # perhaps a write in progress: wait a poll
            self._unsettled_hash = digest
            return None
        self._unsettled_hash = None
        return self._parsed(digest, data)

    @staticmethod
    def _parsed(digest: str, data: bytes) -> Change:
        if len(data) > MAX_FILE_BYTES:
            return Change(digest, refusal=f"the file is larger than {MAX_FILE_BYTES} bytes")
        try:
            return Change(digest, config=config_from_bytes(data))
        except ConfigError as err:
            return Change(digest, refusal=str(err))

    def read_now(self) -> Change | None:
        """The file as it is now, parsed, without waiting for two reads to agree (whoever sent
        SIGHUP says it is whole); None when it holds the settings in force."""
        data = self._read()
        if isinstance(data, OSError):
            return Change(unreadable=data)
        digest = content_hash(data)
        if digest == self.current_hash:
            return None
        self._unsettled_hash = None
        return self._parsed(digest, data)

    async def reload_now(self) -> str | None:
        """On SIGHUP, as Prometheus does: read the file now (on a worker thread) and install or
        refuse it; the result label, None when the file holds the settings in force."""
        change = await asyncio.to_thread(self.read_now)
        if change is None:
            log.info("SIGHUP: the settings file holds the settings in force",
                     extra={"path": str(self.path)})
            return None
        return self.settle(change)

    def settle(self, change: Change) -> str:
        """Install, refuse or note what a poll found; the result label."""
        if change.unreadable is not None:  # e.g. mid-swap or a removed ConfigMap: keep the old
            self._unreadable = True
            log.warning("settings file unreadable, keeping the settings in force",
                        extra={"path": str(self.path), "reason": change.unreadable.strerror})
            return self._count("unreadable")
        self._unreadable = False
        if change.config is None:
            self._refused_hash = change.digest
            self.last_successful = False
            log.error("settings reload refused, keeping the settings in force",
                      extra={"path": str(self.path), "reason": change.refusal,
                             "sha256": change.digest[:16]})
            return self._count("invalid")
        restart_needed = self.apply(change.config)
        self.current_hash, self._refused_hash = change.digest, None
        self.last_successful = True
        log.info("settings reloaded", extra={
            "path": str(self.path), "sha256": change.digest[:16],
            "needs_restart": restart_needed or None})
        if restart_needed:
            log.warning("some changed settings take effect only after a restart",
                        extra={"fields": restart_needed})
            return self._count("partial")
        return self._count("ok")

    def check(self, data: bytes | OSError | None = None) -> str | None:
        """One poll, inline: the result label when something happened, None when nothing
        changed (or the content is new this poll: it counts when the next one reads it
        again)."""
        change = self.poll(data)
        return self.settle(change) if change is not None else None

    def _count(self, result: str) -> str:
        with self._lock:
            self.reloads_total[result] += 1
        return result

    def counts(self) -> tuple[list[tuple[str, int]], bool]:
        """(reloads seen by result, whether the last file seen was accepted), for the
        collector."""
        with self._lock:
            return sorted(self.reloads_total.items()), self.last_successful
