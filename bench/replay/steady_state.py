"""Device calls an allocator setting keeps making once a workload repeats: each trace's
allocations and frees replayed in passes on one allocator (like the steps of a training run),
with the calls counted per pass.

    python bench/replay/steady_state.py [--config STR] [--passes 3] [--traces GLOB ...]
                                        [--json FILE]

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

import allocator_ext as ae
from allocator_ext.replay import load_cost_table, load_trace
from allocator_ext.replay.engine import PENDING_STREAM_BASE, trace_seconds
from allocator_ext.replay.trace import free_completes_at_once

REPO = Path(__file__).resolve().parents[2]
DEFAULT_TRACES = [str(REPO / "tests/data/traces/*__default.pickle.gz"),
                  str(REPO.parent / "shared/traces/*.pickle.gz")]
SHOWN = ("create", "map_only", "unmap", "release", "stream_synchronize")


def passes_of(path: str, config: str | None, passes: int) -> list[dict[str, float]]:
    """Per pass: the calls of each shown kind and `call_share`, all calls priced / active time."""
    trace = load_trace(path)
    events = trace.events
    active_s = trace_seconds(trace)
    costs = load_cost_table()
    device = ae.SimDevice(capacity=0)
    alloc = ae.Allocator(device, config)
    waiting_stream = PENDING_STREAM_BASE   # one stream of its own per delayed free
    out: list[dict[str, float]] = []
    for _ in range(passes):
        before = device.counters()
        live: dict[int, int] = {}
        waits: dict[int, int] = {}
        for i, e in enumerate(events):
            if e.action == "alloc":
                live[e.addr] = alloc.malloc(e.size, e.stream)
            elif e.action == "free_requested" and e.addr in live:
                if not free_completes_at_once(events, i):
                    alloc.record_stream(live[e.addr], waiting_stream)
                    waits[e.addr] = waiting_stream
                    waiting_stream += 1
                alloc.free(live.pop(e.addr))
            elif e.action == "free_completed" and e.addr in waits:
                device.complete_stream(waits.pop(e.addr))
                alloc.process_events()
        for ptr in live.values():
            alloc.free(ptr)
        for waiting in waits.values():
            device.complete_stream(waiting)
        alloc.process_events()
        after = device.counters()
        delta = {k: {f: v[f] - before.get(k, {}).get(f, 0) for f in ("count", "bytes")}
                 for k, v in after.items()}
        row: dict[str, float] = {k: delta.get(k, {}).get("count", 0) for k in SHOWN}
        row["call_share"] = costs.price(delta)[0] / active_s if active_s > 0 else 0.0
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
