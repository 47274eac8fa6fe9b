"""Replay's plot, read at a glance: on the report's own clock (the trace's active time), every
curve visible, the cap drawn, the allocator's retries and out-of-memory errors and the recorded
run's errors marked, and a title that fits the figure."""

from __future__ import annotations

from typing import Any

import pytest
from support.paths import REPO

from allocator_ext.replay import load_trace, replay
from allocator_ext.replay.plot import timeline_figure, wrap
from allocator_ext.replay.trace import parse_snapshot

plt = pytest.importorskip("matplotlib.pyplot", reason="the plot extra (matplotlib) is absent")

MiB = 1 << 20
SEG = 1 << 30
EXAMPLE = REPO / "allocator_ext" / "data" / "example_trace.pickle.gz"


def _event(action: str, size: int, time_us: int, addr: int = SEG) -> dict[str, Any]:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": time_us}


def idle_then_oom_snapshot() -> dict[str, Any]:
    """32 MiB held, ten idle seconds (data loading), then a 40 MiB request that failed."""
    idle = 10_000_000
    return {"device_traces": [[
        _event("segment_alloc", 32 * MiB, 0),
        _event("alloc", 32 * MiB, 1000),
        {"action": "oom", "device_free": 32 * MiB, "size": 40 * MiB, "stream": 0,
         "time_us": 1000 + idle},
        _event("free_requested", 32 * MiB, 2000 + idle),
        _event("free_completed", 32 * MiB, 2000 + idle),
    ]]}


def labels(ax: Any) -> list[str]:
    return ax.get_legend_handles_labels()[1]


@pytest.fixture
def oom_replay() -> Any:
    trace = parse_snapshot(idle_then_oom_snapshot())
    return replay(trace, "native", device_memory=64 * MiB, timeline=True)


def test_the_plot_runs_on_the_clock_the_report_counts(oom_replay: Any) -> None:
    r, timeline = oom_replay.report, oom_replay.timeline
    # The ten idle seconds count as 100 ms, as in trace_seconds.
    assert r["trace_seconds"] == pytest.approx(0.102)
    assert timeline.time_s[-1] == r["trace_seconds"]
    [oom] = r["recorded_ooms"]
    assert oom["time_s"] == pytest.approx(0.101) and oom["time_us"] == 10_001_000
    fig = timeline_figure(timeline, "t", r["recorded_ooms"])
    ax = fig.axes[0]
    assert ax.get_xlim() == pytest.approx((0, 102))  # a trace under a second: milliseconds
    assert "active time (ms)" in ax.get_xlabel()
    assert "100 ms" in ax.get_xlabel() and "trace_seconds" in ax.get_xlabel()
    plt.close(fig)


def test_the_cap_retries_and_out_of_memory_errors_are_drawn(oom_replay: Any) -> None:
    r, timeline = oom_replay.report, oom_replay.timeline
    assert (r["num_alloc_retries"], r["num_ooms"], r["recorded_ooms_recurred"]) == (1, 1, 1)
    fig = timeline_figure(timeline, "t", r["recorded_ooms"])
    ax = fig.axes[0]
    shown = labels(ax)
    assert "cap 64.00 MiB" in shown
    assert "allocator retried, replay (1; along the top)" in shown
    assert "out of memory, replay (1)" in shown
    assert "recorded out-of-memory error, recurred in the replay (1)" in shown
    [cap] = [line for line in ax.get_lines() if line.get_label() == "cap 64.00 MiB"]
    assert cap.get_ydata()[0] == 64  # MiB: a trace under a GiB reads in MiB
    [recorded] = [line for line in ax.get_lines() if line.get_label().startswith("recorded")]
    assert recorded.get_xdata()[0] == pytest.approx(101)  # at the error, in ms
    plt.close(fig)


def test_a_served_recorded_oom_is_drawn_as_served_and_a_far_cap_named_only() -> None:
    result = replay(parse_snapshot(idle_then_oom_snapshot()), "native",
                    device_memory=1 << 30, timeline=True)
    fig = timeline_figure(result.timeline, "t", result.report["recorded_ooms"])
    shown = labels(fig.axes[0])
    assert "recorded out-of-memory error, served in the replay (1)" in shown
    assert "cap 1.00 GiB: far above, not drawn" in shown
    assert fig.axes[0].get_ylim()[1] < 100  # MiB: the curves keep the height
    assert not any("out of memory, replay" in label for label in shown)
    plt.close(fig)


def test_allocated_stays_visible_beside_requested() -> None:
    """Allocated differs from requested by rounding only: requested is the shaded area under
    it, allocated a line drawn over it."""
    result = replay(load_trace(EXAMPLE), timeline=True)
    fig = timeline_figure(result.timeline, "t")
    ax = fig.axes[0]
    [requested] = [c for c in ax.collections if c.get_label().startswith("requested")]
    [allocated] = [line for line in ax.get_lines() if line.get_label().startswith("allocated")]
    assert allocated.get_zorder() > requested.get_zorder()
    assert "(peak 9.52 GiB)" in allocated.get_label()
    assert ax.get_xlim()[1] == pytest.approx(result.report["trace_seconds"])  # 6.87 s, not 13
    plt.close(fig)


def test_a_long_title_is_wrapped_inside_the_figure() -> None:
    title = (f"{EXAMPLE} — native,expandable_segments:True,expandable_large_page_mb:2,"
             "expandable_chunk_mb:10,reuse_free_pages:True")
    result = replay(load_trace(EXAMPLE), timeline=True)
    fig = timeline_figure(result.timeline, title)
    fig.canvas.draw()
    ax = fig.axes[0]
    shown = ax.get_title(loc="left")
    assert shown.replace("\n", "") == title  # nothing lost
    box = ax._left_title.get_window_extent()  # matplotlib's artist of a loc="left" title
    assert 0 <= box.x0 and box.x1 <= fig.bbox.width
    plt.close(fig)


@pytest.mark.parametrize("text,width,lines", [
    ("a/b/c, d e", 80, ["a/b/c, d e"]),
    ("native,expandable_segments:True,roundup_power2_divisions:4", 34,
     ["native,expandable_segments:True,", "roundup_power2_divisions:4"]),
    ("x" * 25, 10, ["x" * 10, "x" * 10, "x" * 5]),
])
def test_wrap_breaks_after_separators_and_within_a_word_only_when_it_must(
        text: str, width: int, lines: list[str]) -> None:
    assert wrap(text, width).split("\n") == lines
    assert all(len(line) <= width for line in wrap(text, width).split("\n"))


@pytest.mark.parametrize("command", ["replay", "tune"])
@pytest.mark.parametrize("name,why", [
    ("x.foo", "matplotlib cannot write .foo files"),
    ("x", "the file's suffix must name its format"),  # matplotlib would write x.png
])
def test_a_plot_matplotlib_cannot_write_as_named_is_refused_before_any_replay(
        command: str, name: str, why: str, tmp_path: Any,
        capsys: pytest.CaptureFixture[str]) -> None:
    from exporter.cli import main

    assert main([command, str(EXAMPLE), "--plot", str(tmp_path / name)]) == 2
    captured = capsys.readouterr()
    assert f"--plot {tmp_path / name}: {why} (.png, .svg, .pdf, …)" in captured.err
    assert captured.out == ""  # refused before replaying: nothing measured, nothing lost
    assert list(tmp_path.iterdir()) == []
