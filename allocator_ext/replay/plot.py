"""The replay over time, as a picture: requested, allocated and reserved bytes of the replay,
beside the reserved bytes the recorded run had. The gap between reserved and requested is the
fragmentation the settings cost."""

from __future__ import annotations

from allocator_ext.replay.engine import Timeline


def plot_timeline(timeline: Timeline, path: str, title: str) -> None:
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
    ax.set_xlabel("trace time (s)")
    ax.set_ylabel("GiB")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
