"""The page policy's memory on its own (allocator_ext/csrc/core/page_policy.h): the high-water
mark, the ceiling and the growths that moved pages, what each remembers and what forgets it.
The checks are C++ (tests/native/page_policy_test.cpp, header-only: one compile); the rules
they serve are Note [page policy] in expandable.cpp, tested through the allocator in
test_core_rules.py."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from support.paths import REPO

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")


def test_page_policy_remembers_and_forgets_as_its_note_says(tmp_path: Path) -> None:
    exe = tmp_path / "page_policy_test"
    subprocess.run(["c++", "-std=c++17", "-Wall", "-Wextra", "-Werror",
                    f"-I{REPO / 'allocator_ext' / 'csrc'}",
                    str(REPO / "tests" / "native" / "page_policy_test.cpp"), "-o", str(exe)],
                   check=True, timeout=300)
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "FAIL" not in out.stdout
    assert out.stdout.count("ok  ") >= 15
