"""The docs describe the tree as it is and stay inside the repository: every file and folder that
docs/architecture.md names exists (and every path of the checkout that the other docs name),
no Markdown link leaves the repository, no doc sends the reader to a document outside it, and
no doc's prose carries a commit hash: history lives in git, the docs state the present."""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from support.paths import REPO

DOCS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md"), REPO / "docs/results/README.md"])
ARCHITECTURE = REPO / "docs" / "architecture.md"
TOP = ("allocator_ext", "exporter", "protos", "deploy", "grafana", "tests", "bench", "docs",
       ".ci")
SKIPPED_DIRS = {".git", "build", "__pycache__", ".peer", "node_modules"}
# A placeholder, a glob or an elision is a pattern, not a path.
PATTERN = re.compile(r"[*{}…<>$]|\bDIR\b|\bFILE\b|\.\.\.")
FILE_NAME = re.compile(r"^[\w.-]+\.(py|pyi|cpp|h|c|map|sh|md|json|jsonl|txt|log|png|yaml|yml|"
                       r"proto|toml|pth|gz|xml|cfg|ini)$")
HEX_WORD = re.compile(r"(?<![\w/.:-])[0-9a-f]{7,40}(?![\w/.-])")


def spans(text: str) -> list[str]:
    """What the doc writes as code: inline spans and fenced blocks, fences dropped."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S)
    inline = re.findall(r"`([^`\n]+)`", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S))
    return inline + blocks


def path_tokens(span: str) -> list[str]:
    """The words of a span that name a path of the checkout (from its root), cut at `::` (a
    test's node id) or `:` (a line number)."""
    found = []
    for word in re.split(r"[\s,;()'\"=|]+", span):
        word = word.split("::")[0].split(":")[0].rstrip(".")
        if word.startswith(tuple(f"{top}/" for top in TOP)) and not PATTERN.search(word):
            found.append(word)
    return found


def tracked(folder: str) -> list[str]:
    """The files of `folder` that git tracks (every file there outside a git checkout)."""
    if shutil.which("git") and (REPO / ".git").exists():
        listed = subprocess.run(["git", "ls-files", "--", folder], cwd=REPO, text=True,
                                capture_output=True, timeout=60, check=True)
        return listed.stdout.split()
    return [str(p.relative_to(REPO)) for p in (REPO / folder).rglob("*") if p.is_file()]


def tree_names() -> set[str]:
    """The name of every file and folder of the checkout (what git tracks or would: not build
    output or scratch folders)."""
    if shutil.which("git") and (REPO / ".git").exists():
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                                cwd=REPO, text=True, capture_output=True, timeout=60, check=True)
        paths = [Path(p) for p in listed.stdout.splitlines()]
        return {part for p in paths for part in p.parts}
    return {p.name for p in REPO.rglob("*")
            if not SKIPPED_DIRS.intersection(p.relative_to(REPO).parts)}


def test_every_path_the_docs_name_exists() -> None:
    missing = sorted({(doc.name, token) for doc in DOCS for span in spans(doc.read_text())
                      for token in path_tokens(span) if not (REPO / token).exists()})
    assert missing == [], f"paths named in the docs that the tree does not have: {missing}"


def test_every_file_the_architecture_names_exists() -> None:
    # The architecture names the core's files by their bare names, in its tables.
    text = ARCHITECTURE.read_text()
    named = {word for span in spans(text) for word in re.split(r"[\s,]+", span)
             if FILE_NAME.match(word)}
    assert {"allocator.cpp", "expandable.cpp", "sim_device.cpp"} <= named  # the search works
    missing = sorted(named - tree_names())
    assert missing == [], f"files docs/architecture.md names that the tree does not have: {missing}"
    # And each file of the core is in its table: a new concept is described where it lands
    # (once committed: a file still being written is not yet the tree's).
    core = {Path(p).name for p in tracked("allocator_ext/csrc/core")}
    assert len(core) >= 10, "the core's files were not found"
    assert sorted(core - named) == [], "files of the core docs/architecture.md does not describe"


