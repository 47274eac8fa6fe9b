"""The GPU benchmarks' plumbing, exercised on the CPU so that a GPU session does not spend its
minutes on a broken script (the measurements themselves need the H200)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import BENCH_BUILD, BENCH_BUILD_GROUP, REPO
from support.waiting import wait_for

from allocator_ext.replay import load_trace
from allocator_ext.replay.engine import replay
from allocator_ext.replay.floor import reserved_floor
from bench.gpu.torch_bench import HOTPATH_PATTERNS, TORCH_EMPTY, compare_hotpath
from bench.replay.growth_timeline import packed_span


def test_gpu_soak_self_check_kills_and_restarts_the_sidecar_without_loss(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out_file = tmp_path / "soak.json"
    out = subprocess.run([sys.executable, "-m", "bench.gpu.gpu_soak", "--self-check", "--json",
                          str(out_file)], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    result = json.loads(out_file.read_text())
    assert result["corrupt_steps"] == 0 and result["steps"] > 100
    assert result["sidecar_kills"] >= 2
    assert result["agent_back_after_restart"] == result["sidecar_kills"]
    assert result["counters_went_back"] == 0


def test_agent_cpu_cost_publishes_to_a_real_sidecar_and_reports_its_share(tmp_path: Path) -> None:
    out_file = tmp_path / "agent_cpu.json"
    out = subprocess.run([sys.executable, "-m", "bench.sidecar.agent_cpu_cost", "--seconds", "3",
                          "--interval", "0.5", "--json", str(out_file)], cwd=REPO,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    result = json.loads(out_file.read_text())
    assert result["reports_sent"] >= 5           # it really published, every half second
    assert result["sample_median_us"] > 0
    assert "agent_cpu_share_of_one_core" in result


BENCH_MODULES = sorted(".".join(p.relative_to(REPO).with_suffix("").parts)
                       for p in (REPO / "bench").glob("*/*.py")
                       if p.parent.name != "lib" and p.name != "__init__.py")
BENCH_SHELLS = sorted(str(p.relative_to(REPO)) for p in (REPO / "bench").glob("*/*.sh")
                      if p.parent.name != "lib")


def test_every_benchmark_is_found() -> None:
    # The lists below come from the tree: a search that finds nothing would check nothing.
    assert {"bench.gpu.step_lockstep", "bench.replay.fragmentation",
            "bench.sidecar.sidecar_load"} <= set(BENCH_MODULES)
    assert {"bench/gpu/gpu_checks.sh", "bench/native/run_hotpath.sh"} <= set(BENCH_SHELLS)


@pytest.mark.parametrize("module", BENCH_MODULES)
def test_each_benchmark_runs_as_a_module_and_its_help_says_what_it_measures_and_writes(
        module: str) -> None:
    out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("usage:"), out.stderr[-2000:]
    description = out.stdout.split("\n\n", 1)[1]
    assert len(description.split()) >= 40, description  # what it measures, not a title
    assert f"python -m {module}" in description  # how to run it, as a module
    assert re.search(r"[Rr]eport|[Pp]rint|[Ww]rite|[Ww]ritten|--json", description)


@pytest.mark.parametrize("script", BENCH_SHELLS)
def test_each_benchmark_shell_explains_itself(script: str) -> None:
    out = subprocess.run(["bash", script, "--help"], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"bash {script}" in out.stdout and len(out.stdout.split()) >= 20, out.stdout


def test_steady_state_counts_device_calls_per_pass_and_a_repeating_trace_settles(
        tmp_path: Path) -> None:
    out_file = tmp_path / "steady.json"
    out = subprocess.run([sys.executable, "-m", "bench.replay.steady_state", "--passes", "3",
                          "--traces", "tests/data/traces/convnet__default.pickle.gz", "--json",
                          str(out_file)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    passes = json.loads(out_file.read_text())["passes"]["convnet__default.pickle.gz"]
    assert len(passes) == 3
    # The first pass grows the cache; once the pattern repeats, allocwatch's defaults make a
    # small fraction of those calls (the high-water rule: no new pages below the peak), and
    # what they still make costs a small share of the trace's active time.
    assert passes[0]["create"] > 50
    assert passes[-1]["create"] * 10 <= passes[0]["create"]
    assert passes[-1]["call_share"] * 3 <= passes[0]["call_share"]
    # The first pass is exactly what `allocwatch replay` prices: the same frees, the same waits.
    replayed = replay(load_trace(str(REPO / "tests/data/traces/convnet__default.pickle.gz")))
    assert passes[0]["call_share"] == pytest.approx(replayed.report["device_call_share"])


def test_fragmentation_judges_each_trace_against_the_bar_its_floor_sets(tmp_path: Path) -> None:
    # The record_stream pipeline: its floor (waiting frees, one pool per stream) is above 1.00,
    # so its bar is the floor + 0.01, not 1.01.
    trace = "tests/data/traces/stream_pipeline__default.pickle.gz"
    out_file = tmp_path / "fragmentation.json"
    out = subprocess.run([sys.executable, "-m", "bench.replay.fragmentation", "--traces", trace,
                          "--config", "native", "--json", str(out_file)], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    [row] = json.loads(out_file.read_text())["rows"]
    floor = reserved_floor(load_trace(str(REPO / trace)))
    assert floor.ratio > 1.01
    assert row["floor"] == floor.ratio and row["bar"] == pytest.approx(floor.ratio + 0.01)
    assert row["within_bar"] == (row["reserved_ratio"] <= row["bar"]) and not row["within_bar"]
    assert "native: 0 of 1 traces within their bar" in out.stdout


def test_growth_timeline_traces_each_settings_peak_to_its_requests(tmp_path: Path) -> None:
    trace = "tests/data/traces/convnet_fixed__default.pickle.gz"
    out_file = tmp_path / "timeline.json"
    out = subprocess.run([sys.executable, "-m", "bench.replay.growth_timeline", trace, "--config",
                          "", "--config", "native", "--json", str(out_file)], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out_file.read_text())
    # One stream: its own peak is the trace's.
    assert result["per_stream_peak_sum_over_requested"] == pytest.approx(1.0)
    # Each setting's peak is what `allocwatch replay` reports for it, and the event that
    # reaches it is among the rows shown.
    for i, config in enumerate(["", "native"]):
        replayed = replay(load_trace(str(REPO / trace)), config=config or None)
        peak = replayed.report["peak_reserved_bytes"] / result["peak_requested_bytes"]
        assert result["peak_reserved_over_requested"][i] == pytest.approx(peak)
        assert max(row["reserved"][i] for row in result["rows"]) == pytest.approx(peak)
    assert all(row["action"] and row["event"] >= 0 for row in result["rows"])
    # PyTorch's rules reserve more than allocwatch's on this trace (1.70 against 1.02).
    assert result["peak_reserved_over_requested"][1] > result["peak_reserved_over_requested"][0]


def test_the_fixed_layout_bound_packs_requests_that_never_meet_into_the_same_bytes() -> None:
    from allocator_ext.replay.trace import Lifetime

    # 4 bytes alive throughout; two 2-byte requests one after the other share their place;
    # a 3-byte one overlapping both in time needs a place of its own.
    assert packed_span([Lifetime(0, 10, 4, 0), Lifetime(0, 5, 2, 0),
                           Lifetime(5, 10, 2, 0)]) == 6
    assert packed_span([Lifetime(0, 10, 4, 0), Lifetime(0, 5, 2, 0), Lifetime(5, 10, 2, 0),
                           Lifetime(4, 6, 3, 0)]) == 9
    # On a recorded trace it cannot go below what the program holds at once. (The packing
    # compares each request with every one placed before it: the trace of 5,700 requests, not
    # one of 14,000, which takes minutes.)
    out = subprocess.run([sys.executable, "-m", "bench.replay.growth_timeline",
                          "tests/data/traces/convnet_fixed__default.pickle.gz", "--config",
                          "native", "--fixed-layout-bound"], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(x for x in out.stdout.splitlines() if "packed with foresight" in x)
    assert 1.0 <= float(line.rsplit("=", 1)[1]) < 1.1


def test_growth_timeline_refuses_a_bad_setting_naming_it() -> None:
    out = subprocess.run([sys.executable, "-m", "bench.replay.growth_timeline",
                          "tests/data/traces/convnet__default.pickle.gz", "--config",
                          "bogus_key:1"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "bogus_key" in out.stderr and not out.stdout


def test_step_lockstep_refuses_a_cap_below_the_workload() -> None:
    out = subprocess.run([sys.executable, "-m", "bench.gpu.step_lockstep", "--fraction-of-peak",
                          "0.9"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--fraction-of-peak must be at least 1.0" in out.stderr


def lockstep_self_check(tmp_path: Path, *args: str) -> dict:
    """step_lockstep's protocol on the CPU (tiny convnet) with `args`: its JSON result."""
    pytest.importorskip("torch")
    out_file = tmp_path / "lockstep.json"
    out = subprocess.run([sys.executable, "-m", "bench.gpu.step_lockstep", "--self-check",
                          "--model", "convnet", *args, "--json", str(out_file)], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return json.loads(out_file.read_text())


def test_step_lockstep_checks_the_harness_with_one_allocator_on_both_sides(
        tmp_path: Path) -> None:
    # --ours and --against the same allocator: two processes, named apart, each step's time to
    # queue recorded for both (the CPU run queues and finishes at once: its share is about 1).
    result = lockstep_self_check(tmp_path, "--ours", "pytorch", "--against", "pytorch",
                                 "--rounds", "2", "--steps", "2")
    (phase,) = result["phases"]
    assert result["ours"] == result["against"] == "pytorch"
    names = {"pytorch", "pytorch (second process)"}
    assert set(phase["median_enqueue_share"]) == names
    for r in phase["rounds"]:
        assert set(r["step_times_s"]) == set(r["enqueue_times_s"]) == names
        for n in names:
            assert all(0 < e <= t + 1e-6 for e, t in zip(r["enqueue_times_s"][n],
                                                          r["step_times_s"][n],
                                                          strict=True))
    assert 0.5 < phase["median_enqueue_share"]["pytorch"] <= 1.0
    assert result["cores"] == str(sorted(os.sched_getaffinity(0))[0])


def test_step_lockstep_times_fresh_shapes_the_same_in_both_processes(tmp_path: Path) -> None:
    # The protocol on the CPU (tiny convnet, PyTorch's allocator on both sides): the timed
    # rounds draw shapes neither process warmed up on, the same in both, a new set each round.
    (phase,) = lockstep_self_check(tmp_path, "--rounds", "2", "--steps", "3",
                                   "--fraction-of-peak", "1.03")["phases"]
    assert phase["fraction_of_peak"] == 1.03 and not phase["failures"]
    # One cap for every process: 1.03 x the most any of them requested, not each its own.
    peak = phase["capped_for_requested_bytes"]
    assert phase["capped_at_bytes"] == {"pytorch": int(1.03 * peak),
                                        "expandable": int(1.03 * peak)}
    rounds = phase["rounds"]
    assert len(rounds) == 2 and phase["steps_compared"] == 6
    assert phase["timed_shapes_fresh"] and rounds[0]["shapes"] != rounds[1]["shapes"]
    # Out-of-memory errors the code caught and went on from (cuDNN's smaller workspace) are
    # counted per side, beside the retries: none on the CPU.
    assert phase["num_ooms"] == phase["num_alloc_retries"] == {"pytorch": 0, "expandable": 0}
    for r in rounds:
        assert set(r["step_device_calls"]) == {"pytorch", "expandable"}
        assert all(set(c) == {"num_device_alloc", "num_device_free", "num_sync_all_streams"}
                   for calls in r["step_device_calls"].values() for c in calls)
    assert phase["median_step_ratio"] > 0


class _ScriptedTrainer:
    """A stand-in for a training process that answers the lockstep coordinator's commands
    with a peak request of its own: on the CPU the real processes count no requested bytes, so
    they cannot show two peaks apart."""

    def __init__(self, name: str, requested: int) -> None:
        self.name, self.requested, self.sent = name, requested, []

    def send(self, what: str) -> None:
        self.sent.append(what)

    def read(self, timeout: float = 0) -> dict:
        command, *arg = self.sent[-1].split()
        if command == "peak":
            return {"requested": self.requested}
        if command == "cap":
            return {"capped_at_bytes": int(float(arg[0]) * max(self.requested, int(arg[1])))}
        assert command == "stats", command
        return {"peak_reserved": 0, "peak_requested": 0, "phase_peak_reserved": 0,
                "phase_peak_requested": 0, "num_alloc_retries": 0, "num_ooms": 0,
                "warmup_shapes": []}


def test_step_lockstep_caps_every_process_at_the_most_any_requested() -> None:
    # A program whose peak request follows its timing peaks differently in each process: every
    # process is capped at 1.03 x the largest of those peaks, not each at its own.
    from bench.gpu.step_lockstep import run_phase
    trainers = [_ScriptedTrainer("allocwatch", 100 << 20),
                _ScriptedTrainer("pytorch", 130 << 20),
                _ScriptedTrainer("expandable", 90 << 20)]
    phase = run_phase(list(trainers), 1.03, rounds=0, steps=1)
    assert phase["capped_for_requested_bytes"] == 130 << 20
    assert set(phase["capped_at_bytes"].values()) == {int(1.03 * (130 << 20))}
    assert all(t.sent[:2] == ["peak", f"cap 1.03 {130 << 20}"] for t in trainers)


@pytest.mark.timeout(180)
def test_step_lockstep_a_run_stopped_midway_keeps_every_round_it_timed(tmp_path: Path) -> None:
    # A device call's time limit stops a run with SIGTERM: the rounds timed so far are in the
    # file, whole, and pool; each step carries what its process took from the host. (Rounds
    # without end, so that the stop always comes midway; the finally stops them.)
    pytest.importorskip("torch")
    out_file, log = tmp_path / "lockstep.json", tmp_path / "lockstep.log"

    def saved_rounds() -> int:
        assert run.poll() is None, f"the run ended (exit {run.poll()}): {log.read_text()[-2000:]}"
        return len(json.loads(out_file.read_text())["phases"][0]["rounds"]) \
            if out_file.exists() else 0

    with log.open("w") as stderr:
        run = subprocess.Popen([sys.executable, "-m", "bench.gpu.step_lockstep", "--self-check",
                                "--model", "convnet", "--rounds", "100000", "--steps", "2",
                                "--json", str(out_file)], cwd=REPO, stdout=subprocess.DEVNULL,
                               stderr=stderr, start_new_session=True)
        try:
            wait_for(lambda: saved_rounds() >= 2, timeout=120, what="two rounds saved")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(run.pid, signal.SIGTERM)
            run.wait(30)
    (phase,) = json.loads(out_file.read_text())["phases"]
    assert 2 <= len(phase["rounds"]) < 100000 and "median_step_ratio" not in phase
    for r in phase["rounds"]:
        for used in (u for steps in r["step_usage"].values() for u in steps):
            assert set(used) == {"user_s", "system_s", "minor_faults", "voluntary_switches",
                                 "involuntary_switches"} and used["user_s"] >= 0
    pooled = pool_lockstep(out_file, "--judged", "pytorch")
    assert pooled.returncode == 0 and f"over {2 * len(phase['rounds'])} steps" in pooled.stdout


def test_step_lockstep_with_fixed_shapes_times_one_shape_every_step(tmp_path: Path) -> None:
    result = lockstep_self_check(tmp_path, "--fixed-shapes", "--rounds", "2", "--steps", "2")
    (phase,) = result["phases"]
    assert result["fixed_shapes"] and not phase["failures"]
    shapes = [tuple(map(tuple, s)) for r in phase["rounds"] for s in r["shapes"]]
    assert len(shapes) == 4 and len(set(shapes)) == 1
    assert not phase["timed_shapes_fresh"]  # the warm-up's shapes, as a fixed-shape job's


def test_host_profile_compares_the_same_steps_op_by_op(tmp_path: Path) -> None:
    # The protocol on the CPU (tiny convnet, PyTorch's allocator on both sides): every process
    # profiles the same steps, so both sides see the same ops the same number of times, and the
    # totals are the sums of the per-op figures.
    out_json = tmp_path / "profile.json"
    out = subprocess.run([sys.executable, "-m", "bench.gpu.host_profile", "--self-check", "--reps",
                          "2", "--steps", "2", "--json", str(out_json)], cwd=REPO,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out_json.read_text())
    ours, theirs = result["labels"]
    assert (ours, theirs) == ("pytorch", "pytorch (second)")
    assert [len(result["runs"][label]) for label in (ours, theirs)] == [2, 2]
    counts = [{op: v["count"] for op, v in run["ops"].items()}
              for label in (ours, theirs) for run in result["runs"][label]]
    assert all(c == counts[0] for c in counts) and "aten::convolution" in counts[0]
    assert all(len(run["step_s"]) == 2 and run["allocations_per_step"] == 0  # no CUDA here
               for label in (ours, theirs) for run in result["runs"][label])
    total = sum(row["ours_us"] for row in result["ops"])
    assert total == pytest.approx(result["self_cpu_us_total"][ours]) and total > 0
    assert [row["difference_us"] for row in result["ops"]] == sorted(
        row["difference_us"] for row in result["ops"])
    assert "self CPU time over 2 profiled steps" in out.stdout
    # Without --fresh the timed steps are the warm-up's own again.
    assert all(run["timed_shapes"] == run["warmup_shapes"]
               for label in (ours, theirs) for run in result["runs"][label])


def test_host_profile_fresh_times_shapes_the_warm_up_never_drew(tmp_path: Path) -> None:
    out_json = tmp_path / "profile.json"
    out = subprocess.run([sys.executable, "-m", "bench.gpu.host_profile", "--self-check", "--fresh",
                          "--reps", "1", "--steps", "3", "--json", str(out_json)], cwd=REPO,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out_json.read_text())
    runs = [run for label in result["labels"] for run in result["runs"][label]]
    assert len(runs) == 2
    assert runs[0]["timed_shapes"] == runs[1]["timed_shapes"]  # the same in every process
    assert all(run["timed_shapes"] != run["warmup_shapes"] for run in runs)
    assert all(run["mem_get_info_us"] == 0 and run["kernels"] == {} for run in runs)  # no CUDA


def pool_lockstep(*args: str | Path) -> subprocess.CompletedProcess:
    """bench.gpu.lockstep_pool run where the raw lockstep results are kept."""
    command = [sys.executable, "-m", "bench.gpu.lockstep_pool", *map(str, args)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    return subprocess.run(command, cwd=REPO / "docs/results", env=env, capture_output=True,
                          text=True, timeout=60)


CONVNET_RUNS = [f"end_to_end_h100_convnet_{call}_{order}.json" for call in ("a", "b", "c")
                for order in ("allocwatch_first", "expandable_first", "cap103_allocwatch_first",
                              "cap103_expandable_first")]


def test_lockstep_pool_reproduces_the_documented_convnet_verdict_from_the_raw_runs(
        tmp_path: Path) -> None:
    # docs/benchmarks.md ("End to end", H100): seven convnet runs pool to 0.993 uncapped and
    # 0.995 at 1.03 x, settled, every run below 1.00 on its own; the runs that timed
    # expandable's process first count inverted; the gap splits by whether a step's shape is new.
    out_json = tmp_path / "pooled.json"
    out = pool_lockstep(*CONVNET_RUNS, "end_to_end_h100_suite_convnet.json", "--json", out_json)
    assert out.returncode == 0, out.stderr
    uncapped, capped = json.loads(out_json.read_text())["groups"]
    assert (uncapped["fraction_of_peak"], capped["fraction_of_peak"]) == (0, 1.03)
    assert (uncapped["rounds"], uncapped["steps"], len(uncapped["runs"])) == (104, 1248, 7)
    assert round(uncapped["median_step_ratio"], 3) == 0.993 and uncapped["settled"]
    assert round(capped["median_step_ratio"], 3) == 0.995 and capped["settled"]
    assert [round(g["interval_95"][0], 3) for g in (uncapped, capped)] == [0.991, 0.994]
    # With the pairs of processes drawn too, the interval widens and the verdict still holds.
    for group in (uncapped, capped):
        low, high = group["interval_95_across_processes"]
        assert low <= group["interval_95"][0] and group["interval_95"][1] <= high < 1.0
        assert group["settled_across_processes"]
    assert all(run["median_step_ratio"] < 1.0 for run in uncapped["runs"] + capped["runs"])
    inverted = next(r for r in uncapped["runs"] if r["file"] == "end_to_end_h100_convnet_a_"
                    "expandable_first.json")
    assert round(inverted["median_step_ratio"], 3) == 0.993  # 1.007 as recorded, inverted
    shapes = uncapped["by_shape"]
    assert (shapes["new"]["steps"], shapes["repeated"]["steps"]) == (1106, 142)
    assert round(shapes["new"]["median_step_ratio"], 3) == 0.993
    assert round(shapes["repeated"]["median_step_ratio"], 3) == 0.996
    assert "meets the bar" in out.stdout and "misses" not in out.stdout
    assert "steps of a shape new to the run: 1106" in out.stdout
    # The interval is drawn from a fixed seed: the same files give the same interval.
    again = pool_lockstep(*CONVNET_RUNS, "end_to_end_h100_suite_convnet.json")
    assert again.stdout == out.stdout


def test_lockstep_pool_reproduces_the_loaded_control_and_says_when_a_verdict_is_not_settled(
        tmp_path: Path) -> None:
    # docs/benchmarks.md ("End to end"): with allocwatch's libraries loaded but unused,
    # expandable segments time 0.999 against themselves, settled.
    out_json = tmp_path / "pooled.json"
    done = pool_lockstep("--judged", "expandable-loaded", "end_to_end_h100_control_loaded_1.json",
                         "end_to_end_h100_control_loaded_2.json", "--json", out_json)
    assert done.returncode == 0, done.stderr
    [loaded] = json.loads(out_json.read_text())["groups"]
    assert round(loaded["median_step_ratio"], 3) == 0.999 and loaded["settled"]
    assert [round(x, 3) for x in loaded["interval_95"]] == [0.996, 1.001]
    # The suite's single convnet run: its median meets the bar, but its interval over 8 rounds
    # crosses 1.005, so the verdict is not settled (docs/results/end_to_end_h100_suite_pooled.txt).
    done = pool_lockstep("end_to_end_h100_suite_convnet.json", "--json", out_json)
    uncapped, capped = json.loads(out_json.read_text())["groups"]
    assert round(uncapped["median_step_ratio"], 3) == 0.993 and uncapped["meets_bar"]
    assert [round(x, 3) for x in uncapped["interval_95"]] == [0.973, 1.006]
    assert not uncapped["settled"] and capped["settled"]
    assert uncapped["interval_95_across_processes"] is None  # one run: one pair of processes
    assert "0.973-1.006 (the verdict differs at its ends: not settled)" in done.stdout


def test_lockstep_pool_never_pools_comparisons_with_different_allocators(tmp_path: Path) -> None:
    # Judging expandable segments: against allocwatch (a convnet bar run, inverted) and against
    # expandable-loaded (the control's two runs) are two verdicts, never one.
    out_json = tmp_path / "pooled.json"
    out = pool_lockstep("--judged", "expandable", "end_to_end_h100_convnet_a_allocwatch_first.json",
                        "end_to_end_h100_control_loaded_1.json",
                        "end_to_end_h100_control_loaded_2.json", "--json", out_json)
    assert out.returncode == 0, out.stderr
    groups = {g["against"]: g for g in json.loads(out_json.read_text())["groups"]}
    assert sorted(groups) == ["allocwatch", "expandable-loaded"]
    assert [len(groups[a]["runs"]) for a in sorted(groups)] == [1, 2]
    assert round(groups["allocwatch"]["median_step_ratio"], 3) == 1.005
    assert not groups["allocwatch"]["meets_bar"]
    assert "convnet, uncapped, against allocwatch: median per-step ratio 1.005" in out.stdout
    assert "misses the bar" in out.stdout


def test_lockstep_pool_interval_is_the_median_itself_where_resampling_cannot_move_it(
        tmp_path: Path) -> None:
    # Every round has the median 1.0, so no draw of them moves it; a run without recorded
    # shapes has no split.
    def run(name: str, ratios: list[float]) -> Path:
        path = tmp_path / name
        path.write_text(json.dumps({"ours": "allocwatch", "against": "expandable",
                                    "model": "convnet", "phases": [{
                                        "fraction_of_peak": 0.0,
                                        "rounds": [{"step_ratios": ratios} for _ in range(8)]}]}))
        return path

    out_json = tmp_path / "pooled.json"
    out = pool_lockstep(run("a.json", [0.99, 1.0, 1.01]), run("b.json", [1.0, 1.0, 1.0]),
                        "--json", out_json)
    assert out.returncode == 0, out.stderr
    (group,) = json.loads(out_json.read_text())["groups"]
    assert group["median_step_ratio"] == 1.0 and group["interval_95"] == [1.0, 1.0]
    assert group["interval_95_across_processes"] == [1.0, 1.0]
    assert group["settled"] and group["settled_across_processes"] and group["by_shape"] is None
    assert "new to the run" not in out.stdout
    # One run: there are no processes to draw among.
    out = pool_lockstep(run("a.json", [0.99, 1.0, 1.01]), "--json", out_json)
    (group,) = json.loads(out_json.read_text())["groups"]
    assert group["interval_95_across_processes"] is None
    assert group["settled_across_processes"] is None and "resampled too" not in out.stdout


def test_lockstep_pool_refuses_a_run_that_did_not_time_the_judged_allocator(
        tmp_path: Path) -> None:
    out = pool_lockstep("end_to_end_h100_convnet_a_allocwatch_first.json",
                        "end_to_end_h100_control_loaded_1.json")
    assert out.returncode == 2 and out.stdout == ""
    assert ("control_loaded_1.json: times expandable-loaded against expandable, not allocwatch"
            in out.stderr)
    # The harness against itself (one allocator on both sides) is no comparison to pool.
    same = tmp_path / "same.json"
    same.write_text(json.dumps({"ours": "allocwatch", "against": "allocwatch", "model": "convnet",
                                "phases": [{"rounds": [{"step_ratios": [1.0]}]}]}))
    out = pool_lockstep(same)
    assert out.returncode == 2 and "same.json: times allocwatch against allocwatch" in out.stderr
    corrupt = tmp_path / "cut.json"
    corrupt.write_text('{"ours": "allocwatch", "phases": [')
    out = pool_lockstep(corrupt)
    assert out.returncode == 2 and "cut.json: not a step_lockstep.py result" in out.stderr


def test_gpu_checks_documents_every_part_it_runs_and_runs_every_part_it_documents() -> None:
    # The header is the GPU session's menu: a part missing from it is never asked for, a part
    # only in it fails on the device, where a call costs minutes.
    script = (REPO / "bench/gpu/gpu_checks.sh").read_text()
    documented = set(re.findall(r"^#   ([a-z0-9-]+)\s", script.split("\nset -u")[0], re.M))
    body = script[script.index("run_part() {"):script.index("main() {")]
    runs = set(re.findall(r"^    ([a-z0-9-]+)\)", body, re.M))
    assert documented == runs and {"convnetbar", "convnetsplit", "lockstep"} <= runs
    out = subprocess.run(["bash", "-n", "bench/gpu/gpu_checks.sh"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_host_profile_refuses_zero_steps() -> None:
    out = subprocess.run([sys.executable, "-m", "bench.gpu.host_profile", "--self-check", "--steps",
                          "0"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--reps and --steps must be at least 1" in out.stderr


@pytest.mark.xdist_group(BENCH_BUILD_GROUP)  # run_hotpath.sh builds there
def test_core_hot_path_benchmark_builds_and_reports_every_pattern(tmp_path: Path) -> None:
    # Built with the project's only build requirement, a C++ compiler; the figures themselves
    # count only on the H200 host (docs/benchmarks.md).
    out_file = tmp_path / "hotpath.json"
    out = subprocess.run(["bash", "bench/native/run_hotpath.sh", "--rounds", "2", "--json",
                          str(out_file)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "device calls inside the timed loop" not in out.stderr
    result = json.loads(out_file.read_text())
    assert result["rounds"] == 2
    patterns = {r["pattern"]: r for r in result["results"]}
    assert len(patterns) == 14
    assert all(0 < r["p10_ns"] <= r["median_ns"] <= r["p90_ns"] for r in patterns.values())
    assert set(result["scale_ratio"]) == {"native", "allocwatch"}


@pytest.mark.xdist_group(BENCH_BUILD_GROUP)
def test_core_hot_path_benchmark_refuses_an_unknown_option() -> None:
    out = subprocess.run(["bash", "bench/native/run_hotpath.sh", "--round", "2"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert "usage: hotpath" in out.stderr


def test_hotpath_ratios_compare_batches_of_the_same_round() -> None:
    samples = []
    # The host is twice as slow in round 1: within each round allocwatch takes half the time.
    for rnd, pace in [(0, 1.0), (1, 2.0), (2, 1.0)]:
        for pattern in [*HOTPATH_PATTERNS, TORCH_EMPTY]:
            samples.append({"round": rnd, "pattern": pattern, "allocator": "pytorch",
                            "ns": 400 * pace})
            samples.append({"round": rnd, "pattern": pattern, "allocator": "allocwatch",
                            "ns": (200 if rnd < 2 else 300) * pace})
    got = compare_hotpath(samples)
    assert got["ratio_to_pytorch"]["allocwatch"]["512B"] == pytest.approx(0.5)
    assert got["geomean_ratio"]["allocwatch"] == pytest.approx(0.5)
    assert got["median_ns"]["pytorch"]["mix1000"] == pytest.approx(400)
    assert "pytorch" not in got["geomean_ratio"]


SMALL_TRACE = REPO / "tests" / "data" / "traces" / "convnet_fixed__default.pickle.gz"


def test_a_trace_program_frees_only_what_it_allocated(tmp_path: Path) -> None:
    out = tmp_path / "program.txt"
    done = subprocess.run([sys.executable, "-m", "bench.replay.trace_program", str(SMALL_TRACE),
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    header, *lines = out.read_text().splitlines()
    magic, version, count, ids = header.split()
    assert (magic, version, int(count)) == ("allocwatch-program", "1", len(lines))
    live: set[int] = set()
    allocated = 0
    for line in lines:
        kind, ident, *rest = line.split()
        if kind == "a":
            assert int(ident) not in live and len(rest) == 2
            live.add(int(ident))
            allocated += 1
        else:
            live.remove(int(ident))  # a free names a live allocation
    trace = load_trace(SMALL_TRACE)
    assert allocated == int(ids) == sum(e.action == "alloc" for e in trace.events)


@pytest.mark.xdist_group(BENCH_BUILD_GROUP)  # run_trace_ops.sh builds there
def test_trace_ops_times_each_setting_without_device_calls(tmp_path: Path) -> None:
    # Built with a C++ compiler alone; the figures count only on an idle host.
    out_file = tmp_path / "trace_ops.json"
    done = subprocess.run(["bash", "bench/native/run_trace_ops.sh", str(SMALL_TRACE),
                           "--rounds", "2", "--json", str(out_file), "defaults", "native"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out_file.read_text())
    assert result["rounds"] == 2 and result["operations"] > 1000
    by_setting = {r["setting"]: r for r in result["results"]}
    assert list(by_setting) == ["defaults", "native"]
    assert by_setting["defaults"]["ratio_to_first"] == 1.0
    # The layout settled in the untimed passes: the timed ones call the device never.
    assert all(r["timed_device_calls"] == 0 and r["median_ns_per_op"] > 0
               for r in by_setting.values())


@pytest.mark.xdist_group(BENCH_BUILD_GROUP)
@pytest.mark.parametrize("line, why", [("a 0 512", "bad operation 'a 0 512'"),
                                       ("f 0", "bad operation 'f 0'"),
                                       ("a 5 512 0", "bad operation 'a 5 512 0'")])
def test_trace_ops_refuses_a_bad_program_naming_the_line(tmp_path: Path, line: str,
                                                         why: str) -> None:
    program = tmp_path / "program.txt"
    program.write_text(f"allocwatch-program 1 1 1\n{line}\n")
    subprocess.run(["bash", "bench/native/build.sh", str(BENCH_BUILD), "trace_ops"], cwd=REPO,
                   capture_output=True, timeout=300, check=True)
    done = subprocess.run([str(BENCH_BUILD / "trace_ops"), str(program),
                           "defaults"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert f"{program}:2: {why}" in done.stderr


def test_trace_program_refuses_a_corrupt_trace_and_writes_nothing(tmp_path: Path) -> None:
    corrupt = tmp_path / "corrupt.pickle.gz"
    corrupt.write_bytes(b"\x1f\x8b not a gzip stream")
    out = tmp_path / "program.txt"
    done = subprocess.run([sys.executable, "-m", "bench.replay.trace_program", str(corrupt),
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.startswith(f"trace_program: {corrupt}")
    assert not out.exists()
