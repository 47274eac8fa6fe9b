"""Trace replay: fidelity to recorded runs, the report's fields, and refusal of bad traces."""

from __future__ import annotations

import gzip
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import REPO

from allocator_ext.replay import TraceError, load_trace, replay
from allocator_ext.replay.trace import parse_snapshot, peak_requested_bytes, private_pools

RECORDED = REPO / "tests" / "data" / "traces"
MANIFEST = json.loads((RECORDED / "manifest.json").read_text())
LOCKSTEP = json.loads((RECORDED / "lockstep_manifest.json").read_text())
EXAMPLE = REPO / "allocator_ext" / "data" / "example_trace.pickle.gz"


def native_config(recorded_conf: str) -> str:
    return "native" + (f",{recorded_conf}" if recorded_conf else "")


# --- fidelity --------------------------------------------------------------------------------

@pytest.mark.parametrize("entry", [t for t in MANIFEST["traces"] + LOCKSTEP["traces"]
                                   if t["status"] == "ok"],
                         ids=lambda t: t["file"].split(".")[0])
def test_replay_with_pytorchs_settings_reproduces_the_recorded_run(entry: dict) -> None:
    """Traces recorded on an H200 or an H100 (bench/replay/record_traces.py; the manifests name
    each one's GPU), the patterns' lockstep programs among them: PyTorch's rules are
    deterministic, so the same settings must give exactly the recorded peak reserved and device
    allocations."""
    trace = load_trace(RECORDED / entry["file"])
    r = replay(trace, config=native_config(entry["pytorch_cuda_alloc_conf"]),
               memory_fraction=entry["memory_fraction"]).report
    assert r["peak_reserved_bytes"] == entry["stats"]["reserved_bytes.all.peak"]
    assert r["num_device_alloc"] == entry["stats"]["num_device_alloc"]
    assert r["peak_requested_bytes"] == entry["stats"]["requested_bytes.all.peak"]
    assert r["num_device_free"] == entry["stats"]["num_device_free"]  # GC releases too
    assert r["peak_reserved_bytes"] == r["recorded"]["peak_reserved_bytes"]


def test_every_lockstep_recording_ran_its_program() -> None:
    """Each pattern's lockstep program (record_traces --lockstep: its warm-up at the largest
    shapes, then rounds) recorded whole; the test above replays each exactly, and its replay
    under allocwatch's rules is what the GPU benchmark measures."""
    assert LOCKSTEP["traces"]
    for entry in LOCKSTEP["traces"]:
        assert entry["status"] == "ok" and entry["lockstep"]["rounds"] >= 1, entry["file"]


@pytest.mark.parametrize("name", ["gpt_varlen", "multistream", "ckpt"])
def test_replay_reproduces_the_shared_traces(shared_traces: Path, name: str) -> None:
    r = replay(load_trace(shared_traces / f"{name}.pickle.gz"), config="native").report
    assert r["peak_reserved_bytes"] == r["recorded"]["peak_reserved_bytes"]
    assert r["num_device_alloc"] == r["recorded"]["num_segment_alloc"]


def test_cross_stream_frees_wait_for_their_recorded_completion(shared_traces: Path) -> None:
    trace = load_trace(shared_traces / "multistream.pickle.gz")
    delayed = sum(
        1 for a, b in zip(trace.events, trace.events[1:], strict=False)
        if a.action == "free_requested" and not (b.action == "free_completed" and b.addr == a.addr)
    )
    assert delayed > 0  # the trace does exercise record_stream
    r = replay(trace, config="native").report
    assert r["peak_reserved_bytes"] == r["recorded"]["peak_reserved_bytes"]


# --- the report ------------------------------------------------------------------------------

def test_the_report_has_every_field_design_md_lists() -> None:
    r = replay(load_trace(EXAMPLE)).report
    for key in ("peak_requested_bytes", "peak_allocated_bytes", "peak_reserved_bytes",
                "reserved_ratio", "num_alloc_retries", "num_ooms", "num_device_alloc",
                "num_device_free", "device_calls", "device_call_seconds_estimate",
                "trace_seconds", "events_replayed", "recorded"):
        assert key in r, key
    assert set(r["recorded"]) >= {"peak_reserved_bytes", "num_segment_alloc"}
    assert r["events_replayed"] == len(load_trace(EXAMPLE).events)
    assert 0 < r["trace_seconds"] < 60
    ratio = r["peak_reserved_bytes"] / r["peak_requested_bytes"]
    assert r["reserved_ratio"] == pytest.approx(ratio)
    # The estimate is the allocating thread's: the unmaps of moved pages' old places, made by
    # the allocator's own thread, are priced apart.
    priced = sum(c["seconds"] for k, c in r["device_calls"].items() if k != "unmap_off_thread")
    assert r["device_call_seconds_estimate"] == pytest.approx(priced)


