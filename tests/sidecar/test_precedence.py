"""Scrapes first: while /metrics is being built, the metrics endpoint, the admin API and the
agents' front leave new connections in the kernel's queue, and accept them once the body is
built; a deferral lasts at most `longest`, and the listeners then accept for at least as long
as it lasted, so that clients scraping without end cannot stop the accepts."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.core import GaugeMetricFamily, Metric
from support.sidecar import scrape, start_sidecar

from exporter.shared.precedence import Precedence
from exporter.sidecar.app import SidecarThread

pytestmark = pytest.mark.timeout(120)


class HeldBuild:
    """A collector whose builds last until the test lets them end."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()

    def collect(self) -> Iterator[Metric]:
        self.started.set()
        assert self.release.wait(60), "the test never let the build end"
        yield GaugeMetricFamily("held_builds", "a build the test held", value=1)


def test_a_deferral_lasts_while_a_scrape_is_built_and_at_most_longest() -> None:
    async def run() -> None:
        loop = asyncio.get_running_loop()
        # 1 s: the 50 ms sleep below must end well before it, however loaded the machine.
        precedence = Precedence(longest=1.0)
        resumed: list[float] = []

        def resume() -> None:
            resumed.append(loop.time())

        async def until_resumed(count: int) -> None:
            deadline = loop.time() + 5
            while len(resumed) < count and loop.time() < deadline:
                await asyncio.sleep(0.005)

        assert not precedence.defers(resume)  # no scrape: accept
        with precedence.scrape():
            began = loop.time()
            assert precedence.defers(resume)
            assert precedence.defers(resume)  # another listener
            await asyncio.sleep(0.05)
            assert not resumed
        ended = loop.time()
        assert len(resumed) == 2  # both read their queues again as the scrape ends
        # Then they accept for as long as the deferral lasted, scrape or not.
        with precedence.scrape():
            assert loop.time() >= ended + (ended - began) or not precedence.defers(resume)
            await asyncio.sleep(ended + 2 * (ended - began) - loop.time() + 0.01)
            began = loop.time()  # before the deferral begins: never after it, however loaded
            assert precedence.defers(resume)
            await until_resumed(3)  # a build that outlasts `longest`: ended at it
            assert len(resumed) == 3 and 1.0 <= resumed[2] - began + 0.01 < 1.0 + 1.0
            assert not precedence.defers(resume)  # the window that follows

    asyncio.run(run())


@pytest.fixture
def held(tmp_path: Path) -> Iterator[tuple[SidecarThread, HeldBuild]]:
    running = start_sidecar(tmp_path, nvml=False)
    build = HeldBuild()
    running.sidecar.metrics_registry.register(build)
    try:
        yield running, build
    finally:
        build.release.set()
        running.stop()


def _scrape_in_background(url: str) -> threading.Thread:
    thread = threading.Thread(target=scrape, args=(url,), kwargs={"timeout": 60}, daemon=True)
    thread.start()
    return thread


def _ask(sock: socket.socket, path: str) -> None:
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())


def _answered(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        return sock.recv(64).startswith(b"HTTP/1.1 ")
    except TimeoutError:
        return False


def _until(condition, within: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def test_newcomers_on_every_listener_wait_while_a_scrape_is_built(
        held: tuple[SidecarThread, HeldBuild]) -> None:
    running, build = held
    sidecar = running.sidecar
    sidecar.precedence.longest = 60.0  # the build, however long the test holds it
    front = sidecar.agents_endpoint.front
    admin = next(a for a in sidecar.admin.addresses() if a.startswith("unix://"))
    scraping = _scrape_in_background(sidecar.metrics_url)
    assert build.started.wait(30)
    agents_before = front.connections()
    host, port = sidecar.metrics_url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as probe, \
            socket.socket(socket.AF_UNIX) as ctl, socket.socket(socket.AF_UNIX) as agent:
        ctl.connect(admin.removeprefix("unix://"))
        agent.connect(sidecar.config.agents.unix_socket)
        _ask(probe, "/healthz")
        _ask(ctl, "/v1/agents")
        # In the kernel's queue, not accepted: no answer, and the front holds no more.
        assert not _answered(probe, 1.0)
        assert not _answered(ctl, 0.2)
        assert front.connections() == agents_before
        build.release.set()
        scraping.join(30)
        assert not scraping.is_alive()
        assert _answered(probe, 10) and _answered(ctl, 10)
        assert _until(lambda: front.connections() == agents_before + 1, 10)


def test_a_build_that_outlasts_longest_defers_nobody_longer(
        held: tuple[SidecarThread, HeldBuild]) -> None:
    running, build = held
    sidecar = running.sidecar
    sidecar.precedence.longest = 0.3
    scraping = _scrape_in_background(sidecar.metrics_url)
    assert build.started.wait(30)
    host, port = sidecar.metrics_url.removeprefix("http://").rsplit(":", 1)
    for _ in range(3):  # deferred at most 0.3 s each, then served while the build still runs
        with socket.create_connection((host, int(port)), timeout=10) as probe:
            _ask(probe, "/healthz")
            assert _answered(probe, 10)
    assert scraping.is_alive() and not build.release.is_set()
