"""The replay over time, as a picture to read at a glance.

On the trace's active clock (the time the report's `trace_seconds` counts: gaps between events
up to 100 ms each, so that idle time does not stretch the picture): what the program requested
(shaded), what the replay allocated and reserved, and what the recorded run reserved (dashed).
Reserved above requested is what the settings cost. A replay of several passes draws them one
after another, with a thin line where each begins. The cap the replay ran under is a line;
the allocator's retries and out-of-memory errors are marked where they happened, and each
out-of-memory error of the recorded run is a vertical line: red where it recurred in the replay,
green where the replay served the request.
"""

from __future__ import annotations

import re
from typing import Any

from allocator_ext.replay.engine import Timeline
from allocator_ext.replay.sizes import format_size
from allocator_ext.replay.trace import ACTIVE_GAP_CAP_US

TITLE_WIDTH = 110    # characters a title line holds at its font size on the figure's width
CAP_ABOVE_TOP = 3  # a cap this many times the highest curve is named, not drawn


def plot_timeline(timeline: Timeline, path: str, title: str,
                  recorded_ooms: list[dict[str, Any]] | None = None) -> None:
    """Writes the picture of `timeline` to `path` (PNG, or any format matplotlib knows by its
    suffix). Raises OSError where it cannot be written."""
    import matplotlib.pyplot as plt

    fig = timeline_figure(timeline, title, recorded_ooms)
    try:
        fig.savefig(path, bbox_inches="tight")
    finally:
        plt.close(fig)


def timeline_figure(timeline: Timeline, title: str,
                    recorded_ooms: list[dict[str, Any]] | None = None) -> Any:
    """The picture of `timeline` as a matplotlib figure, which the caller closes.
    `recorded_ooms`: the report's list of them, to mark where each was and what became of it."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, none opened
    import matplotlib.pyplot as plt

    top = max(max(timeline.reserved, default=0), max(timeline.recorded_reserved, default=0),
              max(timeline.requested, default=0))
    unit_name, unit = memory_unit(top)

    def scaled(values: list[int]) -> list[float]:
        return [v / unit for v in values]

    # A trace shorter than a second reads in milliseconds.
    clock_name, clock = ("s", 1.0) if timeline.time_s and timeline.time_s[-1] >= 1 else ("ms", 1e3)
    t = [v * clock for v in timeline.time_s]
    fig, ax = plt.subplots(figsize=(11, 5), dpi=110)
    ax.fill_between(t, scaled(timeline.requested), color="tab:green", alpha=0.3, lw=0,
                    label=f"requested by the program (peak {_peak(timeline.requested)})")
    ax.plot(t, scaled(timeline.allocated), color="tab:blue", lw=0.9,
            label=f"allocated, replay (peak {_peak(timeline.allocated)})")
    ax.plot(t, scaled(timeline.recorded_reserved), color="0.45", lw=1.3, ls="--",
            label=f"reserved, recorded run (peak {_peak(timeline.recorded_reserved)})")
    ax.plot(t, scaled(timeline.reserved), color="tab:purple", lw=1.6,
            label=f"reserved, replay (peak {_peak(timeline.reserved)})")
    _draw_cap(ax, timeline, top, unit)
    # Retries along the top edge: an out-of-memory error retries first, and would hide them.
    _mark_steps(ax, [t[i] for i in timeline.retries_at], [0.97] * len(timeline.retries_at),
                transform=ax.get_xaxis_transform(), clip_on=False, marker="v",
                color="tab:orange", s=30,
                label=f"allocator retried, replay ({len(timeline.retries_at)}; along the top)")
    _mark_steps(ax, [t[i] for i in timeline.ooms_at],
                [timeline.reserved[i] / unit for i in timeline.ooms_at], marker="x",
                color="tab:red", s=60, linewidths=2,
                label=f"out of memory, replay ({len(timeline.ooms_at)})")
    _mark_recorded_ooms(ax, t, timeline, recorded_ooms or [])
    for i, start in enumerate(timeline.pass_starts_s):
        ax.axvline(start * clock, color="0.6", lw=0.6, zorder=1, gid="pass-start",
                   label=None if i else f"start of a pass ({len(timeline.pass_starts_s) + 1} "
                                        "passes, each the whole trace)")

    ax.set_title(wrap(title, TITLE_WIDTH), loc="left", fontsize=9.5)
    ax.set_xlabel(f"active time ({clock_name}): the trace's time with each gap between events "
                  f"counted up to {ACTIVE_GAP_CAP_US // 1000} ms, as the report's trace_seconds")
    ax.set_ylabel(f"memory ({unit_name})")
    ax.set_xlim(0, max(t[-1] if t else 0, 1e-6))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3, fontsize=8,
              frameon=False)
    fig.tight_layout()
    return fig


def memory_unit(top: float) -> tuple[str, float]:
    """The unit a picture of memory up to `top` bytes reads best in: GiB, else MiB."""
    return ("GiB", float(1 << 30)) if top >= 1 << 30 else ("MiB", float(1 << 20))


def wrap(text: str, width: int) -> str:
    """`text` in lines of at most `width` characters, broken where it breaks already and
    after spaces, commas and slashes (a settings string or a path has no spaces), and within a
    word only where it is longer than a line."""
    if "\n" in text:
        return "\n".join(wrap(line, width) for line in text.split("\n"))
    lines: list[str] = []
    line = ""
    for piece in re.findall(r"[^ ,/]+[ ,/]?|[ ,/]", text):
        while len(piece) > width:
            if line:
                lines.append(line)
                line = ""
            lines.append(piece[:width])
            piece = piece[width:]
        if line and len(line) + len(piece.rstrip()) > width:
            lines.append(line)
            line = ""
        line += piece
    lines.append(line)
    return "\n".join(kept.rstrip() for kept in lines if kept.strip())


def _peak(values: list[int]) -> str:
    return format_size(max(values, default=0))


def _draw_cap(ax: Any, timeline: Timeline, top: int, unit: float) -> None:
    cap = timeline.cap_bytes
    if not cap:
        return
    fraction = timeline.memory_fraction
    label = f"cap {format_size(cap)}" + (f" (memory fraction {fraction:g})"
                                         if fraction is not None else "")
    if cap > CAP_ABOVE_TOP * top:
        ax.plot([], [], color="black", ls="-.", lw=1.2, label=f"{label}: far above, not drawn")
    else:
        ax.axhline(cap / unit, color="black", ls="-.", lw=1.2, label=label)


def _mark_steps(ax: Any, x: list[float], y: list[float], **style: Any) -> None:
    if x:
        ax.scatter(x, y, zorder=5, **style)


def _mark_recorded_ooms(ax: Any, t: list[float], timeline: Timeline,
                        ooms: list[dict[str, Any]]) -> None:
    for outcome, color in (("recurred", "tab:red"), ("served", "tab:green")):
        chosen = [o for o in ooms if o["recurred"] is (outcome == "recurred")]
        for i, oom in enumerate(chosen):
            at = t[timeline.step_of_event(oom["event_index"])]
            ax.axvline(at, color=color, ls=":", lw=1.6, zorder=4,
                       label=None if i else f"recorded out-of-memory error, {outcome} in the "
                                            f"replay ({len(chosen)})")
