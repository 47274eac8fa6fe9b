"""Admin requests that a hostile or careless client sends: numbers that are not integers, bodies
nested past any parser's depth, byte counts beyond any integer the protocol holds, settings
strings longer than an agent accepts. Each is refused with 400 and a message that names the
field, and nothing reaches an agent."""

from __future__ import annotations

import pytest
from support.admin import call
from support.control import metric

from exporter.shared.config import ConfigError
from exporter.sidecar.config import parse_config

pytestmark = pytest.mark.timeout(60)
MAX_SETTINGS_CHARACTERS = 4096  # what an agent accepts


@pytest.mark.parametrize("body, message", [
    ({"rank": 0.9}, "rank: expected an integer, got 0.9"),
    ({"rank": 1.0}, "rank: expected an integer, got 1.0"),
    ({"rank": "0.9"}, "rank: expected an integer"),
    ({"rank": 2**40}, "rank: expected an integer"),
    ({"rank": True}, "rank: expected an integer"),
    ({"settings": ",".join(["expandable_segments:True"] * 420)},
     f"settings: longer than {MAX_SETTINGS_CHARACTERS} characters"),
], ids=["rank 0.9", "rank 1.0", "rank '0.9'", "rank 2**40", "rank true", "10,000 characters"])
def test_a_bad_selector_or_settings_string_is_refused_and_sends_nothing(
        two_agents, body: dict, message: str) -> None:
    running, address, sources = two_agents
    body = {"settings": "garbage_collection_threshold:0.6", **body}
    status, answer = call(address, "POST", "/v1/settings", body)
    assert (status, message) == (400, message) and message in answer["error"], answer
    assert all(source.calls == [] for source in sources)
    assert metric(running, "allocwatch_commands_total") == 0.0


@pytest.mark.parametrize("body, message", [
    ({"max_bytes": 2**64}, "max_bytes: expected a byte count"),
    ({"max_bytes": -1}, "max_bytes: expected a byte count"),
    ({"max_bytes": 1.5}, "max_bytes: expected a byte count"),
], ids=["2**64", "-1", "1.5"])
def test_a_snapshot_size_beyond_range_is_refused(two_agents, body: dict, message: str) -> None:
    running, address, sources = two_agents
    status, answer = call(address, "POST", "/v1/snapshot", body)
    assert status == 400 and message in answer["error"], answer
    assert metric(running, "allocwatch_commands_total") == 0.0


@pytest.mark.parametrize("body", [b"[" * 60_000, b'{"rank": ' + b"[" * 30_000 + b"}"],
                         ids=["a list", "in a field"])
def test_json_nested_past_any_depth_is_refused(two_agents, body: bytes) -> None:
    running, address, _ = two_agents
    status, answer = call(address, "POST", "/v1/reclaim", body)
    assert status == 400 and "JSON" in answer["error"], answer
    assert metric(running, "allocwatch_commands_total") == 0.0


def test_a_settings_string_too_long_for_the_agents_is_refused_in_the_policy() -> None:
    long = ",".join(["expandable_segments:True"] * 420)
    with pytest.raises(ConfigError, match=f"longer than {MAX_SETTINGS_CHARACTERS} characters"):
        parse_config({"policy": {"initial_settings": long}})
    with pytest.raises(ConfigError, match=r"policy.rules\[0\].settings: longer than"):
        parse_config({"policy": {"rules": [{"name": "r", "metric": "reserved_bytes",
                                            "above": 1, "action": "set_config",
                                            "settings": long}]}})
