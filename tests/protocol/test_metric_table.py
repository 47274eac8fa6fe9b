"""The metric table (allocator_ext/protocol/metrics.py) against what it describes: Prometheus'
naming conventions and DESIGN.md's label rules, the protocol's fields, the agent's converter,
and the allocator's own statistics."""

from __future__ import annotations

import re

import pytest
from support.paths import REPO

from allocator_ext.agent.convert import allocator_stats
from allocator_ext.protocol import metrics
from allocator_ext.protocol.metrics import METRICS, SERIES_LABELS
from allocator_ext.protocol.proto.allocwatch.v1 import agent_pb2 as pb
from exporter.metrics.collectors import field_reader

NAME = re.compile(r"[a-z_][a-z0-9_]*")


def test_names_follow_prometheus_conventions_and_are_unique() -> None:
    names = [m.name for m in METRICS]
    assert len(names) == len(set(names))
    families = [m.family for m in METRICS]
    assert len(families) == len(set(families)), "two metrics would share a family"
    for m in METRICS:
        assert NAME.fullmatch(m.name), m.name
        assert m.name.startswith(("torch_cuda_allocator_", "allocwatch_")), m.name
        assert m.name.endswith("_total") == (m.type == "counter"), m.name
        assert m.name.endswith("_info") == (m.type == "info"), m.name
        assert m.help.strip() == m.help and m.help, m.name
        assert (m.field or m.source), f"{m.name}: no source"
        assert len(set(m.all_labels)) == len(m.all_labels), m.name


def test_labels_follow_the_design() -> None:
    for m in METRICS:
        # Prometheus adds the target's pod and namespace; the pid goes on the info series only.
        assert not {"pod", "namespace", "job"} & set(m.all_labels), m.name
        assert "pid" not in m.all_labels or m.type == "info", m.name
        assert "pool" not in m.labels or m.name.startswith("torch_cuda_allocator_pool_"), m.name
        if m.per in ("device", "agent"):
            assert m.series_labels == SERIES_LABELS
        if m.per in ("device", "agent") and m.type != "info":
            # Each series a device or agent shows is counted for the series bound.
            assert {name for name, _ in m.values} == set(m.labels), m.name


def test_the_series_bound_counts_every_series_of_a_device_and_an_agent() -> None:
    per_device = [m for m in METRICS if m.per in ("device", "gpu")]
    assert metrics.series_per_device() == sum(
        len(list(m.expanded())) for m in per_device) == 48
    assert metrics.series_per_agent() == 5


@pytest.mark.parametrize("metric", [m for m in METRICS if m.field], ids=lambda m: m.name)
def test_every_field_is_a_number_of_the_report(metric: metrics.Metric) -> None:
    root = pb.Report if metric.per == "agent" else pb.DeviceReport
    for _, path, _ in metric.expanded():
        field_reader(path, root)  # raises naming what the protocol lacks
    with pytest.raises(ValueError, match="no number field 'nope'"):
        field_reader("allocator.nope")
    with pytest.raises(ValueError, match="no message field 'nope'"):
        field_reader("nope.total_bytes")


def test_the_agent_carries_every_stats_key_into_its_field() -> None:
    # Every key a distinct value: each field must hold its own key's.
    keys = [(m, fixed, path, key) for m in METRICS for fixed, path, key in m.expanded() if key]
    stats = {key: 1000 + n for n, (_, _, _, key) in enumerate(keys)}
    device = pb.DeviceReport(allocator=allocator_stats(stats))
    for m, fixed, path, key in keys:
        assert field_reader(path)(device) == stats[key], f"{m.name}{fixed}: {key} -> {path}"


def test_keys_a_source_lacks_read_as_zero() -> None:
    # PyTorch's allocator has neither host waits nor page moves.
    stats = allocator_stats({"reserved_bytes.all.current": 5})
    assert stats.all.reserved_bytes == 5
    assert (stats.host_waits_device, stats.host_waits_stream, stats.host_waits_event,
            stats.host_waits_unmap_thread, stats.stream_waits,
            stats.pending_unmap_bytes) == (0, 0, 0, 0, 0, 0)


def test_allocwatchs_allocator_reports_every_stats_key_of_the_table() -> None:
    ae = pytest.importorskip("allocator_ext._core", reason="the core is not built")
    allocator = ae.Allocator(ae.SimDevice(capacity=1 << 30))
    reported = allocator.stats()
    missing = [key for m in METRICS for _, _, key in m.expanded() if key and key not in reported]
    assert not missing, f"the table names keys the core does not report: {missing}"


def test_a_name_not_in_the_table_is_refused_with_its_name() -> None:
    with pytest.raises(KeyError, match="torch_cuda_allocator_nope is no metric"):
        metrics.metric("torch_cuda_allocator_nope")
    assert metrics.metric("torch_cuda_allocator_host_waits_total").series_each == 4


def test_the_docs_list_every_metric_as_the_table_renders_it() -> None:
    text = (REPO / "docs" / "sidecar.md").read_text()
    assert text.count(metrics.DOCS_BEGIN) == text.count(metrics.DOCS_END) == 1
    begin = text.index(metrics.DOCS_BEGIN)
    end = text.index(metrics.DOCS_END) + len(metrics.DOCS_END)
    assert text[begin:end] == metrics.markdown(), (
        "docs/sidecar.md's metric list is stale: python3 -m allocator_ext.protocol.metrics "
        "docs/sidecar.md")
    for m in METRICS:
        assert f"| `{m.name}` |" in text[begin:end]
