"""End to end over a real Unix socket and real HTTP: agents publish, /metrics shows it."""

from __future__ import annotations

import gzip
import os
import stat
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_parse
from prometheus_client.parser import text_string_to_metric_families
from support.sidecar import FakeSource, MiB, samples, scrape, start_sidecar, tcp_token, values
from support.waiting import wait_for

from allocator_ext.agent import start_agent
from allocator_ext.protocol.metrics import METRICS
from bench.lib.ports import free_port
from exporter.agents.grpc_server import ListenError

pytestmark = pytest.mark.timeout(60)

# Every metric of the table with a sample from an agent's first report on, as exposed
# (counters with _total, info with _info).
SAMPLED_NAMES = [metric.name for metric in METRICS if metric.always]
# The families of the others, which appear (without samples) once their collector runs: all but
# the admin API's (off here) and the settings file's watcher (no file here).
FAMILIES_WITHOUT_SAMPLES_YET = [metric.family for metric in METRICS if not metric.always
                                and metric.collector not in ("admin", "sidecar")]


@pytest.fixture
def sidecar(tmp_path: Path):
    running = start_sidecar(tmp_path, expiry=1.0)
    yield running
    running.stop()


def _agent(sidecar, source, **identity):
    return start_agent(sidecar.sidecar.agent_targets[0], interval=0.1, source=source,
                       identity=identity, nvml=False, stop_at_exit=False)


def test_counters_reach_metrics_with_the_design_names(sidecar) -> None:
    url = sidecar.sidecar.metrics_url
    source = FakeSource()
    agent = _agent(sidecar, source, rank=0, local_rank=0, world_size=1)
    try:
        wait_for(lambda: values(url, "torch_cuda_allocator_reserved_bytes"), what="first report")
        source.bump(num_alloc_retries=3, num_ooms=1, num_device_alloc=2)
        wait_for(lambda: values(url, "torch_cuda_allocator_alloc_retries_total") == [3.0],
                 what="retries to reach /metrics")
        text, headers = scrape(url)
        assert headers["content-type"].startswith("text/plain; version=0.0.4")
        families = {f.name: f for f in text_string_to_metric_families(text)}
        found = {s.name for f in families.values() for s in f.samples}
        missing = [n for n in SAMPLED_NAMES if n not in found]
        assert not missing, f"names missing from /metrics: {missing}"
        missing = [n for n in FAMILIES_WITHOUT_SAMPLES_YET if n not in families]
        assert not missing, f"families missing from /metrics: {missing}"
        assert len(SAMPLED_NAMES) > 40 and "allocwatch_commands" in FAMILIES_WITHOUT_SAMPLES_YET

        labels = {"rank": "0", "local_rank": "0", "cuda_device": "0", "gpu_uuid": "GPU-fake-0"}
        got = samples(url)
        key = lambda name, **extra: (name, tuple(sorted({**labels, **extra}.items())))  # noqa: E731
        assert got[key("torch_cuda_allocator_reserved_bytes")] == 40 * MiB
        assert got[key("torch_cuda_allocator_pool_reserved_bytes", pool="small")] == 12 * MiB
        assert got[key("torch_cuda_allocator_pool_reserved_bytes", pool="large")] == 28 * MiB
        assert not [n for (n, ls) in got if n == "torch_cuda_allocator_reserved_bytes"
                    and "pool" in dict(ls)], "totals and the pool split share no name"
        assert got[key("torch_cuda_allocator_fragmentation_ratio")] == pytest.approx(0.25)
        # A source without interval peaks: its peaks since the last reset, 35 of 44 MiB.
        assert got[key("torch_cuda_allocator_peak_fragmentation_ratio")] == pytest.approx(9 / 44)
        assert got[key("torch_cuda_allocator_ooms_total")] == 1
        assert got[key("torch_cuda_allocator_device_mallocs_total")] == 9
        assert got[key("torch_cuda_allocator_max_split_size_bytes")] == float("inf")
        info = [dict(ls) for (n, ls), v in got.items() if n == "torch_cuda_allocator_info"]
        assert info and info[0]["pid"] == str(os.getpid()) and info[0]["backend"] == "allocwatch"
        assert "pod" not in info[0] and "namespace" not in info[0]
        # No pid/pod/namespace labels on allocator series.
        for (name, label_items), _ in got.items():
            if name.startswith("torch_cuda_allocator_") and name != "torch_cuda_allocator_info":
                assert not {"pid", "pod", "namespace"} & dict(label_items).keys(), name
        assert got[("allocwatch_agents_connected", ())] == 1
    finally:
        agent.stop()


def test_openmetrics_when_asked_and_gzip(sidecar) -> None:
    url = sidecar.sidecar.metrics_url
    agent = _agent(sidecar, FakeSource(), rank=0)
    try:
        wait_for(lambda: values(url, "torch_cuda_allocator_reserved_bytes"), what="first report")
        text, headers = scrape(url, accept="application/openmetrics-text; version=1.0.0",
                               gzip_ok=True)
        assert headers["content-encoding"] == "gzip"
        assert headers["content-type"].startswith("application/openmetrics-text")
        assert text.endswith("# EOF\n")
        names = {f.name for f in om_parse(text)}
        assert "torch_cuda_allocator_alloc_retries" in names  # counter family, _total samples
        assert "torch_cuda_allocator" in names  # the info family
        # Plain request: no compression.
        request = urllib.request.Request(url + "/metrics")
        with urllib.request.urlopen(request, timeout=5) as response:
            assert response.headers.get("Content-Encoding") is None
            body = response.read()
        with pytest.raises(OSError):
            gzip.decompress(body)
    finally:
        agent.stop()


