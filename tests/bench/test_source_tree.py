"""bench/lib/source_tree.py: a benchmark's result names the source that ran, not only the commit
its .git last saw (a copy of the working tree can carry an older .git than its files)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from bench.lib import source_tree

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                          check=True, text=True, capture_output=True).stdout.strip()


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    git(tmp_path, "init", "-q")
    (tmp_path / ".gitignore").write_text("build/\n")
    (tmp_path / "core.cpp").write_text("int x = 1;\n")
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-q", "-m", "first")
    return tmp_path


def test_a_clean_checkout_is_named_by_its_commit(checkout: Path) -> None:
    info = source_tree.describe(checkout)
    assert info["commit"] == git(checkout, "rev-parse", "--short=7", "HEAD")
    assert info["changed"] is False
    assert info["tree"] == git(checkout, "rev-parse", "HEAD^{tree}")[:7]
    assert source_tree.label(info) == info["commit"]


def test_changed_files_are_named_by_their_tree_which_a_later_commit_matches(
        checkout: Path) -> None:
    (checkout / "core.cpp").write_text("int x = 2;\n")
    (checkout / "new.py").write_text("pass\n")
    info = source_tree.describe(checkout)
    assert info["changed"] is True
    assert source_tree.label(info) == f"{info['commit']}+changes (tree {info['tree']})"
    # The checkout's own index and status are left as they were.
    assert git(checkout, "status", "--porcelain") == "M core.cpp\n?? new.py".strip()
    git(checkout, "add", "-A")
    git(checkout, "commit", "-q", "-m", "second")
    assert git(checkout, "rev-parse", "HEAD^{tree}")[:7] == info["tree"]


def test_a_change_made_within_the_second_of_the_commit_counts(tmp_path: Path) -> None:
    # The same size, the same second (stat data as in the index), seen a second later: git
    # must still rehash the file, which it does only while the index it starts from keeps its
    # own modification time.
    time.sleep(1.02 - time.time() % 1)  # just after a second starts
    git(tmp_path, "init", "-q")
    (tmp_path / "core.cpp").write_text("int x = 1;\n")
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-q", "-m", "first")
    (tmp_path / "core.cpp").write_text("int x = 2;\n")
    time.sleep(1.02 - time.time() % 1)  # the next second
    assert source_tree.describe(tmp_path)["changed"] is True


def test_ignored_files_do_not_count_as_changes(checkout: Path) -> None:
    (checkout / "build").mkdir()
    (checkout / "build" / "core.o").write_bytes(b"\0")
    assert source_tree.describe(checkout)["changed"] is False


def test_outside_a_checkout_it_says_so(tmp_path: Path) -> None:
    info = source_tree.describe(tmp_path)
    assert info == {"commit": None, "changed": None, "tree": None}
    assert source_tree.label(info) == "not a git checkout"
