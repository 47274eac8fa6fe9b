"""The figures mean what they say, over a real Unix socket and real HTTP: the peak
fragmentation ratio from the allocator's interval peaks, the largest free block, a pool
breakdown under names of its own, and agents whose labels coincide all shown and counted."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from support.sidecar import FakeSource, MiB, samples, start_sidecar
from support.waiting import wait_for

import allocator_ext as ae
from allocator_ext.agent import start_agent

pytestmark = pytest.mark.timeout(60)

NO_RANK = {"rank": "", "local_rank": "", "cuda_device": "0", "gpu_uuid": "GPU-fake-0"}


@pytest.fixture
def sidecar(tmp_path: Path):
    running = start_sidecar(tmp_path, expiry=30.0)
    yield running
    running.stop()


def _agent(sidecar, source, interval: float = 0.1, **identity):
    return start_agent(sidecar.sidecar.agent_targets[0], interval=interval, source=source,
                       identity=identity, nvml=False, stop_at_exit=False)


def _series(url: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: v for (n, labels), v in samples(url).items() if n == name}


def _one(url: str, name: str) -> float:
    found = list(_series(url, name).values())
    assert len(found) == 1, (name, found)
    return found[0]


def test_a_cache_reused_at_each_step_has_no_peak_fragmentation_though_idle_between_steps(
        sidecar) -> None:
    url = sidecar.sidecar.metrics_url
    allocator = ae.Allocator(ae.SimDevice(), "native")
    # A long interval: this test says when the agent samples.
    agent = _agent(sidecar, {0: allocator}, interval=3600, rank=0)
    try:
        wait_for(lambda: agent.connected.is_set(), what="the agent to connect")
        for _step in range(3):  # activations allocated, then freed: the cache keeps them
            blocks = [allocator.malloc(size * MiB) for size in (40, 24, 12)]
            for block in blocks:
                allocator.free(block)
        agent.sample_once()
        wait_for(lambda: _series(url, "torch_cuda_allocator_peak_fragmentation_ratio")
                 and _one(url, "torch_cuda_allocator_allocated_bytes") == 0
                 and _one(url, "torch_cuda_allocator_reserved_bytes") > 0,
                 what="the report after the steps")
        # Between steps everything reserved is unused; at the step's peak, none of it was.
        assert _one(url, "torch_cuda_allocator_fragmentation_ratio") == 1.0
        assert _one(url, "torch_cuda_allocator_peak_fragmentation_ratio") == 0.0
        assert _one(url, "torch_cuda_allocator_largest_free_block_bytes") == 40 * MiB
        # The user's own peaks are untouched by the agent's interval peaks.
        assert allocator.stats()["allocated_bytes.all.peak"] == 76 * MiB
    finally:
        agent.stop()


def test_a_fragmented_cache_shows_at_its_peak(sidecar) -> None:
    url = sidecar.sidecar.metrics_url
    allocator = ae.Allocator(ae.SimDevice(), "native")
    agent = _agent(sidecar, {0: allocator}, interval=3600, rank=0)
    try:
        wait_for(lambda: agent.connected.is_set(), what="the agent to connect")
        # PyTorch's rules give 6 MiB requests 20 MiB segments, three to a segment: four
        # requests hold two segments, 40 % of them never used even at the peak.
        blocks = [allocator.malloc(6 * MiB) for _ in range(4)]
        reserved = allocator.stats()["reserved_bytes.all.current"]
        allocated = allocator.stats()["allocated_bytes.all.current"]
        for block in blocks:
            allocator.free(block)
        agent.sample_once()
        expected = 1 - allocated / reserved
        assert expected == pytest.approx(0.4)
        wait_for(lambda: _series(url, "torch_cuda_allocator_peak_fragmentation_ratio")
                 and _one(url, "torch_cuda_allocator_peak_fragmentation_ratio")
                 == pytest.approx(expected), what="the fragmented peak")
    finally:
        agent.stop()


def test_sum_over_any_metric_counts_each_byte_once(sidecar) -> None:
    url = sidecar.sidecar.metrics_url
    agent = _agent(sidecar, FakeSource(), rank=0)
    try:
        wait_for(lambda: _series(url, "torch_cuda_allocator_reserved_bytes"), what="a report")
        got = samples(url)
        total = [v for (n, _), v in got.items() if n == "torch_cuda_allocator_reserved_bytes"]
        pools = {dict(ls)["pool"]: v for (n, ls), v in got.items()
                 if n == "torch_cuda_allocator_pool_reserved_bytes"}
        assert total == [40 * MiB]  # one series: the total
        assert pools == {"small": 12 * MiB, "large": 28 * MiB}
        assert sum(pools.values()) == sum(total)
    finally:
        agent.stop()


def test_two_live_agents_with_the_same_labels_are_both_shown_and_counted(
        sidecar, caplog: pytest.LogCaptureFixture) -> None:
    url = sidecar.sidecar.metrics_url
    first_source, second_source = FakeSource(), FakeSource()
    second_source.bump(**{"reserved_bytes.all.current": 60 * MiB})  # 100 MiB: tell them apart
    caplog.set_level(logging.WARNING, logger="exporter.registry")
    first = _agent(sidecar, first_source)  # no rank: both scripts label alike
    wait_for(lambda: _series(url, "torch_cuda_allocator_reserved_bytes"), what="a first report")
    second = _agent(sidecar, second_source)
    try:
        wait_for(lambda: len(_series(url, "torch_cuda_allocator_reserved_bytes")) == 2,
                 what="both agents' series")
        reserved = {dict(ls).get("agent_slot", ""): v for ls, v in
                    _series(url, "torch_cuda_allocator_reserved_bytes").items()}
        assert reserved == {"": 40 * MiB, "2": 100 * MiB}
        for labels in _series(url, "torch_cuda_allocator_reserved_bytes"):
            assert {k: v for k, v in labels if k != "agent_slot"} == NO_RANK
        assert _one(url, "allocwatch_agent_series_collisions_total") == 1
        assert _one(url, "allocwatch_agents_connected") == 2
        info = [dict(ls) for ls in _series(url, "torch_cuda_allocator_info")]
        assert sorted(i.get("agent_slot", "") for i in info) == ["", "2"]
        assert len(_series(url, "allocwatch_agent_last_report_timestamp_seconds")) == 2
        warning = next(r for r in caplog.records if "coincide" in r.getMessage())
        assert warning.agent == second.agent_key and warning.others == [first.agent_key]
    finally:
        second.stop()
        first.stop()


def test_a_restarted_process_takes_its_predecessors_series_without_a_collision(sidecar) -> None:
    url = sidecar.sidecar.metrics_url
    old_source, new_source = FakeSource(), FakeSource()
    new_source.bump(**{"reserved_bytes.all.current": 8 * MiB})
    old = _agent(sidecar, old_source, rank=3)
    wait_for(lambda: _series(url, "torch_cuda_allocator_reserved_bytes"), what="a first report")
    old.stop()
    wait_for(lambda: _one(url, "allocwatch_agents_connected") == 0, what="the first to leave")
    new = _agent(sidecar, new_source, rank=3)
    try:
        wait_for(lambda: list(_series(url, "torch_cuda_allocator_reserved_bytes").values())
                 == [48 * MiB], what="the new process's figures under the same labels")
        assert _one(url, "allocwatch_agent_series_collisions_total") == 0
    finally:
        new.stop()