def test_health_ready_and_landing_page(sidecar) -> None:
    url = sidecar.sidecar.metrics_url
    agent = _agent(sidecar, FakeSource(), rank=5, training_job="llm<script>")
    try:
        wait_for(lambda: values(url, "allocwatch_agents_connected") == [1.0], what="agent")
        for path, body in (("/healthz", b"ok\n"), ("/readyz", b"ready\n")):
            with urllib.request.urlopen(url + path, timeout=5) as response:
                assert response.status == 200 and response.read() == body
        with urllib.request.urlopen(url + "/", timeout=5) as response:
            page = response.read().decode()
        assert "llm&lt;script&gt;" in page and "<script>" not in page  # escaped
        assert f"<td>{os.getpid()}</td>" in page and "<td>5</td>" in page
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url + "/nothing", timeout=5)
        assert err.value.code == 404
    finally:
        agent.stop()


def test_socket_mode_restricts_access(sidecar) -> None:
    path = Path(sidecar.sidecar.agent_targets[0].removeprefix("unix://"))
    mode = stat.S_IMODE(path.stat().st_mode)
    assert stat.S_ISSOCK(path.stat().st_mode)
    assert mode == 0o660, oct(mode)


def test_several_agents_each_with_own_series_and_departed_one_expires(sidecar) -> None:
    url = sidecar.sidecar.metrics_url
    sources = [FakeSource({r: f"GPU-{r}"}) for r in range(3)]
    for rank, source in enumerate(sources):
        source.bump(rank, num_alloc_retries=rank + 1)
    agents = [_agent(sidecar, s, rank=r, local_rank=r, world_size=3)
              for r, s in enumerate(sources)]
    try:
        def by_rank() -> dict[str, float]:
            return {dict(ls)["rank"]: v for (n, ls), v in samples(url).items()
                    if n == "torch_cuda_allocator_alloc_retries_total"}
        wait_for(lambda: by_rank() == {"0": 1.0, "1": 2.0, "2": 3.0}, what="three ranks")
        devices = {dict(ls)["cuda_device"]: dict(ls)["gpu_uuid"] for (n, ls), _ in
                   samples(url).items() if n == "torch_cuda_allocator_reserved_bytes"}
        assert devices == {"0": "GPU-0", "1": "GPU-1", "2": "GPU-2"}

        departed = time.monotonic()  # before stop(): the sidecar sees the departure later
        agents[1].stop()
        wait_for(lambda: values(url, "allocwatch_agents_connected") == [2.0], what="departure")
        # The series stay until the expiry time (1 s here), then go; the others stay.
        wait_for(lambda: "1" not in by_rank(), timeout=10, what="expiry")
        assert time.monotonic() - departed >= 0.9
        assert by_rank() == {"0": 1.0, "2": 3.0}
    finally:
        for agent in agents:
            agent.stop()


def test_tcp_listener_on_loopback(tmp_path: Path) -> None:
    running = start_sidecar(tmp_path, tcp=True)
    try:
        tcp_target = running.sidecar.agent_targets[1]
        assert tcp_target.startswith("127.0.0.1:")
        url = running.sidecar.metrics_url
        agent = start_agent(tcp_target, interval=0.1, source=FakeSource(), nvml=False,
                            stop_at_exit=False, token=tcp_token(tmp_path))
        try:
            wait_for(lambda: values(url, "torch_cuda_allocator_reserved_bytes"), what="report")
        finally:
            agent.stop()
    finally:
        running.stop()


def test_metrics_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    port = free_port()
    first = start_sidecar(tmp_path / "a", metrics_port=port)
    try:
        with pytest.raises(ListenError, match=rf"the metrics listener cannot listen on "
                           rf"\S+:{port} \(metrics.address and port, --web.listen-address\): "
                           "Address already in use"):
            start_sidecar(tmp_path / "b", metrics_port=port)
    finally:
        first.stop()


def test_info_series_follows_the_devices_reported_not_only_the_hello(sidecar) -> None:
    """Under `allocwatch run` the agent starts before the script picks its device, and its
    hello names at most the first device it reports: the info series still carries each
    reported device's labels, so joins on them match."""
    url = sidecar.sidecar.metrics_url
    agent = start_agent(sidecar.sidecar.agent_targets[0], interval=0.1,
                        source=FakeSource({0: "GPU-aaaa", 1: "GPU-bbbb"}), cuda_device=-1,
                        identity={"rank": 3}, nvml=False, stop_at_exit=False)
    try:
        assert agent.identity.gpu_uuid in ("", "GPU-aaaa")  # never the second device
        def info_labels() -> set[tuple[str, str]]:
            return {(dict(ls)["cuda_device"], dict(ls)["gpu_uuid"])
                    for (n, ls), _ in samples(url).items() if n == "torch_cuda_allocator_info"}

        wait_for(lambda: values(url, "torch_cuda_allocator_reserved_bytes"), what="a report")
        assert info_labels() == {("0", "GPU-aaaa"), ("1", "GPU-bbbb")}
    finally:
        agent.stop()
