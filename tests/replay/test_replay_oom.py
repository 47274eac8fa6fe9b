"""Traces that ended in out-of-memory errors: the replay makes the request that failed, at its
place and on its stream, and says whether it recurred; the cap the run had is read from the
trace; tune recommends only settings under which no recorded error recurs."""

from __future__ import annotations

import gzip
import json
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.capped_run import record_capped_run
from support.paths import RECORDED_TRACES, REPO

from allocator_ext.replay import Replayer, TraceError, load_cost_table, load_trace, replay
from allocator_ext.replay.cap import memory_at_recorded_ooms, resolve_cap
from allocator_ext.replay.sizes import format_size
from allocator_ext.replay.trace import RECORDING_KEY, parse_snapshot
from allocator_ext.replay.tune import RECORDED, candidates_for, recommended, tune

OOM_MANIFEST = RECORDED_TRACES / "oom_manifest.json"
MiB = 1 << 20
SEG = 1 << 30


def _event(action: str, size: int, time_us: int, addr: int = SEG, **extra: Any) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": time_us,
            **extra}


def one_oom_snapshot() -> dict[str, Any]:
    """A 32 MiB tensor held, then a 40 MiB request that failed on a 64 MiB device (PyTorch
    writes the device's free memory where other events have an address), then the unwinding
    and a 40 MiB request that fits once the cache is flushed."""
    oom = {"action": "oom", "device_free": 32 * MiB, "size": 40 * MiB, "stream": 0,
           "time_us": 3}
    return {"device_traces": [[
        _event("segment_alloc", 32 * MiB, 1),
        _event("alloc", 32 * MiB, 2),
        oom,
        _event("free_requested", 32 * MiB, 4),
        _event("free_completed", 32 * MiB, 5),
        _event("segment_free", 32 * MiB, 6),  # the retry's flush, to make room for:
        _event("segment_alloc", 40 * MiB, 7, addr=SEG + (1 << 28)),
        _event("alloc", 40 * MiB, 8, addr=SEG + (1 << 28)),
    ]]}


# --- the request that failed is made again ---------------------------------------------------

def test_a_recorded_oom_recurs_under_the_recorded_cap() -> None:
    r = replay(parse_snapshot(one_oom_snapshot()), "native", device_memory=64 * MiB).report
    assert r["num_ooms"] == 1
    assert r["num_alloc_retries"] == 2  # the failed request's, and the last one's flush
    assert r["empty_cache_calls_replayed"] == 0  # that flush was the allocator's own
    assert (r["recorded_ooms_recurred"], r["recorded_ooms_survived"]) == (1, 0)
    [oom] = r["recorded_ooms"]
    assert oom == {"event_index": 2, "size": 40 * MiB, "stream": 0, "device_free": 32 * MiB,
                   "time_s": 2e-6, "time_us": 3, "recurred": True}
    assert r["peak_requested_bytes"] == 40 * MiB  # the failed request never counted


def test_a_served_oom_is_held_until_the_unwinding_begins() -> None:
    r = Replayer(parse_snapshot(one_oom_snapshot()), "native", device_memory=128 * MiB)
    for _ in range(3):
        r.step()
    assert r.requested == 72 * MiB and r.ooms[0].recurred is False
    r.step()  # the first free after the error: the served request goes with it
    assert r.requested == 0
    while not r.at_end:
        r.step()
    # The next 40 MiB request reuses the served request's cached segment.
    assert r.allocator.stats()["num_device_alloc"] == 2
    report = r.report(load_cost_table())
    assert report["num_ooms"] == 0 and report["recorded_ooms_survived"] == 1
    assert report["peak_requested_bytes"] == 72 * MiB
    assert report["recorded"]["num_ooms"] == 1


def test_a_pass_that_served_an_oom_releases_it_for_the_next() -> None:
    snapshot = one_oom_snapshot()
    del snapshot["device_traces"][0][3:]  # the trace ends right after the error
    r = Replayer(parse_snapshot(snapshot), "native", device_memory=128 * MiB)
    r.run_pass()
    assert r.holds_memory and r.requested == 72 * MiB
    r.release_held()
    assert not r.holds_memory
    assert r.run_pass(release=True).device_calls.get("malloc", {}).get("count", 0) == 0


# --- the cap the run had, kept in the trace --------------------------------------------------

