"""bench/replay/steady_state.py: passes of one trace on one allocator, peak reserved after pass
2 and after the last, device calls after pass 2 priced against the trace's active time, and
the bar."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import REPO

from allocator_ext.replay import load_trace, replay

SMALL = REPO / "tests/data/traces/convnet__default.pickle.gz"
OTHER = REPO / "tests/data/traces/convnet__roundup.pickle.gz"


def run_bench(tmp_path: Path, *args: str) -> dict:
    out_file = tmp_path / "steady.json"
    out = subprocess.run([sys.executable, "-m", "bench.replay.steady_state", *args, "--json",
                          str(out_file)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    result = json.loads(out_file.read_text())
    result["stdout"] = out.stdout
    return result


def test_a_few_passes_report_growth_after_pass_2_and_the_calls_that_remain(
        tmp_path: Path) -> None:
    result = run_bench(tmp_path, "--passes", "4", "--traces", str(SMALL))
    rows = result["passes"][SMALL.name]
    s = result["summary"][SMALL.name]
    assert len(rows) == s["passes"] == 4
    assert s["peak_reserved_after_pass_2"] == rows[1]["peak_reserved_bytes"]
    assert s["peak_reserved_after_last_pass"] == rows[-1]["peak_reserved_bytes"]
    assert s["peak_reserved_last_over_pass_2"] == pytest.approx(
        rows[-1]["peak_reserved_bytes"] / rows[1]["peak_reserved_bytes"])
    assert s["call_share_after_pass_2_max"] == max(r["call_share"] for r in rows[2:])
    assert s["meets_bar"] == (s["peak_reserved_last_over_pass_2"] <= 1.002
                              and s["call_share_after_pass_2_max"] <= 0.001
                              and s["mapped_beyond_reserved_after_last_pass"]
                              - s["mapped_beyond_reserved_after_pass_2"]
                              <= 0.002 * s["peak_reserved_after_pass_2"])
    # The first pass is what `allocwatch replay` reports.
    first = replay(load_trace(SMALL)).report
    assert rows[0]["peak_reserved_bytes"] == first["peak_reserved_bytes"]
    assert rows[0]["call_share"] == pytest.approx(first["device_call_share"])
    assert SMALL.name in result["stdout"] and "runs meet the bar" in result["stdout"]


def test_address_space_mapped_beyond_reserved_counts_against_the_bar(tmp_path: Path) -> None:
    # Aliased pages under a cap keep mapping FSDP2's memory at new addresses: reserved memory
    # flat, its mappings growing every pass; the bar counts that growth as it counts reserved's.
    fsdp2 = REPO / "tests/data/traces/fsdp2__default_lockstep.pickle.gz"
    result = run_bench(tmp_path, "--passes", "4", "--cap", "1.03", "--config",
                       "alias_pages:True,expandable_chunk_mb:4", "--traces", str(fsdp2))
    rows, s = result["passes"][fsdp2.name], result["summary"][fsdp2.name]
    assert s["mapped_beyond_reserved_after_pass_2"] == rows[1]["mapped_beyond_reserved_bytes"]
    assert s["mapped_beyond_reserved_after_last_pass"] == rows[-1]["mapped_beyond_reserved_bytes"]
    grown = s["mapped_beyond_reserved_after_last_pass"] - s["mapped_beyond_reserved_after_pass_2"]
    assert s["peak_reserved_last_over_pass_2"] <= 1.002
    assert grown > 0.002 * s["peak_reserved_after_pass_2"] and not s["meets_bar"]
    # Without aliases nothing is mapped beyond reserved memory.
    plain = run_bench(tmp_path, "--passes", "3", "--traces", str(SMALL))["summary"][SMALL.name]
    assert plain["mapped_beyond_reserved_after_pass_2"] == 0
    assert plain["mapped_beyond_reserved_after_last_pass"] == 0


def test_pytorchs_settings_settle_after_the_first_pass(tmp_path: Path) -> None:
    # PyTorch's allocator keeps every segment it made: nothing grows, nothing is asked again.
    result = run_bench(tmp_path, "--passes", "3", "--config", "native", "--traces", str(SMALL))
    s = result["summary"][SMALL.name]
    assert s["peak_reserved_last_over_pass_2"] == 1.0
    assert s["call_share_after_pass_2_max"] == 0.0 and s["meets_bar"]


def test_side_by_side_runs_give_the_same_figures(tmp_path: Path) -> None:
    args = ["--passes", "3", "--traces", str(SMALL), "--traces", str(OTHER)]
    alone = run_bench(tmp_path, *args)
    side_by_side = run_bench(tmp_path, *args, "--jobs", "2")
    assert alone["passes"] == side_by_side["passes"]
    assert set(alone["summary"]) == {SMALL.name, OTHER.name}


def test_the_long_run_of_the_example_is_a_run_of_its_own(tmp_path: Path) -> None:
    result = run_bench(tmp_path, "--passes", "3", "--traces", str(SMALL), "--long-passes", "3")
    assert set(result["summary"]) == {SMALL.name, "example_trace.pickle.gz x3"}


def test_too_few_passes_are_refused() -> None:
    out = subprocess.run([sys.executable, "-m", "bench.replay.steady_state", "--passes", "2"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--passes must be at least 3" in out.stderr


def test_under_a_cap_each_pass_counts_what_ran_out_of_memory(tmp_path: Path) -> None:
    # Page moves repeated every pass fit the decoder's first pass under 1.03 x its peak
    # requested bytes and run out in later ones; the defaults, which settle them, do not.
    decode = str(REPO / "tests/data/traces/decode__default.pickle.gz")
    moving = run_bench(tmp_path, "--passes", "6", "--cap", "1.03", "--traces", decode,
                       "--config", "settle_page_moves:False")
    s = moving["summary"]["decode__default.pickle.gz"]
    rows = moving["passes"]["decode__default.pickle.gz"]
    assert moving["cap"] == 1.03 and s["first_pass_ooms"] == 0
    assert s["ooms_after_pass_1"] == sum(r["num_ooms"] for r in rows[1:]) > 0
    assert "ran out of memory only after their first pass: decode__default" in moving["stdout"]
    settled = run_bench(tmp_path, "--passes", "6", "--cap", "1.03", "--traces", decode)
    assert settled["summary"]["decode__default.pickle.gz"]["ooms_after_pass_1"] == 0


def test_a_cap_below_the_traces_own_peak_is_refused() -> None:
    out = subprocess.run([sys.executable, "-m", "bench.replay.steady_state", "--cap", "0.9"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--cap must be at least 1.0" in out.stderr
