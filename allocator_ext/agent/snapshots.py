"""Allocator snapshots written by the agent for the sidecar to fetch.

Files are gzip-compressed pickles in the layout of torch.cuda.memory._snapshot(), so PyTorch's
memory viewer opens them (`gunzip -c F | python -m torch.cuda._memory_viz trace_plot - -o
F.html`). Stack frames (which hold source paths) are removed unless asked for. A file is named
for its host, process, rank, device and UTC time to the microsecond
(snapshot-HOST-PID-rankR-cudaD-YYYYMMDDTHHMMSS.ffffff.pickle.gz, norank for no rank), the time
strictly increasing within a process, so that names sort by time and no snapshot replaces
another. Files are readable by owner and group only, whatever the process's umask: the sidecar
makes the directory set-group-ID (exporter/admin/snapshot_dir.py), so they belong to its group
whoever writes them.
"""

from __future__ import annotations

import gzip
import os
import pickle
import socket
import threading
import time
from pathlib import Path
from typing import Any

from allocator_ext.agent.history import with_starting_state
from allocator_ext.protocol.files import write_whole

DEFAULT_MAX_BYTES = 256 << 20
FILE_MODE = 0o640


def strip_frames(value: Any) -> Any:
    """A copy without any 'frames' entries (blocks, trace entries)."""
    if isinstance(value, dict):
        return {k: ([] if k == "frames" else strip_frames(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [strip_frames(v) for v in value]
    return value


def write_snapshot(directory: Path, snapshot: dict[str, Any], *, rank: int, device: int,
                   include_frames: bool, max_bytes: int) -> tuple[Path, int]:
    """Write the snapshot; returns (path, size). ValueError when larger than max_bytes.

    A history that began with memory in use is preceded by that state (agent.history), so
    that the file replays."""
    snapshot = with_starting_state(snapshot)
    if not include_frames:
        snapshot = strip_frames(snapshot)
    data = gzip.compress(pickle.dumps(snapshot, protocol=4), compresslevel=6)
    if len(data) > max_bytes:
        raise ValueError(f"the snapshot is {len(data)} bytes compressed, above the cap of "
                         f"{max_bytes} bytes")
    directory.mkdir(mode=0o750, parents=True, exist_ok=True)
    rank_part = f"rank{rank}" if rank >= 0 else "norank"
    host = socket.gethostname()
    name = (f"snapshot-{host}-{os.getpid()}-{rank_part}-cuda{device}-{_unique_stamp()}"
            ".pickle.gz")
    path = directory / name
    # The sidecar never sees a half-written file, and the sampler thread (after an OOM) and a
    # command may write at once; a umask of 077 must not hide the file from the group.
    write_whole(path, data, mode=FILE_MODE)
    return path, len(data)


_stamp_lock = threading.Lock()
_last_stamp_us = 0


def _unique_stamp() -> str:
    """UTC to the microsecond, strictly increasing within the process: names sort by time, and
    two snapshots of one device in the same instant do not replace each other."""
    global _last_stamp_us
    with _stamp_lock:
        _last_stamp_us = max(time.time_ns() // 1000, _last_stamp_us + 1)
        stamp_us = _last_stamp_us
    seconds, micros = divmod(stamp_us, 1_000_000)
    return f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime(seconds))}.{micros:06d}"


def _new_stamp_lock_in_child() -> None:
    # A thread of the parent may have held it at the fork; the child must not wait on it.
    global _stamp_lock
    _stamp_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_stamp_lock_in_child)
