"""Fuzzing the admin API's request parser: methods, targets and bodies built from the API's own
endpoints and fields with values of every kind (floats for ranks, huge integers, nesting where
strings go, unknown fields), plus random bytes as bodies. `parse_request` ends in a call or an
AdminError with a 4xx status and a short message within a second, never another exception; and
the same requests sent as raw HTTP to a running sidecar's admin socket are answered with that
status, never 500, and a refused one sends nothing to any agent. The number of inputs tried is
recorded in docs/reliability.md."""

from __future__ import annotations

import json
import time
import urllib.parse
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.admin import exchange
from support.control import metric, two_agents_running

from exporter.admin.http_server import SNAPSHOTS, AdminCall, parse_request
from exporter.admin.service import ENDPOINTS, SELECTOR_FIELDS, AdminError

pytestmark = pytest.mark.timeout(240)
MAX_MESSAGE = 1500  # a message names the field and shows the value short

FIELDS = sorted({*SELECTOR_FIELDS, *(f for e in ENDPOINTS.values() for f in e.fields)})
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-(2**80), 2**80),
    st.floats(allow_nan=False), st.text(max_size=30),
    st.sampled_from(["0", "0.9", "-1", "gc", "all", "garbage_collection_threshold:0.6",
                     "expandable_segments:True", "x" * 5000, "node-a", "j1"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
bodies = st.one_of(
    st.dictionaries(st.sampled_from([*FIELDS, "unknown"]), values, max_size=5).map(
        lambda body: json.dumps(body).encode()),
    values.map(lambda value: json.dumps(value).encode()),
    st.sampled_from([b"", b"[" * 30_000, b'{"rank": ' + b"[" * 30_000 + b"}", b"{", b"\xff"]),
    st.binary(max_size=200))
paths = st.one_of(
    st.sampled_from(["/v1/agents", *ENDPOINTS, "/", "/v1", "/v1/agents/x", "/metrics"]),
    st.builds(lambda name: SNAPSHOTS + urllib.parse.quote(name, safe=""),
              st.sampled_from(["../../etc/passwd", "..", ".", "", "a/b", "x.pickle", "\x00"])
              | st.text(max_size=20)))
queries = st.dictionaries(st.sampled_from([*SELECTOR_FIELDS, "unknown"]),
                          st.text(max_size=12) | st.sampled_from(["0.9", "1", "-1", "9" * 20]),
                          max_size=5).map(urllib.parse.urlencode)
targets = st.builds(lambda path, query: f"{path}?{query}" if query else path, paths, queries)
methods = st.sampled_from(["GET", "POST", "PUT", "DELETE", "HEAD", "PATCH"])


def _parsed(method: str, target: str, body: bytes) -> AdminCall | AdminError:
    try:
        return parse_request(method, target, body)
    except AdminError as err:
        return err


# The second is this thread's CPU time, not Hypothesis's wall-clock deadline: a loaded machine
# can hold any example past a second of wall clock, which fails the run as unreliable timing.
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(method=methods, target=targets, body=bodies)
def test_any_request_parses_to_a_call_or_a_short_refusal(method: str, target: str,
                                                         body: bytes) -> None:
    started = time.thread_time()
    outcome = _parsed(method, target, body)
    used = time.thread_time() - started
    assert used < 1.0, f"{used:.2f} s of CPU for one request"
    if isinstance(outcome, AdminError):
        assert outcome.status in (400, 404, 405), outcome.status
        assert str(outcome) and len(str(outcome)) < MAX_MESSAGE, str(outcome)[:300]
    else:
        assert isinstance(outcome, AdminCall)


@pytest.fixture(scope="module")
def two_agents(tmp_path_factory: pytest.TempPathFactory):
    with two_agents_running(Path(tmp_path_factory.mktemp("fuzz"))) as running:
        yield running


@pytest.fixture(scope="module")
def unchanged_since(two_agents) -> dict[str, float]:
    """The commands counter as the last example scraped it after its request was refused (no
    request has been sent since): the next example's count before its own. A scrape waits up
    to the sidecar's build interval (a quarter second); one an example instead of two."""
    return {}


@settings(max_examples=150, deadline=None,  # over real sockets to real agents: no deadline
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(method=methods, target=targets, body=bodies)
def test_a_refused_request_sent_to_the_sidecar_is_answered_so_and_sends_nothing(
        two_agents, unchanged_since: dict[str, float], method: str, target: str,
        body: bytes) -> None:
    running, address, sources = two_agents
    calls_before = [len(source.calls) for source in sources]
    commands_before = unchanged_since.pop("commands", None)
    if commands_before is None:
        commands_before = metric(running, "allocwatch_commands_total")
    request = (f"{method} {urllib.parse.quote(target, safe='/?=&%')} HTTP/1.1\r\n"
               f"Host: localhost\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
               ).encode() + body
    status, answer = exchange(address, request)
    assert status not in (0, 500), (status, answer[:300])
    outcome = _parsed(method, target, body)
    if isinstance(outcome, AdminError):
        assert status == outcome.status, (status, outcome.status, answer[:300])
    if status != 200:
        assert [len(source.calls) for source in sources] == calls_before
        commands_after = metric(running, "allocwatch_commands_total")
        assert commands_after == commands_before
        unchanged_since["commands"] = commands_after
