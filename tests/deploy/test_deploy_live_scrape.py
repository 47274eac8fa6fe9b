"""The dashboard and the rules against a live sidecar: start `allocwatch sidecar` (as a
process, with the ConfigMap's settings) and an agent fed by allocwatch's allocator on the
simulated device, scrape /metrics, and check that every metric the dashboard and the rules
read is really exposed, with the labels their joins use.

Also the contract of the legacy (< 1.29) manifests: `--exit-after-training` makes the sidecar
exit 0 once the trainer writes `training-done` beside the socket (docs/deploy.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from support.deploy import (
    DASHBOARD,
    DEPLOY,
    FOREIGN_METRICS,
    REPO,
    RULES,
    SIDECAR_METRICS,
    metric_names,
)
from support.fake_nvml import FakePynvml
from support.waiting import wait_for

from allocator_ext.protocol.metrics import METRICS
from bench.lib.ports import free_port

allocator_ext = pytest.importorskip("allocator_ext", reason="allocator_ext is not built")
parser = pytest.importorskip(
    "prometheus_client.parser", reason="prometheus_client is not installed"
)

agent_module = pytest.importorskip("allocator_ext.agent", reason="the agent is not importable")

# One worker under pytest-xdist: the module's sidecar and agent (`live`) start once.
pytestmark = [pytest.mark.timeout(120), pytest.mark.xdist_group("live_scrape")]

GPU_UUID = "GPU-11111111-2222-3333-4444-555555555555"
GIB = 1 << 30


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def shipped_config(tmp_path: Path, port: int) -> dict:
    """deploy/base's settings, with only the socket and the port moved into this test's reach."""
    config = yaml.safe_load((DEPLOY / "base" / "allocwatch.yaml").read_text())
    config["agents"]["unix_socket"] = str(tmp_path / "run" / "agent.sock")
    config["metrics"].update(address="127.0.0.1", port=port)
    config["nvml"]["enabled"] = False  # no GPU here: the agent reports the device figures
    config["logging"]["format"] = "logfmt"
    return config


def start_sidecar(tmp_path: Path, config: dict, *extra_args: str) -> subprocess.Popen:
    (tmp_path / "run").mkdir(exist_ok=True)
    config_path = tmp_path / "allocwatch.yaml"
    config_path.write_text(yaml.safe_dump(config))
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "exporter.cli",
            "sidecar",
            "--config",
            str(config_path),
            *extra_args,
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def stop(process: subprocess.Popen) -> str:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
    return process.stdout.read() if process.stdout else ""


class Scrape:
    def __init__(self, text: str):
        self.samples: list[tuple[str, dict[str, str], float]] = []
        self.families: set[str] = set()
        for family in parser.text_string_to_metric_families(text):
            # The parser strips _total from counter families; put it back to compare names.
            self.families.add(family.name + "_total" if family.type == "counter" else family.name)
            for sample in family.samples:
                self.samples.append((sample.name, dict(sample.labels), sample.value))
        self.names = {name for name, _, _ in self.samples}

    def series(self, name: str) -> list[dict[str, str]]:
        return [labels for n, labels, _ in self.samples if n == name]


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[Scrape]:
    tmp_path = tmp_path_factory.mktemp("live")
    port = free_port()
    config = shipped_config(tmp_path, port)
    sidecar = start_sidecar(tmp_path, config)
    base = f"http://127.0.0.1:{port}"
    agent = None
    try:
        wait_for(
            lambda: sidecar.poll() is not None or http_get(base + "/healthz")[0] == 200,
            what="the sidecar's /healthz", timeout=30.0, interval=0.1,
        )
        assert sidecar.poll() is None, f"the sidecar exited:\n{stop(sidecar)}"

        # A training process in miniature: allocwatch's allocator on the simulated device,
        # a little traffic (a cached block, a cache release), and the agent publishing it.
        allocator = allocator_ext.Allocator(allocator_ext.SimDevice(80 * GIB))
        kept = [allocator.malloc(size) for size in (3 << 20, 64 << 20, 512)]
        allocator.free(allocator.malloc(200 << 20))
        allocator.empty_cache()
        agent = agent_module.start_agent(
            target=f"unix://{config['agents']['unix_socket']}",
            interval=0.2,
            source=allocator,
            identity={
                "rank": 3,
                "local_rank": 3,
                "world_size": 8,
                "cuda_device": 0,
                "training_job": "live",
            },
            # The agent reads NVML for the device figures, as it does in Kubernetes, where the
            # sidecar sees no GPU.
            nvml=FakePynvml([(GPU_UUID, 80 * GIB, 20 * GIB, {os.getpid(): 18 * GIB})]),
            stop_at_exit=False,
        )

        def scraped_with_device_figures() -> Scrape | None:
            scrape = Scrape(http_get(base + "/metrics")[1])
            wanted = {"torch_cuda_allocator_reserved_bytes", "allocwatch_gpu_memory_total_bytes"}
            return scrape if wanted <= scrape.names else None

        scrape = wait_for(scraped_with_device_figures, timeout=30.0, interval=0.1,
                          what="the agent's first report on /metrics")
        scrape.health = {path: http_get(base + path)[0] for path in ("/healthz", "/readyz")}
        yield scrape
        del kept
    finally:
        if agent is not None:
            agent.stop()
        stop(sidecar)


def dashboard_metric_names() -> set[str]:
    board = json.loads(DASHBOARD.read_text())
    names: set[str] = set()
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            names |= metric_names(target["expr"])
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"]
            names |= metric_names(query[len("label_values(") : query.rindex(",")])
    return names


def rule_metric_names() -> set[str]:
    names: set[str] = set()
    for path in (RULES / "alerts.yaml", RULES / "recording.yaml"):
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                names |= metric_names(rule["expr"])
    return names


def test_probes_answer(live: Scrape) -> None:
    assert live.health == {"/healthz": 200, "/readyz": 200}


def test_every_dashboard_metric_is_exposed(live: Scrape) -> None:
    wanted = dashboard_metric_names() - FOREIGN_METRICS
    assert len(wanted) >= 25
    missing = wanted - live.names - live.families
    assert not missing, (
        f"the dashboard reads metrics the sidecar does not expose: {sorted(missing)}"
    )


def test_every_rule_metric_is_exposed(live: Scrape) -> None:
    missing = rule_metric_names() - FOREIGN_METRICS - live.names - live.families
    assert not missing, f"the rules read metrics the sidecar does not expose: {sorted(missing)}"


def test_the_design_names_are_what_the_sidecar_exposes(live: Scrape) -> None:
    """tests/support/deploy.SIDECAR_METRICS (the metric table: what the static checks allow)
    matches reality: every metric is exposed, but the admin API's (off in these settings)."""
    admin = {metric.name for metric in METRICS if metric.collector == "admin"}
    assert admin and admin <= SIDECAR_METRICS
    missing = SIDECAR_METRICS - admin - live.names - live.families
    assert not missing, sorted(missing)


