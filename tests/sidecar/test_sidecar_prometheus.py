"""The real tools on a real scrape: promtool's linter, and a Prometheus server scraping the
sidecar and answering a query through its HTTP API."""

from __future__ import annotations

import json
import shutil
import subprocess
import textwrap
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from support.sidecar import FakeSource, scrape, start_sidecar, values
from support.waiting import terminate, wait_for

from allocator_ext.agent import start_agent
from bench.lib.ports import free_port

pytestmark = pytest.mark.timeout(120)

PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")


@pytest.fixture
def publishing(tmp_path: Path):
    running = start_sidecar(tmp_path / "sidecar")
    url = running.sidecar.metrics_url
    source = FakeSource({0: "GPU-aaaa", 1: "GPU-bbbb"})
    source.bump(1, num_alloc_retries=4)
    agent = start_agent(running.sidecar.agent_targets[0], interval=0.1, source=source,
                        identity={"rank": 2, "local_rank": 0, "world_size": 4,
                                  "training_job": "llm"}, nvml=False, stop_at_exit=False)
    wait_for(lambda: len(values(url, "torch_cuda_allocator_reserved_bytes")) == 2, what="report")
    yield url
    agent.stop()
    running.stop()


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian: apt-get install "
                    "prometheus); CI installs it")
def test_promtool_finds_no_problem(publishing: str) -> None:
    # promtool lints the Prometheus text format only (it cannot parse OpenMetrics' "info" type);
    # the OpenMetrics output is checked by prometheus_client's strict parser in
    # test_sidecar_e2e.py, and by the Prometheus server below, which asks for it.
    text, _ = scrape(publishing)
    assert "torch_cuda_allocator_alloc_retries_total" in text
    assert PROMTOOL is not None
    result = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0 and not result.stdout.strip() and not result.stderr.strip(), (
        result.stdout + result.stderr)


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (Debian: apt-get "
                    "install prometheus); CI installs it")
def test_prometheus_scrapes_the_sidecar_and_answers_a_query(publishing: str, tmp_path: Path
                                                            ) -> None:
    target = publishing.removeprefix("http://")
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(textwrap.dedent(f"""\
        global:
          scrape_interval: 1s
        scrape_configs:
          - job_name: allocwatch
            scrape_interval: 1s
            static_configs:
              - targets: ["{target}"]
        """))
    assert PROMETHEUS is not None
    server = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    api = f"http://127.0.0.1:{port}/api/v1/query?query="

    def query(promql: str) -> list[dict]:
        with urllib.request.urlopen(api + urllib.parse.quote(promql), timeout=5) as response:
            body = json.load(response)
        assert body["status"] == "success"
        return body["data"]["result"]

    try:
        result = wait_for(lambda: query('torch_cuda_allocator_alloc_retries_total{rank="2"}'),
                          timeout=60, interval=0.5, what="Prometheus to scrape the sidecar")
        by_device = {r["metric"]["cuda_device"]: float(r["value"][1]) for r in result}
        assert by_device == {"0": 0.0, "1": 4.0}
        sample = next(r["metric"] for r in result if r["metric"]["cuda_device"] == "1")
        assert sample["gpu_uuid"] == "GPU-bbbb" and sample["job"] == "allocwatch"
        # The target is healthy in Prometheus' eyes, and the info series joins on labels.
        assert query(f'up{{instance="{target}"}}')[0]["value"][1] == "1"
        joined = query('torch_cuda_allocator_reserved_bytes{pool=""} * on(rank, cuda_device) '
                       'group_left(training_job) torch_cuda_allocator_info')
        assert {r["metric"].get("training_job") for r in joined} == {"llm"}
        # Every device of the process joins, not only the one its hello named.
        assert {r["metric"]["cuda_device"] for r in joined} == {"0", "1"}
    finally:
        terminate(server, 20)
