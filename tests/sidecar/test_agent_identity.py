"""An agent's identity cannot be taken: everything the unauthenticated landing page shows (host,
pid, rank, the agent's key) does not let another stream become that agent. A hello naming a
live agent's instance is refused; one that copies what `/` shows is another agent, with a key
of its own. The real agent keeps its figures and its commands, and stays when the other leaves."""

from __future__ import annotations

import html
import re
import urllib.request
from pathlib import Path

import grpc
import pytest
from support.admin import call
from support.control import connect_agent, start_control_sidecar
from support.sidecar import FakeSource, MiB
from support.streams import Stream, device, hello, report
from support.waiting import wait_for

from allocator_ext.protocol.proto.allocwatch.v1 import agent_pb2 as pb

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def real_agent(tmp_path: Path):
    running = start_control_sidecar(tmp_path)
    source = FakeSource()
    agent = connect_agent(running, tmp_path, source, rank=2)
    yield running, agent, source
    agent.stop()
    running.stop()


def _landing_keys(running) -> list[str]:
    with urllib.request.urlopen(running.sidecar.metrics_url + "/", timeout=5) as response:
        page = response.read().decode()
    return [html.unescape(k) for k in re.findall(r"<tr><td>([^<]*)</td>", page)]


def _state(running, key: str):
    return running.sidecar.registry.get(key)


def test_a_hello_copying_what_the_landing_page_shows_takes_nothing(real_agent) -> None:
    running, agent, source = real_agent
    (key,) = _landing_keys(running)
    assert key == agent.agent_key
    ident = agent.identity
    shown_prefix = key.rsplit("/", 1)[1]  # whatever the page shows of the instance
    forged = pb.Identity()
    forged.CopyFrom(ident)
    forged.instance_id = (shown_prefix + "0" * 32)[:32]
    registry = running.sidecar.registry
    with Stream(running.sidecar.agent_targets[0]) as impostor:
        welcome = impostor.send(hello(forged)).answer().welcome
        assert welcome.agent_key != key
        impostor.send(report(1, [device(reserved=1, allocated=1)]))
        wait_for(lambda: registry.get(welcome.agent_key).last_report is not None,
                 what="the other agent's report")
        real = _state(running, key)
        assert real.connected and real.identity.instance_id == ident.instance_id
        assert real.last_report.devices[0].allocator.all.reserved_bytes == 40 * MiB
        # A command for the real agent's key reaches the real agent.
        (admin,) = running.sidecar.admin.addresses()
        status, answer = call(admin, "POST", "/v1/reclaim", {"agent": key})
        assert status == 200 and answer["selected"] == 1 and answer["ok"]
        assert source.calls == [("reclaim", (0, False))]
    wait_for(lambda: not registry.get(welcome.agent_key).connected, what="the other agent gone")
    before = agent.sequence
    wait_for(lambda: _state(running, key).last_report.sequence > before, what="real reports")
    assert _state(running, key).connected and agent.connected.is_set()


def test_a_second_hello_for_a_live_agent_is_refused(real_agent) -> None:
    running, agent, source = real_agent
    key = agent.agent_key
    with Stream(running.sidecar.agent_targets[0]) as copy:
        err = copy.send(hello(agent.identity)).error()
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS
    assert f"agent {key} is connected" in err.details()
    state = _state(running, key)
    assert state.connected and state.session is not None and not state.session.closed
    (admin,) = running.sidecar.admin.addresses()
    assert call(admin, "POST", "/v1/reset-peaks", {"agent": key})[1]["ok"]
    assert source.calls == [("reset_peaks", 0)]
