"""The agent's snapshot files (allocator_ext/agent/snapshots.py): one file per snapshot, named so
that the names sort by time and none replaces another, even two of one device in the same
instant or written at once by the sampler thread (after an out-of-memory error) and a command;
each result's path and size are those of its own file, which the sidecar serves by that name."""

from __future__ import annotations

import gzip
import os
import pickle
import threading
from pathlib import Path

import pytest

from allocator_ext.agent import snapshots
from allocator_ext.agent.snapshots import write_snapshot
from exporter.admin.snapshots import open_snapshot, snapshot_name

pytestmark = pytest.mark.timeout(60)

ONE_INSTANT_NS = 1_700_000_000_123_456_789


def at_one_instant(monkeypatch: pytest.MonkeyPatch) -> None:
    """The clock stands still, and the process has written no snapshot yet (an earlier test's
    would have moved the last stamp past this instant)."""
    monkeypatch.setattr(snapshots.time, "time_ns", lambda: ONE_INSTANT_NS)
    monkeypatch.setattr(snapshots, "_last_stamp_us", 0)


def _snapshot(tag: int) -> dict:
    return {"segments": [{"tag": tag, "blocks": []}], "device_traces": []}


def _write(directory: Path, tag: int) -> tuple[Path, int]:
    return write_snapshot(directory, _snapshot(tag), rank=0, device=0, include_frames=False,
                          max_bytes=1 << 20)


def _served(directory: Path, path: Path) -> bytes:
    fd, size = open_snapshot(directory, snapshot_name(str(path)))
    with os.fdopen(fd, "rb") as f:
        data = f.read()
    assert len(data) == size
    return data


def _assert_is_its_own_file(directory: Path, path: Path, size: int, tag: int) -> None:
    assert path.parent == directory and path.stat().st_size == size
    assert pickle.loads(gzip.decompress(path.read_bytes()))["segments"][0]["tag"] == tag
    assert _served(directory, path) == path.read_bytes()


def test_two_snapshots_in_the_same_instant_are_both_kept(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    at_one_instant(monkeypatch)
    first, first_size = _write(tmp_path, 1)   # an out-of-memory snapshot, say
    second, second_size = _write(tmp_path, 2)  # then one on demand, in the same microsecond
    assert first != second
    assert sorted([second.name, first.name]) == [first.name, second.name]  # sorted by time
    assert "-20231114T221320.123456" in first.name
    _assert_is_its_own_file(tmp_path, first, first_size, 1)
    _assert_is_its_own_file(tmp_path, second, second_size, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name, second.name]


def test_two_threads_writing_at_once_both_succeed(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    at_one_instant(monkeypatch)
    # Both temporary files are written before either is renamed: the interleaving in which one
    # writer's rename used to take the other's file.
    both_written = threading.Barrier(2, timeout=10)
    replace = os.replace

    def replace_when_both_written(src, dst):
        both_written.wait()
        replace(src, dst)

    monkeypatch.setattr(snapshots.os, "replace", replace_when_both_written)
    results: dict[int, tuple[Path, int]] = {}
    errors: list[BaseException] = []

    def write(tag: int) -> None:
        try:
            results[tag] = _write(tmp_path, tag)
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=write, args=(tag,)) for tag in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == []
    assert results[1][0] != results[2][0]
    for tag, (path, size) in results.items():
        _assert_is_its_own_file(tmp_path, path, size, tag)
    assert len(list(tmp_path.iterdir())) == 2  # no temporary file left behind


def test_a_failed_write_leaves_no_temporary_file(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    def no_space(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(snapshots.os, "replace", no_space)
    with pytest.raises(OSError, match="No space"):
        _write(tmp_path, 1)
    assert list(tmp_path.iterdir()) == []
