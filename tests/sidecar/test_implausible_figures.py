"""Figures no allocator can have — NaN, ±Inf, a negative number sent as unsigned, more allocated
than reserved, a threshold outside 0-1 — are dropped and counted, never exported: the device
entry that carries one is left out of what the sidecar keeps, the report's other devices stay."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.sidecar import scrape, start_sidecar, values
from support.streams import Stream, device, hello, report
from support.waiting import wait_for

from allocator_ext.protocol.proto.allocwatch.v1 import agent_pb2 as pb

pytestmark = pytest.mark.timeout(60)


def _bad_devices() -> list[tuple[pb.DeviceReport, str]]:
    nan_threshold = device(0, "GPU-nan")
    nan_threshold.settings.garbage_collection_threshold = math.nan
    inf_threshold = device(1, "GPU-inf")
    inf_threshold.settings.garbage_collection_threshold = -math.inf
    above_one = device(2, "GPU-above-one")
    above_one.settings.garbage_collection_threshold = 1.5
    unsigned_minus_one = device(3, "GPU-minus-one", reserved=2**64 - 1)
    more_allocated = device(4, "GPU-more-allocated", reserved=10, allocated=20)
    more_used = device(5, "GPU-more-used")
    more_used.device_memory.total_bytes, more_used.device_memory.used_bytes = 10, 11
    return [(nan_threshold, "non_finite"), (inf_threshold, "non_finite"),
            (above_one, "out_of_range"), (unsigned_minus_one, "out_of_range"),
            (more_allocated, "inconsistent"), (more_used, "inconsistent")]


def test_a_device_entry_with_an_impossible_figure_is_dropped_and_counted(tmp_path: Path) -> None:
    running = start_sidecar(tmp_path, nvml=False)
    url = running.sidecar.metrics_url
    bad = _bad_devices()
    good = device(6, "GPU-good", reserved=100, allocated=60)
    good.settings.garbage_collection_threshold = 0.8
    try:
        with Stream(running.sidecar.agent_targets[0]) as stream:
            message = report(1, [d for d, _ in bad] + [good])
            message.report.timestamp_seconds = math.nan
            stream.send(hello(rank=0), message)
            wait_for(lambda: values(url, "torch_cuda_allocator_reserved_bytes", rank="0"),
                     what="the report")
            text, _ = scrape(url)
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name == "torch_cuda_allocator_max_split_size_bytes":
                        continue  # +Inf is its "unlimited"
                    assert math.isfinite(sample.value) and sample.value >= 0, sample
            assert values(url, "torch_cuda_allocator_reserved_bytes", rank="0") == [100.0]
            assert values(url, "torch_cuda_allocator_gc_threshold_ratio", rank="0") == [0.8]
            assert "GPU-nan" not in text and "GPU-more-allocated" not in text
            for reason, count in (("non_finite", 3), ("out_of_range", 2), ("inconsistent", 2)):
                assert values(url, "allocwatch_figures_dropped_total", reason=reason) == \
                    [float(count)], reason
            (state,) = running.sidecar.registry.agents()
            assert state.last_report.timestamp_seconds == 0.0  # unknown, not NaN
    finally:
        running.stop()
