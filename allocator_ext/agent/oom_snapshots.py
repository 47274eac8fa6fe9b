"""Snapshots written by the agent itself when the allocator runs out of memory.

An out-of-memory error is the moment an operator most wants the allocator's layout, and the
moment it is gone once the job restarts. The agent notices a rise of `num_ooms` when it samples
and writes a snapshot beside the on-demand ones, without stack frames, capped in number (per
process: ALLOCWATCH_OOM_SNAPSHOTS, default 3, 0 for none) and in size, and at most one per
device per `min_interval` seconds. Its path is logged; like the on-demand ones, the file is
readable by the sidecar (docs/deploy.md#snapshots-and-memory-history).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from allocator_ext.agent.snapshots import DEFAULT_MAX_BYTES, write_snapshot

log = logging.getLogger("allocator_ext.agent")


class OomSnapshots:
    def __init__(self, directory: Path, rank: int, *, max_count: int | None = None,
                 max_bytes: int = DEFAULT_MAX_BYTES, min_interval: float = 60.0):
        if max_count is None:
            max_count = int(os.environ.get("ALLOCWATCH_OOM_SNAPSHOTS", "3") or 0)
        self.directory = directory
        self.rank = rank
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.min_interval = min_interval
        self.written: list[Path] = []
        self._last_ooms: dict[int, int] = {}
        self._last_at: dict[int, float] = {}

    def observe(self, source: Any, device: int, stats: Any) -> Path | None:
        """Called with each sample's statistics; writes a snapshot after a new OOM."""
        ooms = int(stats.get("num_ooms", 0) or 0)
        before = self._last_ooms.get(device)
        self._last_ooms[device] = ooms
        if before is None or ooms <= before:  # first sight, or nothing new (or a reset)
            return None
        if len(self.written) >= self.max_count:
            return None
        now = time.monotonic()
        if now - self._last_at.get(device, -1e18) < self.min_interval:
            return None
        self._last_at[device] = now
        try:
            path, size = write_snapshot(self.directory, source.snapshot(device), rank=self.rank,
                                        device=device, include_frames=False,
                                        max_bytes=self.max_bytes)
        except Exception as err:  # never let diagnostics hurt the training process
            log.warning("snapshot after out-of-memory not written",
                        extra={"device": device, "reason": repr(err)})
            return None
        self.written.append(path)
        # The path in the message itself: a program that configured no logging prints only that.
        log.warning("allocwatch: out of memory on cuda:%d: snapshot written to %s", device, path,
                    extra={"device": device, "path": str(path), "bytes": size, "num_ooms": ooms})
        return path
