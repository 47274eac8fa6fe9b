"""Fuzzing the settings parser: settings files built from the real schema with values of every
kind (NaN, huge integers, strings where numbers go, nesting where scalars go), then mangled
(aliases, duplicate keys, cuts, stray bytes), and plain random bytes. Each one ends in settings
or in a ConfigError with a short message, within a second of the parsing thread's CPU time (a
wall-clock deadline would fail whenever the machine is busy), never another exception; a refused
file, given to the reload watcher, changes nothing. The number of inputs tried is recorded in
docs/reliability.md."""

from __future__ import annotations

import dataclasses
import time
import typing
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exporter.shared.config import ConfigError, Section
from exporter.sidecar.config import SidecarConfig, config_from_bytes
from exporter.sidecar.reload import ConfigWatcher

FUZZ = settings(max_examples=200, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])
MAX_MESSAGE = 1500  # a message names the key and shows the value short
MAX_CPU_S = 1.0  # for one file, parsing included

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-(2**80), 2**80),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40),
    st.sampled_from(["0660", "0777", "0o600", "1e400", ".nan", "-.inf", "::", "127.0.0.1", "",
                     "5m", "9" * 5000, "x" * 10_000, "/dev/null", "-1"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=12), inner, max_size=4),
                      max_leaves=12)


def section_documents(section: type[Section], depth: int = 0) -> st.SearchStrategy[dict]:
    """Mappings of a section's own keys (nested sections recursively), each with any value,
    and now and then a key the section does not know."""
    hints = typing.get_type_hints(section, include_extras=True)
    known: dict[str, st.SearchStrategy[Any]] = {}
    for field in dataclasses.fields(section):
        hint = hints[field.name]
        key = field.metadata.get("key") or field.name
        if isinstance(hint, type) and issubclass(hint, Section) and depth < 3:
            known[key] = section_documents(hint, depth + 1) | values
        else:
            known[key] = values
    return st.fixed_dictionaries({}, optional={**known, "unknown_key": values})


def mangled(text: str, how: str, at: int, junk: bytes) -> bytes:
    """The document, broken one way or another."""
    data = text.encode()
    if how == "cut":
        return data[:at % (len(data) + 1)]
    if how == "junk":
        cut = at % (len(data) + 1)
        return data[:cut] + junk + data[cut:]
    if how == "alias":
        return b"base: &a [1, 2, 3]\n" + data + b"\nagents: {max_agents: *a}\n"
    if how == "duplicate":
        return data + b"\n" + data
    if how == "deep":
        return b"agents: {max_agents: " + b"[" * 20_000 + b"]" * 20_000 + b"}\n" + data
    return data


documents = st.builds(
    mangled,
    st.builds(lambda doc: yaml.safe_dump(doc, allow_unicode=True),
              section_documents(SidecarConfig)),
    st.sampled_from(["as is", "as is", "cut", "junk", "alias", "duplicate", "deep"]),
    st.integers(0, 10_000), st.binary(max_size=16))


def _outcome(data: bytes) -> SidecarConfig | ConfigError:
    try:
        return config_from_bytes(data)
    except ConfigError as err:
        return err


def _within_a_cpu_second(call):
    """What call() returns, asserting that it took under MAX_CPU_S of this thread's CPU time."""
    started = time.thread_time()
    result = call()
    used = time.thread_time() - started
    assert used < MAX_CPU_S, f"{used:.2f} s of CPU for one file"
    return result


def _check(data: bytes) -> None:
    outcome = _within_a_cpu_second(lambda: _outcome(data))
    if isinstance(outcome, ConfigError):
        message = str(outcome)
        assert message and len(message) < MAX_MESSAGE, message[:300]
    else:
        assert isinstance(outcome, SidecarConfig)


@FUZZ
@given(data=documents)
def test_settings_built_from_the_schema_end_in_settings_or_a_short_error(data: bytes) -> None:
    _check(data)


@FUZZ
@given(data=st.binary(max_size=2000))
def test_random_bytes_end_in_settings_or_a_short_error(data: bytes) -> None:
    _check(data)


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=documents)
def test_a_refused_file_changes_nothing_on_reload(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "allocwatch.yaml"
    path.write_text("nvml: {enabled: false}\n")
    applied: list[SidecarConfig] = []
    watcher = ConfigWatcher(path, apply=lambda config: applied.append(config) or [])
    before = watcher.current_hash
    # New content counts once it reads the same twice.
    assert _within_a_cpu_second(lambda: watcher.check(data)) is None
    result = _within_a_cpu_second(lambda: watcher.check(data))
    outcome = _outcome(data)
    if isinstance(outcome, ConfigError):
        assert (result, applied, watcher.current_hash) == ("invalid", [], before)
        assert not watcher.counts()[1]  # allocwatch_config_last_reload_successful 0
    else:
        assert result in ("ok", "partial", None) and applied in ([outcome], [])
