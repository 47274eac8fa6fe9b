"""Hot reload: the sidecar polls its YAML file and applies a valid new version without a restart.

Polling, not inotify: a Kubernetes ConfigMap volume updates by swapping the `..data` symlink to a
new directory, which inotify watches on the file itself miss, and polling costs one small read
every few seconds. Each poll stats the path (following symlinks: the signature is device, inode,
mtime and size of the file it resolves to) and hashes its content; the content hash decides, so a
swapped symlink, an in-place edit and a same-second rewrite are all seen, and a file rewritten
with the same content is not a change.

An invalid file is refused, logged once per distinct content, counted
(allocwatch_config_reloads_total{result="invalid"}), and the settings in force stay.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

import yaml

from exporter.config import ConfigError
from exporter.sidecar.config import SidecarConfig, parse_config

log = logging.getLogger("exporter.reload")

MAX_FILE_BYTES = 1 << 20


def file_signature(path: Path) -> tuple[int, int, int, int]:
    st = os.stat(path)  # follows symlinks: the ConfigMap's current target
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size


def content_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class ConfigWatcher:
    """`check()` is one poll; `run()` polls forever on the event loop (reads off the loop).

    `apply(config)` installs valid settings and returns the fields it could not change without a
    restart (listeners, ports), which keep their old values.
    """

    def __init__(self, path: str | Path, apply: Callable[[SidecarConfig], list[str]],
                 interval_seconds: float = 5.0):
        self.path = Path(path)
        self.apply = apply
        self.interval_seconds = interval_seconds
        self.current_hash: str | None = None
        self.signature: tuple[int, int, int, int] | None = None
        self._refused_hash: str | None = None
        self._unreadable = False
        self.last_successful = True
        self._lock = threading.Lock()
        self.reloads_total: collections.Counter[str] = collections.Counter()
        try:
            self.current_hash = content_hash(self.path.read_bytes()[:MAX_FILE_BYTES])
            self.signature = file_signature(self.path)
        except OSError:
            pass

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_seconds)
            try:
                data = await asyncio.to_thread(self._read)
                self.check(data)
            except Exception:  # never let a reload bug stop the sidecar
                log.exception("settings reload failed unexpectedly")

    def _read(self) -> bytes | OSError:
        try:
            with open(self.path, "rb") as f:  # follows the ConfigMap's symlinks
                st = os.fstat(f.fileno())
                self.signature = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
                return f.read(MAX_FILE_BYTES + 1)
        except OSError as err:
            return err

    def check(self, data: bytes | OSError | None = None) -> str | None:
        """One poll: the result label when something happened, None when nothing changed."""
        if data is None:
            data = self._read()
        if isinstance(data, OSError):
            if not self._unreadable:  # e.g. mid-swap or a removed ConfigMap: keep the old one
                self._unreadable = True
                log.warning("settings file unreadable, keeping the settings in force",
                            extra={"path": str(self.path), "reason": data.strerror})
                return self._count("unreadable")
            return None
        self._unreadable = False
        digest = content_hash(data)
        if digest in (self.current_hash, self._refused_hash):
            return None
        try:
            if len(data) > MAX_FILE_BYTES:
                raise ConfigError(f"the file is larger than {MAX_FILE_BYTES} bytes")
            try:
                raw = yaml.safe_load(data)
            except yaml.YAMLError as err:
                raise ConfigError(f"not valid YAML: {err}") from None
            config = parse_config(raw)
        except ConfigError as err:
            self._refused_hash = digest
            self.last_successful = False
            log.error("settings reload refused, keeping the settings in force",
                      extra={"path": str(self.path), "reason": str(err), "sha256": digest[:16]})
            return self._count("invalid")
        restart_needed = self.apply(config)
        self.current_hash, self._refused_hash = digest, None
        self.last_successful = True
        log.info("settings reloaded", extra={
            "path": str(self.path), "sha256": digest[:16], "signature": self.signature,
            "needs_restart": restart_needed or None})
        if restart_needed:
            log.warning("some changed settings take effect only after a restart",
                        extra={"fields": restart_needed})
            return self._count("partial")
        return self._count("ok")

    def _count(self, result: str) -> str:
        with self._lock:
            self.reloads_total[result] += 1
        return result

    def counts(self) -> tuple[list[tuple[str, int]], bool]:
        """(reloads seen by result, whether the last file seen was accepted), for the
        collector."""
        with self._lock:
            return sorted(self.reloads_total.items()), self.last_successful