def test_a_device_memory_cap_is_honoured() -> None:
    trace = load_trace(EXAMPLE)
    peak = peak_requested_bytes(trace)
    r = replay(trace, config="native", device_memory=int(0.5 * peak)).report
    assert r["num_ooms"] > 0
    assert r["peak_reserved_bytes"] <= int(0.5 * peak)


@pytest.mark.parametrize("name", ["trainer__default", "trainer__default_lockstep",
                                  "kv_generate__default_lockstep"])
def test_a_memory_fraction_known_from_the_start_keeps_the_pattern_recordings_within_it(
        name: str) -> None:
    # The GPU benchmark caps each run with a memory fraction of 1.03 x its peak request. Known
    # from the start, the fraction makes growth single pages (Note [page policy]); the same
    # memory as a device that refuses only when full is found too late, chunks made on the way
    # up pinning their free pages.
    trace = load_trace(RECORDED / f"{name}.pickle.gz")
    limit = int(1.03 * peak_requested_bytes(trace))
    h200 = 141 << 30
    fraction = replay(trace, device_memory=h200, memory_fraction=limit / h200).report
    assert fraction["num_ooms"] == 0 and fraction["num_alloc_retries"] == 0
    assert replay(trace, device_memory=limit).report["num_ooms"] > 0


def test_the_users_empty_cache_is_replayed() -> None:
    # alloc, free, then a segment_free the allocator did not need: an empty_cache() call.
    events = [
        {"action": "segment_alloc", "addr": 1 << 30, "size": 2 << 20, "stream": 0, "time_us": 1},
        {"action": "alloc", "addr": 1 << 30, "size": 4096, "stream": 0, "time_us": 2},
        {"action": "free_requested", "addr": 1 << 30, "size": 4096, "stream": 0, "time_us": 3},
        {"action": "free_completed", "addr": 1 << 30, "size": 4096, "stream": 0, "time_us": 4},
        {"action": "segment_free", "addr": 1 << 30, "size": 2 << 20, "stream": 0, "time_us": 5},
        {"action": "mystery", "addr": 0, "size": 0, "stream": 0, "time_us": 6},
    ]
    r = replay(parse_snapshot({"device_traces": [events]}), config="native").report
    assert r["empty_cache_calls_replayed"] == 1
    assert r["num_device_free"] == 1
    assert r["unknown_actions"] == {"mystery": 1}


def test_allocations_the_recorded_run_made_into_a_private_pool_replay_into_it() -> None:
    # Two 512 KiB requests that one 2 MiB segment would hold, but the second was made into a
    # CUDA graph's private pool (the snapshot's segments say which pool each segment is in), so
    # the recorded run needed a segment for each; the replay must too.
    segment_a, segment_b, kib512 = 1 << 30, 2 << 30, 512 << 10
    events = [
        {"action": "segment_alloc", "addr": segment_a, "size": 2 << 20, "stream": 0, "time_us": 1},
        {"action": "alloc", "addr": segment_a, "size": kib512, "stream": 0, "time_us": 2},
        {"action": "segment_alloc", "addr": segment_b, "size": 2 << 20, "stream": 0, "time_us": 3},
        {"action": "alloc", "addr": segment_b, "size": kib512, "stream": 0, "time_us": 4},
    ]
    segments = [{"address": segment_a, "total_size": 2 << 20, "segment_pool_id": (0, 0)},
                {"address": segment_b, "total_size": 2 << 20, "segment_pool_id": (0, 1)}]
    trace = parse_snapshot({"device_traces": [events], "segments": segments})
    assert private_pools(trace) == [None, None, None, (0, 1)]
    r = replay(trace, config="native").report
    assert r["num_device_alloc"] == 2 and r["peak_reserved_bytes"] == 4 << 20
    # Without the pool's name the same program fits in one segment.
    unnamed = parse_snapshot({"device_traces": [events]})
    assert replay(unnamed, config="native").report["num_device_alloc"] == 1
    # A segment freed before the snapshot was the default pool's, even where a pool's segment
    # took its address later.
    reused = [
        {"action": "segment_alloc", "addr": segment_b, "size": 2 << 20, "stream": 0, "time_us": 1},
        {"action": "alloc", "addr": segment_b, "size": kib512, "stream": 0, "time_us": 2},
        {"action": "free_requested", "addr": segment_b, "size": kib512, "stream": 0, "time_us": 3},
        {"action": "free_completed", "addr": segment_b, "size": kib512, "stream": 0, "time_us": 4},
        {"action": "segment_free", "addr": segment_b, "size": 2 << 20, "stream": 0, "time_us": 5},
    ] + [dict(e, time_us=e["time_us"] + 5) for e in events]
    trace = parse_snapshot({"device_traces": [reused], "segments": segments})
    assert private_pools(trace) == [None] * 5 + [None, None, None, (0, 1)]


