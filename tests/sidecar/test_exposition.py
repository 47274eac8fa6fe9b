"""Building /metrics bodies: scrapes arriving while a build of their format is queued or
running share it (N scrapers arriving together cost one build and wait for one); a scrape
after it finished gets a fresh build; each format is built on its own. A collector whose first
build lasts until the test lets it end stands in for many agents' series."""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric

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


def test_builds_that_end_at_once_hold_up_no_later_scrape() -> None:
    """A build can end before its scrape has listed it (an empty registry builds in
    microseconds): the next scrapes still get answers."""
    exposition = Exposition(CollectorRegistry())

    async def scrapes() -> None:
        for _ in range(200):
            await asyncio.wait_for(exposition.body("", ""), 5)

    try:
        asyncio.run(scrapes())
    finally:
        exposition.close()