def test_the_recorded_fraction_and_device_total_are_the_cap_unless_arguments_say_otherwise(
        ) -> None:
    snapshot = one_oom_snapshot()
    snapshot[RECORDING_KEY] = {"memory_fraction": 0.5, "device_total_bytes": 128 * MiB}
    trace = parse_snapshot(snapshot)
    cap = resolve_cap(trace)
    assert (cap.memory_fraction, cap.device_memory) == (0.5, 128 * MiB)
    assert cap.sources() == {"memory_fraction": "recording", "device_memory": "recording"}
    assert "64.00 MiB allowed" in cap.describe()
    cap = resolve_cap(trace, memory_fraction=1.0)
    assert (cap.memory_fraction, cap.device_memory) == (1.0, 128 * MiB)
    assert cap.sources() == {"memory_fraction": "argument", "device_memory": "recording"}
    # Another device: the recorded fraction of the recorded total no longer applies.
    cap = resolve_cap(trace, device_memory=256 * MiB)
    assert (cap.memory_fraction, cap.device_memory) == (None, 256 * MiB)
    # A trace without the key: the device its out-of-memory error implies, no fraction.
    bare = parse_snapshot(one_oom_snapshot())
    cap = resolve_cap(bare)
    assert cap.sources() == {"memory_fraction": None,
                             "device_memory": "recorded out-of-memory errors"}
    assert cap.device_memory == memory_at_recorded_ooms(bare) > 0
    uncapped = resolve_cap(bare, device_memory=0)  # --device-memory none
    assert uncapped.sources() == {"memory_fraction": None, "device_memory": None}
    assert "none can recur" in uncapped.describe()


@pytest.mark.parametrize("recording,why", [
    ("half", "is a str, not a dict"),
    ({"memory_fraction": 1.5}, "memory_fraction"),
    ({"memory_fraction": True}, "memory_fraction"),
    ({"memory_fraction": 0.5, "device_total_bytes": -1}, "device_total_bytes"),
])
def test_a_bad_recording_is_refused_with_the_reason(recording: Any, why: str) -> None:
    snapshot = one_oom_snapshot()
    snapshot[RECORDING_KEY] = recording
    with pytest.raises(TraceError, match=why):
        parse_snapshot(snapshot)


def run_cli(command: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "exporter.cli", command, *args],
                          capture_output=True, text=True, cwd=REPO, timeout=300)


def write(snapshot: dict[str, Any], path: Path) -> Path:
    with gzip.open(path, "wb") as f:
        pickle.dump(snapshot, f, protocol=4)
    return path


def test_replay_command_reads_the_cap_from_the_trace_and_reports_the_oom(
        tmp_path: Path) -> None:
    snapshot = one_oom_snapshot()
    snapshot[RECORDING_KEY] = {"memory_fraction": 0.5, "device_total_bytes": 128 * MiB}
    path = write(snapshot, tmp_path / "oom.pickle.gz")
    out = run_cli("replay", str(path), "--config", "native", "--json")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["cap_from"] == {"memory_fraction": "recording", "device_memory": "recording"}
    assert r["recorded_ooms_recurred"] == 1 and r["num_ooms"] == 1
    out = run_cli("replay", str(path), "--config", "native", "--memory-fraction", "1",
                  "--plot", str(tmp_path / "oom.png"))
    assert out.returncode == 0, out.stderr
    assert "memory fraction 1 (from the argument)" in out.stdout
    assert "recorded OOMs      1: 0 recurred, 1 survived" in out.stdout
    assert "event 2" in out.stdout and "survived" in out.stdout
    assert (tmp_path / "oom.png").read_bytes()[:4] == b"\x89PNG"


def test_replay_refuses_a_device_with_no_events(tmp_path: Path) -> None:
    path = write({"device_traces": [[], one_oom_snapshot()["device_traces"][0]]},
                 tmp_path / "two.pickle.gz")
    with pytest.raises(TraceError, match="no recorded events for device 0"):
        load_trace(path, device=0)
    out = run_cli("replay", str(path), "--device", "0")
    assert out.returncode == 2 and "no recorded events for device 0" in out.stderr


# --- a run of allocwatch's own core that ran out of memory, replayed -------------------------

def test_pytorchs_settings_under_the_recorded_cap_reproduce_every_oom_and_retry(
        tmp_path: Path) -> None:
    snapshot, stats = record_capped_run()
    assert stats["num_ooms"] >= 3  # the run did fail, and carried on
    path = write(snapshot, tmp_path / "capped.pickle.gz")
    out = run_cli("replay", str(path), "--config", "native", "--json")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["num_ooms"] == stats["num_ooms"] == r["recorded"]["num_ooms"]
    assert r["num_alloc_retries"] == stats["num_alloc_retries"]
    assert r["recorded_ooms_recurred"] == stats["num_ooms"]
    assert r["peak_reserved_bytes"] == stats["reserved_bytes.all.peak"]
    assert r["num_device_free"] == stats["num_device_free"]


H200_TOTAL = 150_109_880_320  # bytes, as cudaMemGetInfo reports an H200's