def test_allocator_series_carry_the_labels_the_dashboard_uses(live: Scrape) -> None:
    reserved = live.series("torch_cuda_allocator_reserved_bytes")
    totals = [labels for labels in reserved if "pool" not in labels]
    # Totals and the pool breakdown have names of their own: sum() counts each byte once.
    assert len(totals) == 1 and totals == reserved, reserved
    assert (
        totals[0]["rank"] == "3"
        and totals[0]["local_rank"] == "3"
        and totals[0]["cuda_device"] == "0"
    )
    assert totals[0]["gpu_uuid"] == GPU_UUID
    pools = live.series("torch_cuda_allocator_pool_reserved_bytes")
    assert sorted(labels["pool"] for labels in pools) == ["large", "small"]
    # No pod/namespace on allocator series: Prometheus adds the target's own.
    for name, labels, _ in live.samples:
        if name.startswith("torch_cuda_allocator_"):
            assert not {"pod", "namespace"} & labels.keys(), name


def test_device_series_join_the_allocator_series_by_gpu_uuid(live: Scrape) -> None:
    """The dashboard and AllocwatchReservedNearCapacity join NVML figures to ranks on gpu_uuid."""
    allocator_uuids = {
        labels["gpu_uuid"] for labels in live.series("torch_cuda_allocator_reserved_bytes")
    }
    for name in ("allocwatch_gpu_memory_total_bytes", "allocwatch_gpu_memory_used_bytes"):
        device_uuids = {labels["gpu_uuid"] for labels in live.series(name)}
        assert device_uuids and device_uuids <= allocator_uuids, name
    total = [v for n, labels, v in live.samples if n == "allocwatch_gpu_memory_total_bytes"]
    assert total == [80 * GIB]


def test_info_series_carries_the_training_job(live: Scrape) -> None:
    [info] = live.series("torch_cuda_allocator_info")
    assert info["training_job"] == "live" and info["backend"] == "allocwatch"


def test_counters_reflect_the_allocators_traffic(live: Scrape) -> None:
    values = {
        name: v
        for name, labels, v in live.samples
        if "pool" not in labels and labels.get("rank") == "3"
    }
    assert values["torch_cuda_allocator_empty_cache_calls_total"] >= 1
    assert values["torch_cuda_allocator_allocations_total"] >= 4
    assert values["torch_cuda_allocator_allocated_bytes"] > 64 << 20


def test_exit_after_training_ends_the_sidecar_when_the_trainer_is_done(tmp_path: Path) -> None:
    """The legacy manifests' contract (deploy/examples/job-legacy-sidecar, docs/deploy.md)."""
    port = free_port()
    config = shipped_config(tmp_path, port)
    sidecar = start_sidecar(tmp_path, config, "--exit-after-training")
    try:
        wait_for(
            lambda: (
                sidecar.poll() is not None or http_get(f"http://127.0.0.1:{port}/healthz")[0] == 200
            ),
            what="the sidecar's /healthz", timeout=30.0, interval=0.1,
        )
        assert sidecar.poll() is None, (
            f"the sidecar does not run with --exit-after-training:\n{stop(sidecar)}"
        )
        time.sleep(1.0)
        assert sidecar.poll() is None, "the sidecar exited before training finished"
        (Path(config["agents"]["unix_socket"]).parent / "training-done").touch()
        returncode = sidecar.wait(timeout=30)
        assert returncode == 0
    finally:
        stop(sidecar)
