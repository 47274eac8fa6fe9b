"""The environment a test's subprocess starts from: this one, less any ALLOCWATCH_ variable the
machine running the tests happens to set, plus the test's own."""

from __future__ import annotations

import os


def without_allocwatch(**values: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ALLOCWATCH_")}
    env.update(values)
    return env