# 300 MiB + 21 bytes is a limit whose quotient by the H200's total, multiplied back, falls
# short of it by a byte: the fraction kept is the next double up.
@pytest.mark.parametrize("cap", [None, 0.25, 0.0762, 1 / 3, 300 * MiB + 21, 2 * H200_TOTAL])
def test_allocwatchs_snapshot_keeps_the_cap_it_ran_under_to_the_byte(cap: float | None) -> None:
    """What the agent writes at an out-of-memory error replays under the same cap: the memory
    fraction in force (or a limit in bytes, as a fraction) and the device's total. A limit
    at or past the device's total is no cap of its own."""
    import allocator_ext as ae

    allocator = ae.Allocator(ae.SimDevice(capacity=H200_TOTAL), "native")
    if isinstance(cap, float):
        allocator.set_memory_fraction(cap)
    elif cap is not None:
        allocator.set_memory_limit(cap)
    allocator.record_history(True)
    allocator.free(allocator.malloc(MiB))
    limits = parse_snapshot(allocator.snapshot()).limits
    assert limits.device_total_bytes == H200_TOTAL
    if cap is None or cap == 2 * H200_TOTAL:
        assert limits.memory_fraction is None
        return
    assert limits.memory_fraction is not None
    replayed = ae.Allocator(ae.SimDevice(capacity=H200_TOTAL), "native")
    replayed.set_memory_fraction(limits.memory_fraction)
    assert replayed.memory_limit == allocator.memory_limit


def test_a_trace_that_keeps_no_cap_replays_on_the_device_its_errors_imply(
        tmp_path: Path) -> None:
    """PyTorch's own snapshot of a run that filled its device keeps no cap, but its errors say
    what the run could reserve (reserved plus the device's free memory at each): the replay
    runs on that device, so the errors recur as recorded, and says where the cap came from.
    `--device-memory none` replays uncapped, where they cannot recur, and the report says so."""
    snapshot, stats = record_capped_run(total=256 * MiB, fraction=None, keep_cap=False)
    assert stats["num_ooms"] >= 3
    path = write(snapshot, tmp_path / "full.pickle.gz")
    out = run_cli("replay", str(path), "--config", "native")
    assert out.returncode == 0, out.stderr
    assert ("cap                256.00 MiB device, what the recorded run could reserve at its "
            "out-of-memory errors") in out.stdout
    r = json.loads(run_cli("replay", str(path), "--config", "native", "--json").stdout)
    assert r["cap_from"]["device_memory"] == "recorded out-of-memory errors"
    assert r["device_memory"] == 256 * MiB
    assert r["num_ooms"] == r["recorded_ooms_recurred"] == stats["num_ooms"]
    assert r["num_alloc_retries"] == stats["num_alloc_retries"]
    assert r["peak_reserved_bytes"] == stats["reserved_bytes.all.peak"]
    # tune, likewise: under that device the recorded setting's errors recur.
    why = json.loads(run_cli("tune", str(path), "--json").stdout)["why"]
    assert f"ran out of memory {stats['num_ooms']} time(s); replayed" in why
    # Uncapped on request: the errors cannot recur, and the report says so.
    out = run_cli("replay", str(path), "--config", "native", "--device-memory", "none")
    assert (f"cap                none: the trace holds {stats['num_ooms']} out-of-memory "
            "error(s) but keeps no cap, and without one none can recur") in out.stdout
    out = run_cli("tune", str(path), "--device-memory", "none", "--json")
    assert "these replays had no cap, so no error could recur" in json.loads(out.stdout)["why"]


def test_a_trace_whose_device_had_room_asks_for_the_memory_fraction() -> None:
    snapshot, _ = record_capped_run(keep_cap=False)  # a fraction of 0.25 failed it
    cap = resolve_cap(parse_snapshot(snapshot))
    assert cap.device_memory == 0 and cap.memory_fraction is None
    assert "a memory fraction was in force: give it with --memory-fraction" in cap.describe()
    # Given the cap, no note: the errors can recur.
    assert "none" not in resolve_cap(parse_snapshot(snapshot), 1 << 30, 0.25).describe()


