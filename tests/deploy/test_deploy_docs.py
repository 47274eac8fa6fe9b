"""The manifests, the code and the docs point users at sections of docs/deploy.md by anchor
(`docs/deploy.md#the-metrics-port`): each anchor named anywhere is a heading there."""

from __future__ import annotations

import re

from support.paths import REPO

DEPLOY_DOC = REPO / "docs" / "deploy.md"
WHERE = ("deploy", "docs", "exporter", "allocator_ext", "grafana", "README.md")


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_anchor_into_the_deploy_doc_is_one_of_its_headings() -> None:
    headings = {anchor(m) for m in re.findall(r"^#{2,4} (.+)$", DEPLOY_DOC.read_text(), re.M)}
    assert {"the-release-label", "the-metrics-port"} <= headings  # the rule itself
    files = [p for name in WHERE for p in ((REPO / name).rglob("*") if (REPO / name).is_dir()
                                           else [REPO / name])
             if p.is_file() and p.suffix in (".md", ".py", ".yaml", ".json", "")]
    named = {(str(p.relative_to(REPO)), a) for p in files
             for a in re.findall(r"deploy\.md#([\w-]+)", p.read_text(errors="replace"))}
    assert named, "no anchor found: the search is broken"
    missing = sorted((path, a) for path, a in named if a not in headings)
    assert missing == [], f"anchors into docs/deploy.md that name no heading: {missing}"
