"""Where things are, from the repository's root."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Traces recorded on an H200, beside the checkout (absent elsewhere: the tests that need them
# skip, saying why).
SHARED_TRACES = REPO.parent / "shared" / "traces"
RECORDED_TRACES = REPO / "tests" / "data" / "traces"
