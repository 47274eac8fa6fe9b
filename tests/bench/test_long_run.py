"""bench/gpu/long_run.py: the long run's plumbing on the CPU (a real sidecar, the worker launched
through `allocwatch run`, the agent publishing allocwatch's core on the simulated device, the
figures read back from real scrapes of /metrics), and the verdict it draws from the samples.
The figures that count come from the H200 (docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from support.paths import REPO

from bench.gpu.long_run import per_minute, verdict

MODULE = "bench.gpu.long_run"


def sample(t: float, peak: int, mallocs: int = 0) -> dict[str, Any]:
    return {"t": t, "peak_reserved_bytes": peak, "peak_allocated_bytes": peak // 2,
            "reserved_bytes": peak, "allocated_bytes": peak // 2,
            "device_mallocs_total": mallocs, "device_frees_total": 0}


def test_the_verdict_compares_peak_reserved_after_minute_two_with_its_value_at_minute_two() -> None:
    samples = [sample(30, 900), sample(110, 1000, 5), sample(200, 1001, 6), sample(470, 1001, 6)]
    v = verdict(samples, mark_s=60)
    assert v["peak_reserved_at_settle_bytes"] == 1000 and v["peak_reserved_at_end_bytes"] == 1001
    assert v["growth"] == pytest.approx(0.001) and v["flat"]
    assert v["device_mallocs_after_settle"] == 1 and v["minutes_observed"] == pytest.approx(7.83)
    grown = verdict([*samples, sample(475, 1003, 7)], mark_s=60)
    assert grown["growth"] == pytest.approx(0.003) and grown["flat"] is False


def test_growth_within_the_first_two_minutes_is_the_run_meeting_its_shapes() -> None:
    v = verdict([sample(10, 500), sample(100, 1000), sample(300, 1000)], mark_s=60)
    assert v["growth"] == 0 and v["flat"]


def test_a_run_that_never_got_past_minute_two_has_no_verdict() -> None:
    v = verdict([sample(10, 500), sample(100, 1000)], mark_s=60)
    assert v["flat"] is None and "after minute 2" in v["why"]


def test_each_minute_gets_its_peak_and_the_device_calls_made_within_it() -> None:
    minutes = per_minute([sample(10, 500, 3), sample(50, 800, 4), sample(70, 800, 9),
                          sample(130, 810, 9)], mark_s=60)
    assert [m["minute"] for m in minutes] == [1, 2, 3]
    assert [m["peak_reserved_bytes"] for m in minutes] == [800, 800, 810]
    assert [m["device_mallocs"] for m in minutes] == [4, 5, 0]
    assert [m["complete"] for m in minutes] == [True, True, False]


# The worker, its imports done before its deadline is set (torch's, and those the first model
# and optimizer bring, torch._dynamo among them: seconds on a busy machine): the deadline falls
# after its start, and the time it is given is spent training.
WORKER_AFTER_ITS_IMPORTS = """\
import sys
import torch
from allocator_ext import agent, workloads
from bench.gpu import long_run
workloads.build("transformer", torch.device("cpu"), tiny=True, seed=0)
print("ready", flush=True)
sys.exit(long_run.main([*sys.argv[1:], "--stop-at", sys.stdin.readline().strip()]))
"""


def test_the_worker_stops_at_its_deadline_however_long_it_was_asked_to_train() -> None:
    # No sidecar behind the target: the agent retries in the background and never holds the
    # training back; the worker stops at --stop-at, and says so. Asked for 100 one-second
    # "minutes", far past the deadline.
    pytest.importorskip("torch")
    worker = subprocess.Popen([sys.executable, "-c", WORKER_AFTER_ITS_IMPORTS, "--worker",
                               "--minutes", "100", "--mark-s", "1",
                               "--publish-to", "unix:///nonexistent/agent.sock"],
                              cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline() == "ready\n", worker.stderr.read()[-2000:]
        stop_at = time.time() + 5
        out, err = worker.communicate(f"{stop_at!r}\n", timeout=120)
    finally:
        worker.kill()
    finished = time.time()
    assert worker.returncode == 0, out[-2000:] + err[-2000:]
    lines = [json.loads(x) for x in out.splitlines() if x.startswith('{"event"')]
    assert lines[0]["event"] == "start" and lines[-1]["event"] == "end"
    assert lines[-1]["stopped_by"] == "deadline" and lines[-1]["steps"] > 0
    assert any(x["event"] == "minute" for x in lines)
    # It trained up to the deadline (its end is at or past it, to the hundredth of a second the
    # worker reports `t` in) and stopped there: the process was gone long before the 100 s it
    # was asked for.
    assert lines[0]["wall"] + lines[-1]["t"] >= stop_at - 0.005
    assert finished - stop_at < 30


def test_the_self_check_publishes_through_a_real_sidecar_and_leaves_everything_in_its_folder(
        tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    out_dir = tmp_path / "run"
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", MODULE, "--self-check", "--out", str(out_dir)],
                         cwd=REPO, capture_output=True, text=True, timeout=240)
    took = time.monotonic() - started
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    # 6 "minutes" of 6 s each, within the run's limit of its minutes + 60 s.
    assert took < 36 + 60
    assert sum(line.startswith("minute ") for line in out.stdout.splitlines()) >= 5
    result = json.loads((out_dir / "long_run.json").read_text())
    assert result["problems"] == [] and result["worker_exit"] == 0
    assert result["backend_published"] == "allocwatch" and result["series_seen"] == 1
    assert result["stopped_by"] == "minutes" and result["training_seconds"] >= 36
    samples = result["samples"]
    assert len(samples) >= 36  # two scrapes a second, each from the agent's latest report
    assert all(s["reserved_bytes"] <= s["peak_reserved_bytes"] for s in samples)
    assert max(s["allocated_bytes"] for s in samples) > 8 << 20  # steps seen mid-flight
    # What the sidecar shows at the end is what the worker's core counted.
    end = result["worker_minutes"][-1]
    assert end["event"] == "end"
    assert samples[-1]["peak_reserved_bytes"] == end["peak_reserved_bytes"]
    assert samples[-1]["device_mallocs_total"] == end["num_device_alloc"]
    minutes = [m["minute"] for m in result["per_minute"]]
    assert minutes[:6] == [1, 2, 3, 4, 5, 6]
    # The largest step came first: the workload's peak request never grew after it.
    assert len(set(result["peak_requested_bytes_at_marks"])) == 1
    v = result["verdict"]
    assert v["flat"] is not None and v["bar"] == 0.002 and v["settle_minutes"] == 2
    assert v["peak_reserved_at_end_bytes"] == samples[-1]["peak_reserved_bytes"]
    assert (out_dir / "long_run.png").stat().st_size > 10_000
    assert (out_dir / "worker.log").is_file()
    assert {p.name for p in out_dir.iterdir()} - {"long_run.json", "long_run.png",
                                                  "worker.log"} == {
        next(p.name for p in out_dir.iterdir() if p.name.startswith("sidecar-"))}
    # The picture can be drawn again from the JSON alone.
    again = subprocess.run([sys.executable, "-m", MODULE, "--replot",
                            str(out_dir / "long_run.json"), "--plot", str(tmp_path / "again.png")],
                           cwd=REPO,
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and (tmp_path / "again.png").stat().st_size > 10_000


def test_a_worker_without_allocwatchs_allocator_fails_the_run_saying_why(tmp_path: Path) -> None:
    # On a CPU build of torch `allocwatch run` keeps PyTorch's allocator: nothing to measure.
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: this checks the path where allocwatch cannot install")
    out = subprocess.run([sys.executable, "-m", MODULE, "--out", str(tmp_path), "--minutes",
                          "0.2"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    result = json.loads((tmp_path / "long_run.json").read_text())
    assert result["worker_exit"] == 1 and result["samples"] == []
    assert any("allocator is not installed" in p for p in result["problems"])
    assert "problem: the worker failed" in out.stdout


def test_long_run_refuses_what_it_cannot_run() -> None:
    for argv, message in ((["--out", "x", "--model", "decode"], "one of transformer"),
                          (["--out", "x", "--minutes", "0"], "--minutes must be above 0"),
                          (["--minutes", "1"], "--out DIR is required"),
                          (["--replot", "x.json"], "--replot needs --plot")):
        out = subprocess.run([sys.executable, "-m", MODULE, *argv], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and message in out.stderr, (argv, out.stderr)
