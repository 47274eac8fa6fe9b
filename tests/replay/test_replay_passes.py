"""`allocwatch replay --passes N`: the trace's program run N times on one allocator, as a long
run repeats its steps. The report stays the first pass's; each pass's figures and what the last
pass reached are added, so that a cache that keeps growing, device calls that never stop and a
run that grows into its cap show before a ten-hour job finds them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.paths import REPO

from allocator_ext.replay import load_trace, replay
from allocator_ext.replay.trace import peak_requested_bytes

CONVNET = REPO / "tests/data/traces/convnet__default.pickle.gz"
DECODE = REPO / "tests/data/traces/decode__default.pickle.gz"
FSDP2 = REPO / "tests/data/traces/fsdp2__default_lockstep.pickle.gz"
GiB = 1 << 30


def test_the_report_stays_the_first_passs_and_gains_every_pass() -> None:
    trace = load_trace(CONVNET)
    once = replay(trace).report
    report = replay(trace, passes=4).report
    rows, run = report.pop("passes"), report.pop("long_run")
    assert report == once
    assert [r["pass"] for r in rows] == [1, 2, 3, 4]
    # Pass 1 is the single replay; peaks are the allocator's so far, so they never fall.
    assert rows[0]["peak_reserved_bytes"] == once["peak_reserved_bytes"]
    assert rows[0]["device_call_share"] == pytest.approx(once["device_call_share"])
    peaks = [r["peak_reserved_bytes"] for r in rows]
    assert peaks == sorted(peaks)
    assert run["passes"] == 4 and run["peak_reserved_bytes"] == peaks[-1]
    assert run["growth_over_first_pass"] == pytest.approx(peaks[-1] / peaks[0])
    assert run["reserved_ratio"] == pytest.approx(peaks[-1] / once["peak_requested_bytes"])
    # A warm cache asks the device for a fraction of what the first pass asked.
    assert rows[0]["num_device_alloc"] > 50
    assert all(r["num_device_alloc"] * 5 <= rows[0]["num_device_alloc"] for r in rows[1:])
    assert run["device_call_share_worst_later_pass"] == max(
        r["device_call_share"] for r in rows[1:])


def test_pytorchs_allocator_keeps_its_segments_and_asks_nothing_after_the_first_pass() -> None:
    run = replay(load_trace(CONVNET), config="native", passes=3).report["long_run"]
    assert run["growth_over_first_pass"] == 1.0
    assert run["device_call_share_worst_later_pass"] == 0.0


def test_a_long_run_can_run_out_of_memory_under_a_cap_its_first_pass_fits() -> None:
    """What one replay cannot show: under a cap of 1.03 x the peak requested bytes, page moves
    repeated in every pass (settle_page_moves off) fit the decoder's first pass, and leave its
    free memory in pieces that a later pass's request cannot use (counted, not hidden). The
    defaults settle repeated moves and run out later and less often; that they run out at
    all is open (docs/benchmarks.md, "Repeated passes")."""
    trace = load_trace(DECODE)
    cap = int(1.03 * peak_requested_bytes(trace))
    report = replay(trace, config="settle_page_moves:False", device_memory=cap, passes=8).report
    assert report["num_ooms"] == 0
    assert report["long_run"]["num_ooms_later_passes"] > 0
    assert sum(r["num_ooms"] for r in report["passes"]) == (
        report["long_run"]["num_ooms_later_passes"])
    settled = replay(trace, device_memory=cap, passes=8).report["passes"]
    unsettled = report["passes"]
    first = [next((r["pass"] for r in rows if r["num_ooms"]), 9) for rows in (settled, unsettled)]
    assert first[0] > first[1]
    assert sum(r["num_ooms"] for r in settled) < sum(r["num_ooms"] for r in unsettled)


def test_near_its_cap_a_long_run_grows_by_pages_that_free_memory_can_give_back() -> None:
    """The convnet's 12th pass under 1.03 x ran out of memory four times while its free memory
    lay pinned in chunks partly in use. Near the ceiling at which the device refused growth, the
    defaults create single pages instead (tests/core: the rule itself), and every pass fits."""
    trace = load_trace(CONVNET)
    cap = int(1.03 * peak_requested_bytes(trace))
    report = replay(trace, device_memory=cap, passes=13).report
    assert report["num_ooms"] == 0
    assert report["long_run"]["num_ooms_later_passes"] == 0


def test_the_timeline_draws_every_pass_one_after_another_with_no_peak_lost() -> None:
    trace = load_trace(CONVNET)
    one = replay(trace, timeline=True).timeline
    result = replay(trace, timeline=True, passes=3)
    tl = result.timeline
    assert tl.pass_starts_s == pytest.approx([one.time_s[-1], 2 * one.time_s[-1]])
    assert tl.time_s == sorted(tl.time_s) and tl.time_s[-1] == pytest.approx(3 * one.time_s[-1])
    # About one pass's worth of points however many passes (a pass's last step ends a point),
    # each the highest of its steps.
    assert len(tl.reserved) <= len(one.reserved) + 3
    assert max(tl.reserved) == result.report["long_run"]["peak_reserved_bytes"]
    assert max(tl.requested) == max(one.requested)


def test_fewer_than_one_pass_is_refused() -> None:
    with pytest.raises(ValueError, match="passes must be at least 1, not 0"):
        replay(load_trace(CONVNET), passes=0)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "exporter.cli", "replay", *args],
                          capture_output=True, text=True, cwd=REPO, timeout=300)


def test_the_command_reports_the_long_run_in_its_table_and_its_json() -> None:
    out = run_cli(str(CONVNET), "--passes", "3")
    assert out.returncode == 0, out.stderr
    assert "after 3 passes" in out.stdout and "over the first pass" in out.stdout
    assert "beyond reserved" not in out.stdout  # nothing is mapped twice without aliases
    aliased = run_cli(str(CONVNET), "--passes", "3", "--config",
                      "alias_pages:True,expandable_chunk_mb:4")
    assert aliased.returncode == 0, aliased.stderr
    assert "address space mapped beyond reserved (aliased pages)" in aliased.stdout
    out = run_cli(str(CONVNET), "--passes", "3", "--json")
    report = json.loads(out.stdout)
    assert len(report["passes"]) == 3 and report["long_run"]["passes"] == 3
    single = json.loads(run_cli(str(CONVNET), "--json").stdout)
    assert "passes" not in single and "long_run" not in single


@pytest.mark.parametrize("value, why", [("0", "must be at least 1, not 0"),
                                        ("two", "not a whole number: 'two'")])
def test_the_command_refuses_a_bad_number_of_passes_naming_it(value: str, why: str) -> None:
    out = run_cli(str(CONVNET), "--passes", value)
    assert out.returncode == 2 and "--passes" in out.stderr and why in out.stderr
    assert not out.stdout


def test_the_plot_marks_where_each_pass_begins() -> None:
    pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is absent")
    import matplotlib.pyplot as plt

    from allocator_ext.replay.plot import timeline_figure

    tl = replay(load_trace(CONVNET), timeline=True, passes=3).timeline
    fig = timeline_figure(tl, "three passes")
    try:
        ax = fig.axes[0]
        starts = [line.get_xdata()[0] for line in ax.get_lines()
                  if line.get_gid() == "pass-start"]
        assert starts == pytest.approx(tl.pass_starts_s)
        assert any("start of a pass (3 passes" in t.get_text()
                   for t in ax.get_legend().get_texts())
    finally:
        plt.close(fig)


def test_each_pass_counts_the_address_space_it_leaves_mapped() -> None:
    """Without aliases every mapped address is reserved memory; aliased pages (alias_pages) are
    mapped at several addresses and reserved once. Under a cap of 1.03 x the peak requested
    bytes, FSDP2's 1 GiB requests find no address range whose pages are all idle, so each pass
    maps idle pages at new addresses: reserved memory flat, the driver's mappings growing
    without bound (counted, not hidden; docs/benchmarks.md, "Aliased pages")."""
    trace = load_trace(FSDP2)
    cap = int(1.03 * peak_requested_bytes(trace))
    plain = replay(trace, device_memory=cap, passes=3).report["passes"]
    assert [r["mapped_bytes_at_end"] for r in plain] == [r["reserved_bytes_at_end"] for r in plain]
    aliased = replay(trace, config="alias_pages:True,expandable_chunk_mb:4", device_memory=cap,
                     passes=4).report["passes"]
    beyond = [r["mapped_bytes_at_end"] - r["reserved_bytes_at_end"] for r in aliased]
    assert beyond == sorted(beyond) and beyond[-1] > beyond[1] + 4 * GiB
    run = replay(trace, config="alias_pages:True,expandable_chunk_mb:4", device_memory=cap,
                 passes=2).report["long_run"]
    assert (run["mapped_beyond_reserved_first_pass"], run["mapped_beyond_reserved_last_pass"]
            ) == (beyond[0], beyond[1])
    assert aliased[-1]["peak_reserved_bytes"] <= 1.002 * aliased[1]["peak_reserved_bytes"]
