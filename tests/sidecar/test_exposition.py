"""Building /metrics bodies: scrapes arriving while a build of their kind waits for its start or
runs share it (N scrapers arriving together cost one build and wait for one); a scrape after it
finished gets a fresh build; builds of one kind start an interval apart, so that a crowd of
scrapes costs one build an interval, each body read after its scrape arrived; each kind is
built on its own, OpenMetrics versions below 2.0.0 being one. A collector whose first build
lasts until the test lets it end stands in for many agents' series."""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from support.sidecar import scrape, start_sidecar

from exporter.metrics.http_server import Exposition


class SlowCollector:
    def __init__(self) -> None:
        self.builds = 0
        self.started = threading.Event()
        self.release = threading.Event()  # set: builds end at once

    def collect(self) -> Iterator[Metric]:
        self.builds += 1
        self.started.set()
        assert self.release.wait(10), "the test never let the build end"
        yield GaugeMetricFamily("slow_builds", "builds so far", value=self.builds)


def waiting(task: asyncio.Task) -> bool:
    """Whether the task has asked for its body and waits for it (or is done)."""
    coro = task.get_coro()
    return task.done() or (inspect.iscoroutine(coro)
                           and inspect.getcoroutinestate(coro) == inspect.CORO_SUSPENDED)


async def until_waiting(tasks: list[asyncio.Task]) -> None:
    while not all(waiting(t) for t in tasks):
        await asyncio.sleep(0)


def test_scrapes_during_a_build_share_it_and_later_ones_get_a_fresh_build() -> None:
    registry = CollectorRegistry()
    slow = SlowCollector()
    registry.register(slow)
    exposition = Exposition(registry)

    async def scrapes() -> None:
        first = asyncio.ensure_future(exposition.body("", ""))
        await asyncio.get_running_loop().run_in_executor(None, slow.started.wait)
        later = [asyncio.ensure_future(exposition.body("", "")) for _ in range(7)]
        await until_waiting(later)  # all seven arrived while the first build runs
        slow.release.set()
        bodies = await asyncio.gather(first, *later)
        assert slow.builds == 1 and len({body for body, _, _ in bodies}) == 1
        body, _, _ = await exposition.body("", "")
        assert slow.builds == 2 and b"slow_builds 2.0" in body
        plain, openmetrics = await asyncio.gather(
            exposition.body("", ""), exposition.body("application/openmetrics-text", "gzip"))
        assert slow.builds == 4
        assert plain[1].startswith("text/plain") and openmetrics[1].startswith(
            "application/openmetrics-text") and openmetrics[2]

    try:
        asyncio.run(scrapes())
    finally:
        exposition.close()


class ClockedCollector:
    """Notes when each build read its figures, and shows which build it is."""

    def __init__(self) -> None:
        self.read_at: list[float] = []

    def collect(self) -> Iterator[Metric]:
        self.read_at.append(time.monotonic())
        yield GaugeMetricFamily("builds", "builds so far", value=len(self.read_at))


def test_a_crowd_of_scrapes_costs_one_build_an_interval_each_read_after_it_arrived() -> None:
    registry = CollectorRegistry()
    clocked = ClockedCollector()
    registry.register(clocked)
    interval = 1.0
    exposition = Exposition(registry, interval=interval)

    async def scrape(delay: float) -> tuple[float, int, float]:
        """(when it arrived, which build it got, when it got it)."""
        await asyncio.sleep(delay)
        arrived = time.monotonic()
        body, _, _ = await exposition.body("", "")
        (line,) = [line for line in body.decode().splitlines() if line.startswith("builds ")]
        build = int(float(line.split()[1]))
        return arrived, build, time.monotonic()

    async def crowd() -> None:
        # 60 scrapes, one every 25 ms (as clients that each ask once would send them).
        answers = await asyncio.gather(*(scrape(n * 0.025) for n in range(60)))
        spread = answers[-1][0] - answers[0][0]
        assert len(clocked.read_at) <= spread / interval + 2, (len(clocked.read_at), spread)
        for arrived, build, answered in answers:
            assert clocked.read_at[build - 1] >= arrived  # its figures read after it came
            # The interval at most, and the build with what a loaded machine delays it by (a
            # second; a scrape made to wait two intervals still fails).
            assert answered - arrived < interval + 1.0
        # Any OpenMetrics version below 2.0.0 is one kind; each answer names the one asked for.
        openmetrics = "application/openmetrics-text; version={}"
        answers = await asyncio.gather(*(exposition.body(openmetrics.format(version), "")
                                         for version in ("1.0.0", "1.2.3")))
        assert answers[0][0] == answers[1][0]
        assert [content_type.split("; ")[1] for _, content_type, _ in answers] == [
            "version=1.0.0", "version=1.2.3"]

    try:
        asyncio.run(crowd())
    finally:
        exposition.close()


def test_builds_that_end_at_once_hold_up_no_later_scrape() -> None:
    """A build can end before its scrape has listed it (an empty registry builds in
    microseconds): the next scrapes still get answers."""
    exposition = Exposition(CollectorRegistry(), interval=0)

    async def scrapes() -> None:
        for _ in range(200):
            await asyncio.wait_for(exposition.body("", ""), 5)

    try:
        asyncio.run(scrapes())
    finally:
        exposition.close()


def test_a_scrape_naming_a_version_that_cannot_be_compared_gets_the_text_format(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Any client can send it: no 500, and no traceback in the log for each one."""
    running = start_sidecar(tmp_path, nvml=False)
    try:
        with caplog.at_level(logging.WARNING, logger="exporter"):
            text, headers = scrape(running.sidecar.metrics_url,
                                   accept="application/openmetrics-text; version=1.x")
        assert headers["content-type"].startswith("text/plain; version=0.0.4")
        assert "allocwatch_agents_connected" in text
        assert not caplog.records
    finally:
        running.stop()
