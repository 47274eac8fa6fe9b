"""Device calls an allocator setting keeps making once a workload repeats: each trace's
allocations and frees replayed in passes on one allocator (like the steps of a training run),
with the calls counted per pass.

    python bench/steady_state.py [--config STR] [--passes 3] [--traces GLOB ...] [--json FILE]

The first pass grows the cache; later passes show what the setting still asks of the device
when nothing new happens. Unmaps and stream synchronisations there are what a training step
pays again and again (an unmap waits for the stream, which stalls the CPU's run-ahead). Frees
the trace completed later than it requested them (a block in use on another stream) wait, as in
`allocwatch replay`, until their `free_completed`; each pass frees what it still holds at its
end. Counts from the simulated device: the same on any machine. The last column prices each pass's
calls with the cost table measured on the H200 (allocator_ext/data/device_costs.json) as a share
of the trace's active time, the measure the replay's 2 % bar uses: a pass stands for one more
run of the recorded work, so this is what the setting costs every step once it has settled.
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
from pathlib import Path

from allocator_ext.replay import Replayer, load_cost_table, load_trace
from allocator_ext.replay.trace import trace_seconds

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TRACES = [str(REPO / "tests/data/traces/*__default.pickle.gz"),
                  str(REPO.parent / "shared/traces/*.pickle.gz")]
SHOWN = ("create", "map_only", "unmap", "release", "stream_synchronize")


def passes_of(path: str, config: str | None, passes: int) -> list[dict[str, float]]:
    """Per pass: the calls of each shown kind and `call_share`, all calls priced / active time."""
    trace = load_trace(path)
    active_s = trace_seconds(trace)
    costs = load_cost_table()
    replayer = Replayer(trace, config)
    out: list[dict[str, float]] = []
    for _ in range(passes):
        calls = replayer.run_pass(release=True).device_calls
        row: dict[str, float] = {k: calls.get(k, {}).get("count", 0) for k in SHOWN}
        row["call_share"] = costs.price(calls)[0] / active_s if active_s > 0 else 0.0
        out.append(row)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="allocator settings (default: allocwatch's)")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--traces", action="append", metavar="GLOB")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    if args.passes < 2:
        p.error("--passes must be at least 2 (the first only grows the cache)")
    paths = sorted(f for g in (args.traces or DEFAULT_TRACES) for f in glob.glob(g))
    if not paths:
        p.error("no trace matched")
    rows = {}
    print(f"{'trace':30s} " + " ".join(f"{k:>18s}" for k in SHOWN)
          + f" {'priced/active':>18s}   (pass 1 / last pass)")
    for path in paths:
        per_pass = passes_of(path, args.config, args.passes)
        rows[Path(path).name] = per_pass
        print(f"{Path(path).name[:30]:30s} "
              + " ".join(f"{per_pass[0][k]:>9.0f}/{per_pass[-1][k]:<8.0f}" for k in SHOWN)
              + f" {per_pass[0]['call_share']:>8.2%}/{per_pass[-1]['call_share']:<8.2%}",
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv),
                                               "config": args.config, "passes": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
