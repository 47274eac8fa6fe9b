"""The /metrics body is what prometheus_client's own writers make of the same families, byte for
byte, in every format a scraper can negotiate: the text format (0.0.4, and 1.0.0 under each
escaping), OpenMetrics (under each escaping). The families are a live sidecar's, with two
agents reporting (one of them on two GPUs, with label values that need escaping), plus families
of kinds the sidecar does not build (a histogram, a counter with its creation time, a sample
with a timestamp, a gauge with a unit)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.openmetrics.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString
from support.fake_nvml import FakePynvml
from support.sidecar import FakeSource, scrape, start_sidecar
from support.waiting import wait_for

from allocator_ext.agent import start_agent
from exporter.metrics.exposition_format import ExpositionWriter, go_float

ACCEPTS = [
    "",
    "text/plain;version=0.0.4",
    "text/plain;version=1.0.0;escaping=underscores",
    "text/plain;version=1.0.0;escaping=allow-utf-8",
    "text/plain;version=1.0.0;escaping=dots",
    "application/openmetrics-text",
    "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8",
    "application/openmetrics-text;version=1.0.0;escaping=dots",
    "application/openmetrics-text;version=1.0.0;escaping=values",
]


class Frozen(Collector):
    """Families collected once: both writers see the same figures."""

    def __init__(self, families: Iterable[Metric]):
        self.families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def other_kinds() -> list[Metric]:
    histogram = HistogramMetricFamily("bench_latency_seconds", "A histogram",
                                      labels=["path"])
    histogram.add_metric(["/metrics"], [("0.1", 3.0), ("+Inf", 5.0)], sum_value=0.7)
    created = CounterMetricFamily("bench_requests", "A counter with its creation time",
                                  labels=["code"], created=1.7e9)
    created.add_metric(["200"], 12, created=1.7e9)
    stamped = GaugeMetricFamily("bench_stamped", "A sample with a timestamp")
    stamped.add_metric([], 1.0, timestamp=1.7e9)
    unit = GaugeMetricFamily("bench_size_bytes", "A gauge with a unit", unit="bytes")
    unit.add_metric([], 2.0)
    return [histogram, created, stamped, unit]


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Frozen]:
    tmp_path: Path = tmp_path_factory.mktemp("exposition")
    nvml = FakePynvml([("GPU-a", 80 << 30, 10 << 30, {os.getpid(): 3 << 30})])
    running = start_sidecar(tmp_path, nvml_module=nvml)
    target = running.sidecar.agent_targets[0]
    agents = [
        start_agent(target, interval=0.05, source=FakeSource({0: "GPU-a", 1: "GPU-b"}),
                    identity={"rank": 0, "training_job": 'quote " slash \\ line \n end'},
                    nvml=False, stop_at_exit=False),
        start_agent(target, interval=0.05, source=FakeSource({0: "GPU-c"}),
                    identity={"rank": 1}, nvml=False, stop_at_exit=False),
    ]
    try:
        wait_for(lambda: 'GPU-c' in scrape(running.sidecar.metrics_url)[0]
                 and 'GPU-b' in scrape(running.sidecar.metrics_url)[0], timeout=20)
        yield Frozen([*running.sidecar.metrics_registry.collect(), *other_kinds()])
    finally:
        for agent in agents:
            agent.stop(2.0)
        running.stop()


@pytest.mark.parametrize("accept", ACCEPTS)
def test_the_body_is_prometheus_clients_own_byte_for_byte(families: Frozen, accept: str) -> None:
    theirs, content_type = choose_encoder(accept)
    writer = ExpositionWriter(accept)
    assert writer.content_type == content_type
    assert writer(families).decode() == theirs(families).decode()


def test_the_sidecars_own_families_are_written_on_the_fast_path(families: Frozen) -> None:
    """What the sidecar builds itself never reaches prometheus_client's writer (which would
    cost the time the fast path saves): only the other kinds do."""
    handed_over: list[str] = []

    class Counting(ExpositionWriter):
        def _theirs_for(self, metric: Metric) -> str:
            handed_over.append(metric.name)
            return super()._theirs_for(metric)

    body = Counting("application/openmetrics-text")(families).decode()
    assert sorted(handed_over) == ["bench_latency_seconds", "bench_requests", "bench_stamped"]
    assert r'training_job="quote \" slash \\ line \n end"' in body
    names = {family.name for family in text_string_to_metric_families(body)}
    assert {"torch_cuda_allocator_reserved_bytes", "torch_cuda_allocator",
            "allocwatch_gpu_memory_total_bytes", "process_cpu_seconds"} <= names


@pytest.mark.parametrize("accept", ["application/openmetrics-text;version=1.0.7",
                                    "application/openmetrics-text;version=1.99;escaping=underscores"])
def test_openmetrics_versions_below_two_are_one_kind_with_the_same_bytes(
        families: Frozen, accept: str) -> None:
    """Builds are shared by kind, so that a client naming a new version on each scrape does
    not get a build of its own each time: what a version changes is the content type."""
    first = ExpositionWriter("application/openmetrics-text;version=1.0.0")
    writer = ExpositionWriter(accept)
    theirs, content_type = choose_encoder(accept)
    assert writer.kind == first.kind and writer.content_type == content_type
    assert writer(families) == first(families) == theirs(families)
    assert ExpositionWriter("application/openmetrics-text;version=2.0.0").kind != first.kind


@pytest.mark.parametrize("accept", ["application/openmetrics-text;version=1.x",
                                    "application/openmetrics-text;version=abc",
                                    "text/plain;version=x.1"])
def test_a_version_that_cannot_be_compared_gets_the_default_format(accept: str) -> None:
    with pytest.raises(TypeError):  # prometheus_client's choice: a 500 for every such scrape
        choose_encoder(accept)
    assert ExpositionWriter(accept).content_type == choose_encoder("")[1]


@settings(max_examples=2000, deadline=None)
@given(st.one_of(st.floats(), st.integers(min_value=0, max_value=1 << 64).map(float),
                 st.integers(min_value=-(1 << 64), max_value=1 << 64)))
def test_numbers_are_written_as_prometheus_client_writes_them(number: float) -> None:
    assert go_float(number) == floatToGoString(number)
