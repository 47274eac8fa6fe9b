"""allocwatch tune: the recommendation is the candidate with the lowest replayed peak
reserved memory among those that never ran out of memory, and the output says why."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import REPO

from allocator_ext.replay import load_trace
from allocator_ext.replay.trace import peak_requested_bytes
from allocator_ext.replay.tune import CANDIDATES, tune

EXAMPLE = REPO / "allocator_ext" / "data" / "example_trace.pickle.gz"


def test_the_recommendation_reserves_the_least_among_survivors() -> None:
    ranked = tune(load_trace(EXAMPLE))
    assert len(ranked) == len(CANDIDATES)
    survivors = [c for c in ranked if c.report["num_ooms"] == 0]
    assert ranked[0] in survivors
    assert ranked[0].report["peak_reserved_bytes"] == min(
        c.report["peak_reserved_bytes"] for c in survivors)


def test_under_a_tight_cap_candidates_that_run_out_of_memory_rank_last() -> None:
    trace = load_trace(EXAMPLE)
    ranked = tune(trace, device_memory=int(1.03 * peak_requested_bytes(trace)))
    ooms = [c.report["num_ooms"] > 0 for c in ranked]
    assert ooms == sorted(ooms)            # all survivors first
    assert any(ooms) and not ooms[0]       # PyTorch's defaults fail at 1.03x; the best does not


def test_tune_command_prints_a_table_and_says_why(tmp_path: Path) -> None:
    plot = tmp_path / "tune.png"
    out = subprocess.run([sys.executable, "-m", "exporter.cli", "tune", str(EXAMPLE),
                          "--plot", str(plot)], capture_output=True, text=True, cwd=REPO,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "recommended:" in out.stdout and "why:" in out.stdout
    assert "ALLOCWATCH_ALLOC_CONF=" in out.stdout
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_tune_json_names_pytorch_settings_where_pytorch_understands_them() -> None:
    out = subprocess.run([sys.executable, "-m", "exporter.cli", "tune", str(EXAMPLE), "--json"],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    by_name = {c["name"]: c for c in result["candidates"]}
    assert by_name["expandable segments"]["pytorch_cuda_alloc_conf"] == "expandable_segments:True"
    assert by_name["allocwatch defaults"]["pytorch_cuda_alloc_conf"] is None
    assert result["recommended"]["why"]


def test_tune_refuses_a_bad_trace(tmp_path: Path) -> None:
    bad = tmp_path / "bad.pickle"
    bad.write_bytes(b"\x80\x04garbage")
    out = subprocess.run([sys.executable, "-m", "exporter.cli", "tune", str(bad)],
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 2 and "allocwatch tune:" in out.stderr


@pytest.mark.parametrize("name", ["gpt_varlen", "multistream", "ckpt"])
def test_tune_on_the_shared_traces_recommends_the_least_reserved(shared_traces: Path,
                                                                 name: str) -> None:
    out = subprocess.run([sys.executable, "-m", "exporter.cli", "tune",
                          str(shared_traces / f"{name}.pickle.gz"), "--json"],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    survivors = [c for c in result["candidates"] if c["num_ooms"] == 0]
    [chosen] = [c for c in result["candidates"] if c["name"] == result["recommended"]["name"]]
    assert chosen in survivors
    assert chosen["peak_reserved_bytes"] == min(c["peak_reserved_bytes"] for c in survivors)
    assert "reserves the least" in result["recommended"]["why"]


def test_the_chart_of_a_small_trace_reads_in_mib_and_its_long_title_fits() -> None:
    """A trace of a few hundred MiB in GiB reads 0.19 for every bar; a title with the cap's
    description ran off the figure's right edge."""
    plt = pytest.importorskip("matplotlib.pyplot", reason="the plot extra is absent")
    from support.capped_run import record_capped_run

    from allocator_ext.replay.cap import resolve_cap
    from allocator_ext.replay.trace import parse_snapshot
    from allocator_ext.replay.tune import recommended
    from exporter.commands.tune import chart

    trace = parse_snapshot(record_capped_run()[0])
    cap = resolve_cap(trace)
    ranked = tune(trace, cap.device_memory, cap.memory_fraction,
                  candidates=[(s, s, True) for s in ("native", "native,expandable_segments:True")])
    title = ("allocwatch tune: peak reserved by setting\n"
             f"/a/long/path/x.pickle.gz ({cap.describe()})")
    fig = chart(ranked, recommended(ranked), peak_requested_bytes(trace), title)
    fig.canvas.draw()
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.texts]
    assert "206.00 MiB  (1.054×)" in labels and "196.00 MiB, 4 OOMs" in labels
    assert ax.get_xlabel().startswith("peak reserved (MiB)")
    assert ax.get_title(loc="left").replace("\n", "").replace(" ", "") == \
        title.replace("\n", "").replace(" ", "")
    box = ax._left_title.get_window_extent()  # matplotlib's artist of a loc="left" title
    assert 0 <= box.x0 and box.x1 <= fig.bbox.width
    plt.close(fig)


DECODE = REPO / "tests" / "data" / "traces" / "decode__default.pickle.gz"
MOVING = "allocwatch, page moves repeated"


def test_with_passes_a_setting_that_runs_out_only_in_a_later_pass_is_not_recommended() -> None:
    # Under a cap of 1.03 x the peak requested bytes, page moves repeated every pass fit the
    # decoder's first pass and run out of memory in later ones: one replay cannot tell.
    trace = load_trace(DECODE)
    cap = int(1.03 * peak_requested_bytes(trace))
    once = {c.name: c for c in tune(trace, device_memory=cap)}
    assert once[MOVING].figures["num_ooms"] == 0
    ranked = tune(trace, device_memory=cap, passes=6)
    by_name = {c.name: c for c in ranked}
    moving = by_name[MOVING]
    assert moving.report["num_ooms"] == 0                     # the first pass, as before
    assert moving.figures["num_ooms"] == moving.report["long_run"]["num_ooms_later_passes"] > 0
    assert moving.figures["peak_reserved_bytes"] == moving.report["long_run"][
        "peak_reserved_bytes"]
    assert ranked[0].figures["num_ooms"] == 0 and ranked[0] is not moving
    ooms = [c.figures["num_ooms"] > 0 for c in ranked]
    assert ooms == sorted(ooms)


def test_tune_command_judges_the_passes_and_says_so() -> None:
    out = subprocess.run([sys.executable, "-m", "exporter.cli", "tune", str(DECODE),
                          "--device-memory", "1.03x", "--passes", "4", "--json"],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["passes"] == 4 and "over 4 passes" in result["why"]
    assert all(c["long_run"]["passes"] == 4 for c in result["candidates"])
    out = subprocess.run([sys.executable, "-m", "exporter.cli", "tune", str(DECODE),
                          "--passes", "-1"], capture_output=True, text=True, cwd=REPO,
                         timeout=60)
    assert out.returncode == 2 and "--passes" in out.stderr and "at least 1" in out.stderr
