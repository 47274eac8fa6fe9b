"""The load benchmark, small: many agents into one sidecar, nothing lost. The full 64-agent run
and the 10-minute soak are `python bench/sidecar/sidecar_load.py [--duration 600]` (marked slow
here)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.paths import REPO

BENCH = REPO / "bench" / "sidecar" / "sidecar_load.py"


def _run(*args: str, timeout: float) -> dict:
    result = subprocess.run([sys.executable, str(BENCH), "--json", *args], capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(120)
def test_sixteen_agents_nothing_lost() -> None:
    figures = _run("--agents", "16", "--rate", "10", "--duration", "6", "--workers", "2",
                   timeout=100)
    assert figures["agents_connected_max"] == 16
    assert figures["reports_lost"] == 0
    assert figures["reports_received"] >= 16 * 10 * 4  # most of 6 s at 10/s, after start-up
    assert figures["scrapes"] >= 2


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_soak_64_agents_ten_minutes() -> None:
    figures = _run("--duration", "600", timeout=800)
    assert figures["reports_lost"] == 0 and figures["agents_connected_max"] == 64
    # Memory flat: the sidecar's RSS grows by less than 20 % over the run.
    assert figures["sidecar_rss_end_mib"] < 1.2 * figures["sidecar_rss_start_mib"] + 5
