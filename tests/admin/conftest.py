"""The admin tests' sidecar: two agents on different ranks, hosts and jobs."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.control import two_agents_running


@pytest.fixture
def two_agents(tmp_path: Path):
    """(the sidecar, its admin address, the agents' fake sources)."""
    with two_agents_running(tmp_path) as running:
        yield running
