"""bench.gpu.patterns, the GPU table of every workload pattern, and what it takes from
bench.gpu.step_lockstep and bench.gpu.lockstep_pool: lockstep of several processes, a process
that leaves under a cap, and the table written from lockstep files. The table's tests read
lockstep files written here by hand (fabricated: the formatter is what they check); the
self-check runs the real three processes on the CPU."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.paths import REPO

from bench.gpu import lockstep_pool, patterns, step_lockstep

# ---- the lockstep of several processes


@pytest.mark.parametrize("count", [2, 3, 4])
def test_every_pair_of_processes_meets_in_both_orders_equally_often(count: int) -> None:
    names = [f"p{i}" for i in range(count)]
    orders = step_lockstep.step_orders(names)  # type: ignore[arg-type]
    assert len(orders) == (2 if count == 2 else 2 * count)
    for a, b in itertools.permutations(names, 2):
        first = sum(o.index(a) < o.index(b) for o in orders)
        assert first * 2 == len(orders), (a, b)
    # Two processes keep the order the runs recorded so far used: each first in turn.
    assert step_lockstep.step_orders(["a", "b"]) == [["a", "b"], ["b", "a"]]  # type: ignore


class FakeTrainer:
    """A training process's answers without the process (the parent's bookkeeping is what is
    checked): each step takes `seconds`, and the process fails at step `fail_at`, if given."""

    def __init__(self, name: str, seconds: float, fail_at: int | None = None,
                 failure: str = "oom: 'CUDA out of memory'") -> None:
        self.name, self.seconds, self.fail_at, self.failure = name, seconds, fail_at, failure
        self.steps = 0          # steps taken in all
        self.drawn: list[int] = [0, 0]  # the seed, and the steps since it was set
        self.pending: list[Any] = []
        self.finished = False

    def send(self, what: str) -> None:
        command = what.split()[0]
        if command == "seed":  # shapes follow the seed alone, as the workloads' do
            self.drawn = [int(what.split()[1]), 0]
        if command == "step":
            self.steps += 1
            self.drawn[1] += 1
            if self.steps == self.fail_at:
                self.pending.append(step_lockstep.RoundFailed(
                    f"{self.name}: {self.failure}", self.name, self.failure.startswith("oom")))
                return
            self.pending.append({"s": self.seconds, "enqueue_s": self.seconds / 2,
                                 "shape": list(self.drawn), "usage": dict.fromkeys(
                                     step_lockstep.USAGE, 0.0),
                                 "calls": {"num_device_alloc": 1, "num_device_free": 0,
                                           "num_sync_all_streams": 0},
                                 "waits": {"num_host_waits.stream": 1, "num_stream_waits": 2}
                                 if self.name == "allocwatch" else None,
                                 "driver_calls": {"num_device_calls.map": 8,
                                                  "num_device_calls.set_access": 1}
                                 if self.name == "allocwatch" else None})
        elif command == "stats":
            self.pending.append({"peak_reserved": 110, "peak_requested": 100,
                                 "phase_peak_reserved": 120, "phase_peak_requested": 100,
                                 "num_alloc_retries": 0, "num_ooms": 0,
                                 "warmup_shapes": []})
        else:
            self.pending.append("ok")

    def read(self, timeout: float = 0) -> Any:
        answer = self.pending.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def ask(self, what: str, timeout: float = 0) -> Any:
        self.send(what)
        return self.read()

    def finish(self) -> None:
        self.finished = True


def test_a_process_that_fails_leaves_and_the_others_go_on() -> None:
    ours = FakeTrainer("allocwatch", 1.0)
    default = FakeTrainer("pytorch", 2.0, fail_at=3)  # in the second round of two steps
    expandable = FakeTrainer("expandable", 0.8)
    trainers = [ours, default, expandable]
    phase = step_lockstep.run_phase(trainers, 0.0, 3, 2)  # type: ignore[arg-type]
    assert trainers == [ours, expandable] and default.finished
    assert list(phase["left"]) == ["pytorch"] and "out of memory" in phase["left"]["pytorch"]
    assert not phase["failures"] and len(phase["rounds"]) == 3
    # The round it failed in was timed again without it: the last two rounds have no pytorch.
    assert [sorted(r["step_ratios_against"]) for r in phase["rounds"]] == [
        ["expandable", "pytorch"], ["expandable"], ["expandable"]]
    vs = phase["against"]
    assert vs["pytorch"]["rounds"] == 1 and vs["pytorch"]["median_step_ratio"] == 0.5
    assert vs["expandable"]["rounds"] == 3 and vs["expandable"]["median_step_ratio"] == 1.25
    assert vs["expandable"]["interval_95"] == [1.25, 1.25]
    assert phase["host_waits_per_step"]["allocwatch"]["num_host_waits.stream"] == 1
    assert phase["host_waits_per_step"]["expandable"] is None  # PyTorch counts no waits
    assert phase["device_calls_per_step"]["expandable"]["all"] == 1
    # The driver calls behind a mapping, where the allocator counts them (allocwatch's).
    assert phase["driver_calls_per_step"]["allocwatch"]["all"] == 9
    assert phase["driver_calls_per_step"]["expandable"] is None
    assert phase["phase_reserved_over_requested"] == {"allocwatch": 1.2, "expandable": 1.2}
    assert step_lockstep.succeeded({"phases": [phase]})


def test_where_every_other_runs_out_of_memory_ours_goes_on_alone_for_its_memory() -> None:
    # Under a cap both of PyTorch's allocators run out in the second round: ours times the
    # rounds left alone, so the phase still says what ours reserved and retried there.
    ours = FakeTrainer("allocwatch", 1.0)
    trainers = [ours, FakeTrainer("pytorch", 2.0, fail_at=3),
                FakeTrainer("expandable", 0.8, fail_at=3)]
    phase = step_lockstep.run_phase(trainers, 0.0, 3, 2)  # type: ignore[arg-type]
    assert trainers == [ours] and sorted(phase["left"]) == ["expandable", "pytorch"]
    assert not phase["failures"] and len(phase["rounds"]) == 3
    assert [r["ratio"] for r in phase["rounds"]][1:] == [None, None]
    assert [sorted(r["step_times_s"]) for r in phase["rounds"]][1:] == [["allocwatch"]] * 2
    assert phase["against"]["pytorch"]["rounds"] == 1
    assert phase["phase_reserved_over_requested"] == {"allocwatch": 1.2}
    assert phase["num_alloc_retries"] == {"allocwatch": 0}
    assert phase["host_waits_per_step"]["allocwatch"]["num_stream_waits"] == 2
    assert step_lockstep.succeeded({"phases": [phase]})
    # The table shows ours's memory beside the others' out-of-memory, and no step ratio.
    row = patterns.phase_row({"model": "kv_generate", "ours": "allocwatch"}, phase, None)
    assert row["step_ratio"] is None and row["reserved_over_requested"] == {"allocwatch": 1.2}
    assert sorted(row["left"]) == ["expandable", "pytorch"]


def test_when_our_process_fails_or_another_fails_otherwise_the_phase_fails() -> None:
    trainers = [FakeTrainer("allocwatch", 1.0, fail_at=2), FakeTrainer("pytorch", 1.0),
                FakeTrainer("expandable", 1.0)]
    phase = step_lockstep.run_phase(trainers, 0.0, 3, 2)  # type: ignore[arg-type]
    assert phase["failures"] and not phase["left"] and not phase["rounds"]
    assert not step_lockstep.succeeded({"phases": [phase]})
    # A wrong result (the stream pipeline's check) is no reason to leave quietly.
    wrong = FakeTrainer("pytorch", 1.0, fail_at=2, failure="error: 'WrongResult: item 0'")
    trainers = [FakeTrainer("allocwatch", 1.0), wrong, FakeTrainer("expandable", 1.0)]
    phase = step_lockstep.run_phase(trainers, 0.0, 3, 2)  # type: ignore[arg-type]
    assert phase["failures"] == ["pytorch: error: 'WrongResult: item 0'"]
    assert not phase["left"] and len(trainers) == 3


def lockstep_file(path: Path, model: str, phases: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps({"model": model, "ours": "allocwatch", "against": "pytorch",
                                "others": ["pytorch", "expandable"], "source": "abc1234",
                                "device": "NVIDIA H100 80GB HBM3", "phases": phases}))
    return path


def timed_phase(fraction: float, ratios: dict[str, list[float]],
                times: dict[str, float]) -> dict[str, Any]:
    """A phase as step_lockstep writes it (its rounds and its summary), from each other's
    per-step ratios and each process's total step time."""
    rounds = [{"step_ratios_against": {n: r[i:i + 2] for n, r in ratios.items()},
               "step_ratios": ratios["pytorch"][i:i + 2], "shapes": [[i], [i + 1]]}
              for i in range(0, len(ratios["pytorch"]), 2)]
    return {
        "fraction_of_peak": fraction, "rounds": rounds, "failures": [], "left": {},
        "phase_reserved_over_requested": {"allocwatch": 1.004, "pytorch": 1.62,
                                          "expandable": 1.071},
        "against": {n: {"rounds": len(rounds), "steps_compared": len(r),
                        "median_step_ratio": sorted(r)[len(r) // 2], "interval_95": [0.9, 1.1],
                        "step_time_s": {"allocwatch": times["allocwatch"], n: times[n]}}
                    for n, r in ratios.items()},
        "host_waits_per_step": {"allocwatch": {"num_host_waits.device": 0.0,
                                               "num_host_waits.stream": 0.25,
                                               "num_host_waits.event": 0.0,
                                               "num_host_waits.unmap_thread": 0.0,
                                               "num_stream_waits": 1.5, "all": 1.75},
                                "pytorch": None, "expandable": None},
        "device_calls_per_step": {"allocwatch": {"all": 2.5}, "pytorch": {"all": 0.125},
                                  "expandable": {"all": 1.0}},
        "driver_calls_per_step": {"allocwatch": {"all": 34.0}, "pytorch": None,
                                  "expandable": None},
        "num_alloc_retries": {"allocwatch": 0, "pytorch": 3, "expandable": 0},
    }


def test_the_table_compares_with_the_faster_other_and_shows_each_allocators_figures(
        tmp_path: Path) -> None:
    # Fabricated lockstep results (the table's formatting is under test): expandable's process
    # was the faster uncapped; under the cap PyTorch's default ran out of memory and left.
    uncapped = timed_phase(0.0, {"pytorch": [0.90, 0.95, 0.97, 0.99],
                                 "expandable": [0.99, 1.00, 1.01, 1.02]},
                           {"allocwatch": 4.0, "pytorch": 4.2, "expandable": 3.99})
    capped = timed_phase(1.03, {"pytorch": [0.9, 0.9], "expandable": [0.97, 0.99]},
                         {"allocwatch": 2.0, "pytorch": 1.0, "expandable": 2.05})
    capped["left"] = {"pytorch": "pytorch: oom: 'CUDA out of memory'"}
    del capped["phase_reserved_over_requested"]["pytorch"]  # as step_lockstep writes it
    lockstep_file(tmp_path / "lockstep_convnet.json", "convnet", [uncapped, capped])
    lockstep_file(tmp_path / "lockstep_graph.json", "graph", [])  # nothing ran
    (tmp_path / "lockstep_graph.json").write_text(json.dumps({
        "model": "graph", "ours": "allocwatch", "phases": [],
        "failures": ["skipped: the graph workload needs torch_geometric"]}))
    md, js = tmp_path / "t.md", tmp_path / "t.json"
    out = subprocess.run([sys.executable, "-m", "bench.gpu.patterns", "table", str(tmp_path),
                          "--markdown", str(md), "--json", str(js)], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = md.read_text().splitlines()
    assert lines[0].startswith("| pattern | cap | peak reserved ÷ peak requested (default / "
                               "expandable / allocwatch) | floor |")
    # The floor of convnet's recorded trace (tests/data/traces), the faster other (expandable,
    # of less total step time), allocwatch's waits, each allocator's calls (allocwatch's
    # driver calls behind them) and retries.
    assert lines[2] == ("| convnet | uncapped | 1.620 / 1.071 / 1.004 | 1.000 | **1.010** "
                        "(0.900–1.100) vs expandable, 2 rounds | 0 / 0.25 / 0 / 0; 1.5 | "
                        "0.12 / 1 / 2.5; 34 | 3 / 0 / 0 |")
    # Capped: the default's process left (OOM), so expandable is the faster one left; the
    # columns keep the heading's order, the one that left in its place.
    assert lines[3].startswith("| convnet | 1.03 × | OOM / 1.071 / 1.004 | 1.000 | **0.990** ")
    assert lines[4].startswith("| graph | — | failed: skipped: the graph workload needs")
    assert "source abc1234; device NVIDIA H100 80GB HBM3." in lines[-1]
    rows = json.loads(js.read_text())["rows"]
    assert [r["faster_other"] for r in rows[:2]] == ["expandable", "expandable"]
    assert rows[0]["step_ratio_against"] == {"pytorch": 0.97, "expandable": 1.01}
    assert out.stdout.strip() == md.read_text().strip()


def test_the_table_refuses_what_is_not_a_lockstep_folder_naming_it(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    out = subprocess.run([sys.executable, "-m", "bench.gpu.patterns", "table", str(empty),
                          "--markdown", str(tmp_path / "t.md")], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "empty: no lockstep_<pattern>.json in it" in out.stderr
    (empty / "lockstep_moe.json").write_text('{"phases": [')
    out = subprocess.run([sys.executable, "-m", "bench.gpu.patterns", "table", str(empty)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "lockstep_moe.json: not a step_lockstep result" in out.stderr
    assert not (tmp_path / "t.md").exists()


def test_pooling_a_run_of_three_gives_a_verdict_against_each_other(tmp_path: Path) -> None:
    path = lockstep_file(tmp_path / "three.json", "convnet", [timed_phase(
        0.0, {"pytorch": [0.9] * 4, "expandable": [1.0, 1.02, 1.02, 1.04]},
        {"allocwatch": 1.0, "pytorch": 1.1, "expandable": 0.98})])
    groups = {g["against"]: g for g in lockstep_pool.pool([path], "allocwatch")}
    assert sorted(groups) == ["expandable", "pytorch"]
    assert groups["pytorch"]["median_step_ratio"] == 0.9 and groups["pytorch"]["meets_bar"]
    assert groups["expandable"]["median_step_ratio"] == 1.02
    # Judged from the other side: expandable over allocwatch, inverted.
    (inverted,) = lockstep_pool.pool([path], "expandable")
    assert inverted["against"] == "allocwatch"
    assert inverted["median_step_ratio"] == pytest.approx(1 / 1.02)


def test_the_suite_runs_three_processes_in_lockstep_on_the_cpu(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = subprocess.run([sys.executable, "-m", "bench.gpu.patterns", "run", str(tmp_path),
                          "--self-check", "--only", "stream_pipeline", "--rounds", "2",
                          "--steps", "2"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    result = json.loads((tmp_path / "lockstep_stream_pipeline.json").read_text())
    assert result["others"] == ["expandable", "pytorch"] and len(result["phases"]) == 2
    for phase in result["phases"]:
        assert len(phase["rounds"]) == 2 and not phase["failures"]
        names = {"pytorch", "expandable", "pytorch (second process)"}
        assert all(set(r["step_times_s"]) == names for r in phase["rounds"])
        # The same fresh shapes in all three, the checked results among them.
        assert phase["timed_shapes_fresh"]
    assert "| stream_pipeline | uncapped |" in out.stdout
    assert "| stream_pipeline | 1.03 × |" in out.stdout


def test_a_setting_is_judged_against_the_defaults_in_the_same_lockstep(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The processes run_workload would start are what is checked: the judged allocator, and the
    # defaults beside PyTorch's two (named once, however often given).
    seen: list[tuple[str, list[str]]] = []

    def fake_run_workload(name: str, ours: str, against: list[str], *rest: Any) -> dict:
        seen.append((ours, list(against)))
        result = {"model": name, "ours": ours, "phases": [], "failures": ["not run"]}
        rest[-1].write_text(json.dumps(result))  # the lockstep file, as the real one writes
        return result

    monkeypatch.setattr(step_lockstep, "run_workload", fake_run_workload)
    monkeypatch.setattr(step_lockstep, "pin_parent", lambda cores: "0")
    failed = patterns.run(tmp_path, ["convnet"], 1, 1, False, False,
                          "allocwatch-unmap-off-thread", ("allocwatch", "pytorch", "allocwatch"))
    assert seen == [("allocwatch-unmap-off-thread", ["pytorch", "expandable", "allocwatch"])]
    assert failed == 1  # and a table of the failure alone is printed, not a crash
    # Every name given must be an allocator the benchmarks can start.
    bad = subprocess.run([sys.executable, "-m", "bench.gpu.patterns", "run", str(tmp_path),
                          "--also", "allocwatch-fastest"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "allocwatch-fastest" in bad.stderr


def test_every_pattern_is_a_workload_and_the_gpu_checks_run_them_all() -> None:
    from allocator_ext import workloads

    assert set(patterns.PATTERNS) <= set(workloads.NAMES)
    assert set(workloads.NAMES) - set(patterns.PATTERNS) == {"decode"}  # kv_generate's kin
    out = subprocess.run([sys.executable, "-m", "bench.gpu.patterns", "names"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == list(patterns.PATTERNS)
    script = (REPO / "bench/gpu/gpu_checks.sh").read_text()
    assert "-m bench.gpu.patterns names" in script and "-m bench.gpu.patterns table" in script


def test_the_floor_is_that_of_the_rows_own_program_where_it_is_recorded() -> None:
    # kv_generate is recorded both ways and their floors differ: the row takes the recording of
    # the lockstep program; convnet has only its plain recording.
    from allocator_ext.replay import load_trace
    from allocator_ext.replay.floor import reserved_floor
    from bench.gpu.patterns import TRACES, floor_of

    def floor(file: str) -> float:
        return reserved_floor(load_trace(TRACES / file)).ratio

    lockstep = floor("kv_generate__default_lockstep.pickle.gz")
    assert lockstep != floor("kv_generate__default.pickle.gz")
    assert floor_of("kv_generate", {}) == lockstep
    assert not (TRACES / "convnet__default_lockstep.pickle.gz").exists()
    assert floor_of("convnet", {}) == floor("convnet__default.pickle.gz")
