"""Which source a benchmark ran: the commit checked out, and whether the files differ from it.

A copy of the working tree (the device machine's, for one) can carry a `.git` older than its
files, so the commit alone can name code that did not run. The content hash is git's tree id
of the files as they are (tracked and untracked, .gitignore honoured), computed in a scratch
index so the checkout's own index is untouched: `git log --all --format='%h %T'` finds the
commit whose tree it is.

    python -m bench.lib.source_tree        # e.g. "1a2b3c4" or "1a2b3c4+changes (tree 9f8e7d6)"
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from bench import REPO


def _git(repo: Path, *args: str, env: dict[str, str] | None = None) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=repo, text=True, capture_output=True,
                              timeout=60, env=env)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def content_tree(repo: Path = REPO) -> str | None:
    """git's tree id of the working tree's files as they are now (None outside a checkout)."""
    git_dir = _git(repo, "rev-parse", "--absolute-git-dir")
    if git_dir is None:
        return None
    with tempfile.TemporaryDirectory() as scratch:
        index = Path(scratch) / "index"
        # Starting from the checkout's index lets git skip rehashing unchanged files. The copy
        # keeps the index's own modification time: git rehashes a file whose stat data matches
        # its entry but which changed within the second the index was written ("racy git"),
        # which a copy dated now would hide.
        if (Path(git_dir) / "index").exists():
            shutil.copy2(Path(git_dir) / "index", index)
        env = {**os.environ, "GIT_INDEX_FILE": str(index)}
        if _git(repo, "add", "-A", ".", env=env) is None:
            return None
        return _git(repo, "write-tree", env=env)


def describe(repo: Path = REPO) -> dict[str, Any]:
    """{"commit", "changed", "tree"}: `changed` is whether the files differ from the commit."""
    commit = _git(repo, "rev-parse", "HEAD")
    tree = content_tree(repo)
    committed_tree = _git(repo, "rev-parse", "HEAD^{tree}") if commit else None
    return {"commit": commit[:7] if commit else None,
            "changed": None if tree is None or committed_tree is None else tree != committed_tree,
            "tree": tree[:7] if tree else None}


def label(info: dict[str, Any] | None = None) -> str:
    """One line for logs and result files: the commit, or the commit with changes and the tree."""
    info = describe() if info is None else info
    if info["commit"] is None:
        return "not a git checkout"
    if info["changed"]:
        return f"{info['commit']}+changes (tree {info['tree']})"
    return info["commit"]


if __name__ == "__main__":
    print(label())
