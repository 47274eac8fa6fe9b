"""Device calls an allocator setting keeps making once a workload repeats: each trace's
allocations and frees replayed in passes on one allocator (like the steps of a training run),
with the calls counted per pass.

    python bench/steady_state.py [--config STR] [--passes 3] [--traces GLOB ...] [--json FILE]

The first pass grows the cache; later passes show what the setting still asks of the device
when nothing new happens. Unmaps and stream synchronisations there are what a training step
pays again and again (an unmap waits for the stream, which stalls the CPU's run-ahead). Each
pass frees what it still holds at its end; waits across streams are not replayed (frees take
effect at once), so the figures are for the allocator's own rules, not the trace's timing.
Counts from the simulated device: the same on any machine.
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
from pathlib import Path

import allocator_ext as ae
from allocator_ext.replay import load_trace
from allocator_ext.replay.trace import allocs_and_frees

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TRACES = [str(REPO / "tests/data/traces/*__default.pickle.gz"),
                  str(REPO.parent / "shared/traces/*.pickle.gz")]
SHOWN = ("create", "map_only", "unmap", "release", "stream_synchronize")


def passes_of(path: str, config: str | None, passes: int) -> list[dict[str, int]]:
    events = allocs_and_frees(load_trace(path))
    device = ae.SimDevice(capacity=0)
    alloc = ae.Allocator(device, config)
    out = []
    for _ in range(passes):
        before = {k: v["count"] for k, v in device.counters().items()}
        live: dict[int, int] = {}
        for action, addr, size, stream in events:
            if action == "alloc":
                live[addr] = alloc.malloc(size, stream)
            elif addr in live:
                alloc.free(live.pop(addr))
        for ptr in live.values():
            alloc.free(ptr)
        after = {k: v["count"] for k, v in device.counters().items()}
        out.append({k: after.get(k, 0) - before.get(k, 0) for k in SHOWN})
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
    print(f"{'trace':30s} " + " ".join(f"{k:>18s}" for k in SHOWN) + "   (pass 1 / last pass)")
    for path in paths:
        per_pass = passes_of(path, args.config, args.passes)
        rows[Path(path).name] = per_pass
        print(f"{Path(path).name[:30]:30s} "
              + " ".join(f"{per_pass[0][k]:>9d}/{per_pass[-1][k]:<8d}" for k in SHOWN),
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv),
                                               "config": args.config, "passes": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
