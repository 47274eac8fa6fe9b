"""Writing a file that another thread or process is watching."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any


def replace_text(path: Path, text: str) -> None:
    """Write `text` to a sibling and rename it over `path`: a watcher sees the old content or
    the new, never the empty or cut file that `Path.write_text` (truncate, then write) shows
    for a moment. Tests that mean to show a watcher a write in progress feed it the readings
    themselves."""
    staged = path.with_name(f".{path.name}.staged")
    staged.write_text(text)
    os.replace(staged, path)


class MountedVolume:
    """A Secret or ConfigMap volume as the kubelet lays it out: each version in a directory of
    its own, `..data` a symlink to the current one, `NAME` a symlink through `..data`.
    `publish(text)` makes a new version current with one atomic rename, as the kubelet does."""

    def __init__(self, root: Path, name: str):
        self.root, self.name = root, name
        self.path = root / name
        self._versions = 0

    def publish(self, text: str) -> None:
        self._versions += 1
        version = f"..v{self._versions}"
        (self.root / version).mkdir(parents=True)
        (self.root / version / self.name).write_text(text)
        (self.root / "..data_tmp").symlink_to(version)
        os.replace(self.root / "..data_tmp", self.root / "..data")
        if not self.path.is_symlink():
            self.path.symlink_to(f"..data/{self.name}")


def hang_token_file(monkeypatch: Any, path: Path) -> tuple[threading.Event, list[str]]:
    """Makes the token checks' look at `path` (exporter.shared.tokens.content_stamp) block until the
    returned event is set, as a token file on a network mount that stopped answering does: no
    mount can be made to hang here (no NFS server, no FUSE). The list gathers the names of the
    threads held up."""
    from exporter.shared import tokens

    release, held = threading.Event(), []
    real_stamp = tokens.content_stamp

    def hanging_stamp(name: str | Path) -> tokens.Stamp | None:
        if Path(name) == path:
            held.append(threading.current_thread().name)
            release.wait(30)
        return real_stamp(name)

    monkeypatch.setattr(tokens, "content_stamp", hanging_stamp)
    return release, held