def test_the_package_tree_of_the_architecture_is_the_tree() -> None:
    # The "Python packages" block: a name at the left margin is a package of the checkout's
    # root, an indented one a module or sub-package inside it.
    block = re.search(r"## Python packages\n\n```\n(.*?)```", ARCHITECTURE.read_text(), re.S)
    assert block, "docs/architecture.md has no package tree"
    top: Path | None = None
    checked = 0
    for line in block.group(1).splitlines():
        entry = re.match(r"^( *)(\S[^ ]*(?:, \S+)*)(?:  |$)", line)
        if not entry or not re.search(r"[/.]", entry.group(2)) and len(entry.group(1)) > 20:
            continue  # a description's continuation
        names = [n.strip() for n in entry.group(2).split(",")]
        if not entry.group(1):
            top = REPO / names[0]
            paths = [top]
        elif len(entry.group(1)) <= 4 and top is not None:
            paths = [top / n for n in names]
        else:
            continue
        for path in paths:
            assert path.exists(), f"docs/architecture.md's package tree names {path}, absent"
            checked += 1
    assert checked >= 15, f"only {checked} entries read: the tree's layout changed"


def test_no_link_or_document_outside_the_repository() -> None:
    for doc in DOCS:
        text = doc.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith("#"):
                continue
            assert not re.match(r"\w+://", target), f"{doc.name} links outside: {target}"
            resolved = (doc.parent / target.split("#")[0]).resolve()
            assert resolved.is_relative_to(REPO) and resolved.exists(), (
                f"{doc.name} links to {target}, not a file of the repository")
        # A document named anywhere in the prose is one of the repository's.
        for name in set(re.findall(r"(?<![\w/.-])([\w./-]+\.md)\b", text)):
            here = [REPO / name, doc.parent / name]
            assert any(p.resolve().is_relative_to(REPO) and p.exists() for p in here) or (
                "/" not in name and name in tree_names()), (
                f"{doc.name} sends the reader to {name}, which is not in the repository")


def test_no_commit_hash_in_the_docs() -> None:
    words = {(doc.name, w) for doc in DOCS for w in HEX_WORD.findall(doc.read_text())
             if re.search(r"[a-f]", w) and re.search(r"\d", w)}
    quoted = sorted((name, w) for name, w in words
                    if any(f"`{w}`" in doc.read_text() for doc in DOCS if doc.name == name))
    assert quoted == [], f"commit-like hashes quoted in the docs: {quoted}"
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: the words cannot be looked up as commits")
    names = sorted(words)
    if names:
        looked_up = subprocess.run(["git", "cat-file", "--batch-check"], cwd=REPO,
                                   input="".join(f"{w}\n" for _, w in names), text=True,
                                   capture_output=True, timeout=60, check=True)
        commits = [name for name, answer in zip(names, looked_up.stdout.splitlines(),
                                                strict=True)
                   if answer.split()[1:2] == ["commit"] or answer.endswith("ambiguous")]
        assert commits == [], f"commits named in the docs: {commits}"


def cited_names(span: str) -> list[str]:
    """The result files a span names: not the files a command writes (after --json, --plot)."""
    words = [w for w in re.split(r"[\s,;()'\"]+", span) if w]
    return [w for before, w in zip(["", *words], words, strict=False)
            if re.search(r"\.(json|jsonl|txt|log|png|xml)$", w) and not before.startswith("-")
            and before != ">" and "/" not in w.removeprefix("docs/results/").removeprefix(
                "results/")]


def test_docs_results_holds_the_raw_files_the_docs_cite_and_only_those() -> None:
    # A figure cites its raw file by name, or a set of them by a pattern (`*`).
    results = REPO / "docs" / "results"
    cited = {word.removeprefix("docs/results/").removeprefix("results/")
             for doc in DOCS for span in spans(doc.read_text()) for word in cited_names(span)}
    files = {p.name for p in results.iterdir() if p.is_file()} - {"README.md"}
    assert len(files) >= 20, "docs/results was not found"
    uncited = sorted(f for f in files if not any(fnmatch.fnmatch(f, c) for c in cited))
    assert uncited == [], f"raw files in docs/results that no doc cites: {uncited}"
    # A cited name is a file (of docs/results, or of the tree: device_costs.json); a pattern
    # matches at least one raw file.
    names = tree_names()
    dangling = sorted(c for c in cited if not (fnmatch.filter(files, c) if "*" in c
                                               else c in files or c in names))
    assert dangling == [], f"raw files cited that do not exist: {dangling}"
