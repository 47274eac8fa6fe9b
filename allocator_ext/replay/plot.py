"""The replay over time, as a picture: requested, allocated and reserved bytes of the replay,
beside the reserved bytes the recorded run had. The gap between reserved and requested is the
fragmentation the settings cost. Each out-of-memory error of the recorded run is marked where
it happened: a red cross where it recurred in the replay, a green circle where the replay
served the request."""

from __future__ import annotations

import bisect
from typing import Any

from allocator_ext.replay.engine import Timeline


def plot_timeline(timeline: Timeline, path: str, title: str,
                  recorded_ooms: list[dict[str, Any]] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gib = float(1 << 30)
    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=110)
    t = timeline.time_s
    ax.plot(t, [v / gib for v in timeline.recorded_reserved], color="0.6", lw=1.2,
            ls="--", label="reserved (recorded run)")
    ax.plot(t, [v / gib for v in timeline.reserved], color="tab:red", lw=1.4,
            label="reserved (replay)")
    ax.plot(t, [v / gib for v in timeline.allocated], color="tab:blue", lw=1.0,
            label="allocated (replay)")
    ax.plot(t, [v / gib for v in timeline.requested], color="tab:green", lw=1.0,
            label="requested")
    _mark_ooms(ax, timeline, [o for o in recorded_ooms or [] if o["recurred"]], gib,
               marker="x", color="tab:red", s=60, label="recorded OOM: recurred")
    _mark_ooms(ax, timeline, [o for o in recorded_ooms or [] if o["recurred"] is False], gib,
               marker="o", facecolors="none", edgecolors="tab:green", s=50,
               label="recorded OOM: survived")
    ax.set_xlabel("trace time (s)")
    ax.set_ylabel("GiB")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _mark_ooms(ax: Any, timeline: Timeline, ooms: list[dict[str, Any]], gib: float,
               **style: Any) -> None:
    if ooms:
        ax.scatter([o["time_s"] for o in ooms],
                   [_reserved_at(timeline, o["time_s"]) / gib for o in ooms], zorder=5, **style)


def _reserved_at(timeline: Timeline, time_s: float) -> float:
    """The replay's reserved bytes at the last step at or before `time_s`."""
    i = bisect.bisect_right(timeline.time_s, time_s) - 1
    return timeline.reserved[i] if i >= 0 else 0