# --- bad traces ------------------------------------------------------------------------------

def test_a_trace_that_starts_mid_run_is_refused() -> None:
    trace = load_trace(EXAMPLE)
    trace.events = trace.events[500:]
    with pytest.raises(TraceError, match="empty allocator|no segment the trace allocated"):
        replay(trace)


def test_a_truncated_file_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "cut.pickle.gz"
    bad.write_bytes(EXAMPLE.read_bytes()[:5000])
    with pytest.raises(TraceError, match="truncated|damaged"):
        load_trace(bad)


def test_garbage_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "noise.pickle"
    bad.write_bytes(bytes(range(256)) * 10)
    with pytest.raises(TraceError):
        load_trace(bad)


class _Boom:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_a_pickle_with_objects_is_refused_without_running_them(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "hostile.pickle"
    bad.write_bytes(pickle.dumps({"device_traces": [[_Boom()]]}))
    with pytest.raises(TraceError, match="builtins.print"):
        load_trace(bad)
    assert "this must never run" not in capsys.readouterr().out


@pytest.mark.parametrize("snapshot,why", [
    ([1, 2, 3], "a snapshot is a dict"),
    ({"segments": []}, "no 'device_traces'"),
    ({"device_traces": [[]]}, "no recorded events"),
    ({"device_traces": [[{"addr": 1}]]}, "no 'action'"),
    ({"device_traces": [[{"action": "alloc", "addr": -1, "size": 1}]]}, "bad 'addr'"),
    # Beyond what the core's 64-bit fields hold: refused here, not a TypeError in the binding.
    ({"device_traces": [[{"action": "alloc", "addr": 1, "size": 1 << 64}]]}, "bad 'size'"),
    ({"device_traces": [[{"action": "alloc", "addr": 1, "size": (1 << 63) + 1}]]},
     "bad 'size'"),  # more than the core serves
    ({"device_traces": [[{"action": "alloc", "addr": 1, "size": 1, "stream": 1 << 64}]]},
     "bad 'stream'"),
    ({"device_traces": [[{"action": "alloc", "addr": 1 << 64, "size": 1}]]}, "bad 'addr'"),
    ({"device_traces": [[{"action": "alloc", "addr": 1, "size": 1, "time_us": 1 << 63}]]},
     "bad 'time_us'"),
])
def test_malformed_snapshots_are_refused_with_the_reason(snapshot, why: str) -> None:
    with pytest.raises(TraceError, match=why):
        parse_snapshot(snapshot)


# --- the command -----------------------------------------------------------------------------

def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "exporter.cli", "replay", *args],
                          capture_output=True, text=True, cwd=REPO, timeout=120)


def test_replay_command_prints_json(tmp_path: Path) -> None:
    plot = tmp_path / "replay.png"
    out = run_cli(str(EXAMPLE), "--config", "native", "--json", "--plot", str(plot))
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["peak_reserved_bytes"] == report["recorded"]["peak_reserved_bytes"]
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"


def test_replay_command_refuses_bad_input_with_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.pickle.gz"
    bad.write_bytes(gzip.compress(b"not a pickle"))
    out = run_cli(str(bad))
    assert out.returncode == 2 and "not a readable pickle" in out.stderr
    out = run_cli(str(EXAMPLE), "--config", "max_split_size_mb:1")
    assert out.returncode == 2 and "max_split_size_mb:1" in out.stderr
    out = run_cli(str(EXAMPLE), "--device-memory", "lots")
    assert out.returncode == 2 and "not a size" in out.stderr
    out = run_cli(str(tmp_path / "missing.pickle"))
    assert out.returncode == 2 and "cannot read" in out.stderr


def test_the_progress_bar_scales_its_counts_and_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from allocator_ext.replay.progress import progress_bar

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with progress_bar(28_885_000, "replay", quiet=False) as update:
        assert update is not None
        update(2_310_000)
        update(28_885_000)
    drawn = terminal.getvalue()
    assert "28.9M/28.9M" in drawn and " events/s" in drawn, drawn
    assert "28885000" not in drawn
