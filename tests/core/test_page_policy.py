"""The page policy's memory on its own (allocator_ext/csrc/core/page_policy.h): the high-water
mark, the ceiling and the growths that moved pages, what each remembers and what forgets it.
The checks are C++ (tests/native/page_policy_test.cpp, header-only: one compile); the rules
they serve are Note [page policy] in expandable.cpp, tested through the allocator in
test_core_rules.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from support.native_checks import run_native_checks

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")


def test_page_policy_remembers_and_forgets_as_its_note_says(tmp_path: Path) -> None:
    out = run_native_checks(tmp_path, "page_policy_test")
    assert out.count("ok  ") >= 15
