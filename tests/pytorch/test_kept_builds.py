"""support.kept_builds: a kept build's folder is named by everything it is made from, builds no
run used for a while are removed, and a failed build is not kept for the next run."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
from support import kept_builds

from allocator_ext.native import build


def test_the_folder_changes_with_the_command_or_an_inputs_content_only(tmp_path: Path) -> None:
    source = tmp_path / "a.cpp"
    source.write_text("int a;\n")
    command = [sys.executable, "-O1", "a.cpp"]
    first = kept_builds.folder(tmp_path / "kept", command, [source])
    assert kept_builds.folder(tmp_path / "kept", command, [source]) == first
    assert (first / kept_builds.STAMP).is_file()
    assert kept_builds.folder(tmp_path / "kept", [*command[:1], "-O2", "a.cpp"], [source]) != first
    source.write_text("int b;\n")
    assert kept_builds.folder(tmp_path / "kept", command, [source]) != first


def test_builds_no_run_used_for_a_while_are_removed(tmp_path: Path) -> None:
    base = tmp_path / "kept"
    old = kept_builds.folder(base, [sys.executable, "old"])
    recent = kept_builds.folder(base, [sys.executable, "recent"])
    long_ago = time.time() - kept_builds.UNUSED_S - 60
    os.utime(old / kept_builds.STAMP, (long_ago, long_ago))
    kept_builds.prune(base)
    assert not old.exists() and recent.is_dir()


def test_a_kept_build_that_failed_is_tried_again_by_the_next_run(release_builds,
                                                                  tmp_path: Path) -> None:
    fails = build.Plan(key="fake-torch", command=(sys.executable, "-c", "raise SystemExit(1)",
                                                  "{output}"), describe="a fake torch")
    builds = type(release_builds)(tmp_path / "kept", [], kept=True)  # conftest.ReleaseBuilds
    try:
        with pytest.raises(build.BuildError):
            builds._built(fails)
    finally:
        builds.close()
    folder = kept_builds.folder(tmp_path / "kept", fails.command)
    assert (folder / fails.key / build.LOG_NAME).is_file()  # it was built, and failed
    assert not (folder / fails.key / build.FAILED_NAME).exists()
