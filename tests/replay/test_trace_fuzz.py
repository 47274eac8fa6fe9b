"""Fuzzing the trace reader: truncated, corrupted and random files, and structurally odd
snapshots, must end in a Trace or a TraceError naming the problem — never another exception,
never code execution. The number of inputs tried is recorded in docs/reliability.md."""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from allocator_ext.replay import TraceError, replay
from allocator_ext.replay.trace import load_trace, parse_snapshot

SMALL = {
    "device_traces": [[
        {"action": "segment_alloc", "addr": 1 << 30, "size": 2 << 20, "stream": 0, "time_us": 1},
        {"action": "alloc", "addr": 1 << 30, "size": 4096, "stream": 0, "time_us": 2},
        {"action": "free_requested", "addr": 1 << 30, "size": 4096, "stream": 0, "time_us": 3},
        {"action": "free_completed", "addr": 1 << 30, "size": 4096, "stream": 0, "time_us": 4},
    ]],
    "segments": [],
}
VALID = pickle.dumps(SMALL, protocol=4)
VALID_GZ = gzip.compress(VALID)
FUZZ_SETTINGS = settings(max_examples=500, deadline=None,
                         suppress_health_check=[HealthCheck.function_scoped_fixture])


def _load(tmp_path: Path, data: bytes, name: str) -> None:
    path = tmp_path / name
    path.write_bytes(data)
    try:
        trace = load_trace(path)
    except TraceError as e:
        assert str(e)  # says what is wrong
        return
    try:
        replay(trace, config="native")
    except TraceError as e:
        assert str(e)


@FUZZ_SETTINGS
@given(cut=st.integers(0, len(VALID_GZ)))
def test_truncated_gzip_files(tmp_path: Path, cut: int) -> None:
    _load(tmp_path, VALID_GZ[:cut], "cut.pickle.gz")


@FUZZ_SETTINGS
@given(flips=st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)),
                      min_size=1, max_size=8))
def test_corrupted_pickles(tmp_path: Path, flips: list[tuple[int, int]]) -> None:
    data = bytearray(VALID)
    for at, value in flips:
        data[at] = value
    _load(tmp_path, bytes(data), "flipped.pickle")


@FUZZ_SETTINGS
@given(data=st.binary(max_size=512))
def test_random_bytes(tmp_path: Path, data: bytes) -> None:
    _load(tmp_path, data, "random.pickle")


PLAIN = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
EVENT = st.fixed_dictionaries({
    "action": st.sampled_from(["alloc", "free_requested", "free_completed", "segment_alloc",
                               "segment_free", "oom", "weird"]),
    "addr": st.integers(-2, 1 << 12), "size": st.integers(-2, 1 << 22),
    "stream": st.integers(0, 3), "time_us": st.integers(0, 100),
})


@FUZZ_SETTINGS
@given(snapshot=PLAIN)
def test_arbitrary_plain_data(snapshot) -> None:
    try:
        parse_snapshot(snapshot)
    except TraceError:
        pass


@FUZZ_SETTINGS
@given(events=st.lists(EVENT, max_size=30))
def test_odd_event_sequences(events) -> None:
    try:
        trace = parse_snapshot({"device_traces": [events]})
        replay(trace, config="native")
    except TraceError as e:
        assert str(e)