def test_tune_recommends_only_settings_under_which_no_recorded_oom_recurs(
        tmp_path: Path) -> None:
    snapshot, stats = record_capped_run()
    trace = parse_snapshot(snapshot)
    cap = resolve_cap(trace)
    ranked = tune(trace, cap.device_memory, cap.memory_fraction)
    best = recommended(ranked)
    assert best is not None
    assert best.report["recorded_ooms_recurred"] == 0 and best.report["num_ooms"] == 0
    pytorch = next(c for c in ranked if c.settings == "native")
    assert pytorch.report["recorded_ooms_recurred"] == stats["num_ooms"]
    assert ranked.index(pytorch) > ranked.index(best)

    path = write(snapshot, tmp_path / "capped.pickle.gz")
    out = run_cli("tune", str(path), "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["recorded_ooms"] == stats["num_ooms"]
    [chosen] = [c for c in result["candidates"] if c["name"] == result["recommended"]["name"]]
    assert chosen["recorded_ooms_recurred"] == 0 and chosen["num_ooms"] == 0
    assert "only a candidate under which no out-of-memory error recurs" in result["why"]
    # What PyTorch's defaults reserved stopped short of their failed requests: no "saving".
    assert f"PyTorch's defaults ran out of memory {stats['num_ooms']} time(s) here." \
        in result["why"]
    assert "saves" not in result["why"]
    # The least, or within the margin of a tie with the least (then ranked on retries, then
    # device calls).
    size = format_size(chosen["peak_reserved_bytes"])
    assert f"reserves the least at its peak ({size}, " in result["why"] or (
        "rank as equal" in result["why"] and f"It reserves {size} (" in result["why"])


def test_tune_says_there_is_no_recommendation_when_every_candidate_fails(
        tmp_path: Path) -> None:
    path = write(one_oom_snapshot(), tmp_path / "oom.pickle.gz")
    # 40 MiB beside 32 MiB held cannot fit in 64 MiB under any setting.
    out = run_cli("tune", str(path), "--device-memory", "64MiB")
    assert out.returncode == 0, out.stderr
    assert "recommended: none" in out.stdout
    assert "Every candidate ran out of memory" in out.stdout
    out = run_cli("tune", str(path), "--device-memory", "64MiB", "--json")
    assert json.loads(out.stdout)["recommended"] is None


def test_the_recorded_settings_are_a_candidate_of_their_own() -> None:
    snapshot = one_oom_snapshot()
    snapshot["allocator_settings"] = {
        "PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6"}
    names = [c[0] for c in candidates_for(parse_snapshot(snapshot))]
    assert names[0] == RECORDED
    snapshot["allocator_settings"] = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert RECORDED not in [c[0] for c in candidates_for(parse_snapshot(snapshot))]


# --- out-of-memory traces recorded on the H200 (bench/replay/record_traces.py --oom) ------------

NO_OOM_TRACES = (f"no out-of-memory traces recorded on a GPU yet ({OOM_MANIFEST} is absent; "
                 "python -m bench.replay.record_traces --oom --out tests/data/traces records "
                 "them)")


def _oom_manifest() -> dict[str, Any] | None:
    return json.loads(OOM_MANIFEST.read_text()) if OOM_MANIFEST.exists() else None


def _oom_traces() -> list[Any]:
    manifest = _oom_manifest()
    if manifest is None:
        return [pytest.param(None, marks=pytest.mark.skip(reason=NO_OOM_TRACES))]
    return [pytest.param(t, id=t["file"].split(".")[0])
            for t in manifest["traces"] if t["status"] == "ok"]


def test_the_oom_manifest_holds_traces_that_ran_out_of_memory() -> None:
    """Once the manifest is there, the reproduction below runs: it cannot pass by having no
    trace to run on."""
    manifest = _oom_manifest()
    if manifest is None:
        pytest.skip(NO_OOM_TRACES)
    ok = [t for t in manifest["traces"] if t["status"] == "ok"]
    assert ok, f"{OOM_MANIFEST} lists no trace that ran out of memory: {manifest['traces']}"
    for entry in ok:
        assert (RECORDED_TRACES / entry["file"]).is_file(), entry["file"]
        assert entry["stats"]["num_ooms"] > 0 and entry["memory_fraction"] is not None


@pytest.mark.parametrize("entry", _oom_traces())
def test_a_recorded_oom_trace_reproduces_its_ooms_and_retries(
        entry: dict, capsys: pytest.CaptureFixture[str]) -> None:
    """`allocwatch replay --config native,<the recorded settings> --json`, under the cap the
    trace keeps: exactly the recorded run's out-of-memory errors, each where it happened, its
    retries, peak reserved memory and device allocations and frees."""
    from exporter.cli import main

    path = RECORDED_TRACES / entry["file"]
    trace = load_trace(path)
    conf = trace.recorded_config  # the settings as the snapshot itself keeps them
    assert conf == entry["pytorch_cuda_alloc_conf"]
    assert main(["replay", str(path), "--config", "native" + (f",{conf}" if conf else ""),
                 "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["cap_from"] == {"memory_fraction": "recording", "device_memory": "recording"}
    stats = entry["stats"]
    assert r["num_ooms"] == stats["num_ooms"] == r["recorded"]["num_ooms"] > 0
    assert r["recorded_ooms_recurred"] == stats["num_ooms"]
    assert r["recorded_ooms_survived"] == 0
    assert r["num_alloc_retries"] == stats["num_alloc_retries"]
    assert r["peak_reserved_bytes"] == stats["reserved_bytes.all.peak"]
    assert r["num_device_alloc"] == stats["num_device_alloc"]
    assert r["num_device_free"] == stats["num_device_free"]
