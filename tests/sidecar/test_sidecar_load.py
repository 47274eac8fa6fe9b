"""The load benchmark, small: many agents into one sidecar, scraped by one and by several
scrapers, then with idle connections held open: nothing lost, no scrape failed, and the
sidecar holds no more connections than its limit. The full run (64 agents, 4 scrapers, 1,000
idle connections) and the 10-minute soak are `python -m bench.sidecar.sidecar_load` (marked
slow here)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.paths import REPO

from exporter.shared.bounded_http import HttpLimits

MODULE = "bench.sidecar.sidecar_load"


def _run(*args: str, timeout: float) -> dict:
    result = subprocess.run([sys.executable, "-m", MODULE, "--json", *args], cwd=REPO,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(150)
def test_sixteen_agents_three_phases_nothing_lost_no_scrape_failed() -> None:
    figures = _run("--agents", "16", "--rate", "10", "--workers", "2", "--single-seconds", "3",
                   "--duration", "3", "--idle-connections", "400", timeout=130)
    single, crowd, idle = figures["phases"]
    assert (single["scrapers"], crowd["scrapers"], idle["scrapers"]) == (1, 4, 4)
    assert figures["reports_lost"] == 0 and figures["scrape_failures"] == 0
    assert figures["reports_received"] >= 16 * 10 * 9  # most of the phases' 9 s at 10/s
    assert min(phase["scrapes"] for phase in figures["phases"]) >= 5
    assert all(phase["reports_in_phase"] > 0 for phase in figures["phases"])
    # The sidecar closed connections past its limit and held no more than it.
    limit = HttpLimits().max_connections
    assert idle["idle_closed_by_sidecar"] > 0
    assert 0 < idle["sidecar_http_connections_at_end"] <= limit
    assert figures["sidecar_connections_closed"]["reason=idle_evicted,server=metrics"] > 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_soak_64_agents_ten_minutes() -> None:
    figures = _run("--single-seconds", "600", "--duration", "0", timeout=800)
    assert figures["reports_lost"] == 0 and figures["scrape_failures"] == 0
    # Memory flat: the sidecar's RSS grows by less than 20 % over the run.
    assert figures["sidecar_rss_end_mib"] < 1.2 * figures["sidecar_rss_start_mib"] + 5
