"""Fragmentation and device-call cost of allocator settings, replayed on recorded traces.

    python -m bench.replay.fragmentation [--config STR ...] [--traces GLOB ...] [--json FILE]

For every trace (the project's H200 and H100 recordings in tests/data/traces and, where present, the
shared traces beside the checkout) and every setting (default: allocwatch's defaults, PyTorch's
defaults, PyTorch's expandable segments): peak reserved / peak requested, device calls priced
as a share of the trace's active time, and the same replay under a device capped at 1.02 x the
trace's peak requested bytes (the design's pressure bar for replay: out-of-memory errors,
retries), and once more on an H200-sized device with set_per_process_memory_fraction at
1.03 x that peak, as the GPU benchmark caps its runs (the fraction is checked before the device
is asked, so retries there come from the allocator's own rule). Figures are counts and ratios
from deterministic replays on the simulated device: the same on any machine.

Each trace's floor (allocator_ext/replay/floor.py: the least any allocator under the core's
rules could reserve) sets its bar: 1.01, or the floor + 0.01 where the floor is above 1.00.

Printed: one row per trace and setting, with the trace's bar and whether the ratio is within
it, then each setting's count of traces within their bars, worst ratio, worst call share and
total out-of-memory errors and retries; --json FILE writes the rows and the command.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from pathlib import Path

from allocator_ext.replay import load_trace, replay
from allocator_ext.replay.floor import reserved_floor
from bench import REPO

DEFAULT_TRACES = [str(REPO / "tests/data/traces/*.pickle.gz"),
                  str(REPO.parent / "shared/traces/*.pickle.gz")]
H200_BYTES = 141 << 30  # the fraction-capped replays' device
DEVICE_CAP = 1.02       # x peak requested: the device-capped replays (the replay's pressure bar)
FRACTION_CAP = 1.03     # x peak requested: the memory fraction, as on the GPU
PEERS = {"allocwatch": None, "pytorch": "native", "expandable": "native,expandable_segments:True"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", action="append", metavar="STR",
                   help="a setting to measure (repeatable); default: allocwatch, pytorch, "
                        "expandable")
    p.add_argument("--traces", action="append", metavar="GLOB",
                   help="traces to replay (repeatable); default: tests/data/traces and the shared "
                        "traces")
    p.add_argument("--json", metavar="FILE", help="write the rows here as JSON")
    args = p.parse_args()
    configs = {c: c for c in args.config} if args.config else PEERS
    paths = sorted(f for g in (args.traces or DEFAULT_TRACES) for f in glob.glob(g))
    # Traces recorded under a memory fraction replay with it (their manifest says which).
    fractions: dict[str, float] = {}
    manifest = REPO / "tests/data/traces/manifest.json"
    if manifest.exists():
        for t in json.loads(manifest.read_text())["traces"]:
            if t.get("memory_fraction"):
                fractions[t["file"]] = t["memory_fraction"]
    rows = []
    print(f"{'trace':30s} {'setting':12s} {'ratio':>7s} {'bar':>6s} {'calls %':>8s} | "
          f"{f'{DEVICE_CAP}x: oom':>10s} "
          f"{'retries':>7s} {'calls %':>8s} | {'fraction: oom':>13s} {'retries':>7s} "
          f"{'calls %':>8s}")
    for path in paths:
        trace = load_trace(path)
        floor = reserved_floor(trace)  # and the trace's peak requested bytes, counted once
        cap = int(DEVICE_CAP * floor.peak_requested_bytes)
        fraction_cap = int(FRACTION_CAP * floor.peak_requested_bytes)
        fraction = fractions.get(os.path.basename(path))
        for name, config in configs.items():
            free = replay(trace, config=config, memory_fraction=fraction).report
            capped = replay(trace, config=config, device_memory=cap).report
            fractioned = replay(trace, config=config, device_memory=H200_BYTES,
                                memory_fraction=fraction_cap / H200_BYTES).report
            row = {"trace": os.path.basename(path), "setting": name, "config": free["config"],
                   "reserved_ratio": free["reserved_ratio"],
                   "floor": floor.ratio, "bar": floor.bar,
                   "within_bar": free["reserved_ratio"] <= floor.bar,
                   "device_call_share": free["device_call_share"],
                   "capped_ooms": capped["num_ooms"], "capped_retries": capped["num_alloc_retries"],
                   "capped_device_call_share": capped["device_call_share"],
                   "fraction_ooms": fractioned["num_ooms"],
                   "fraction_retries": fractioned["num_alloc_retries"],
                   "fraction_device_call_share": fractioned["device_call_share"]}
            rows.append(row)
            print(f"{row['trace'][:30]:30s} {name[:12]:12s} {row['reserved_ratio']:7.4f} "
                  f"{row['bar']:6.3f}{' ' if row['within_bar'] else '*'}"
                  f"{100 * row['device_call_share']:8.3f} | {row['capped_ooms']:10d} "
                  f"{row['capped_retries']:7d} {100 * row['capped_device_call_share']:8.3f} | "
                  f"{row['fraction_ooms']:13d} {row['fraction_retries']:7d} "
                  f"{100 * row['fraction_device_call_share']:8.3f}",
                  flush=True)
    for name in configs:
        mine = [r for r in rows if r["setting"] == name]
        print(f"{name}: {sum(r['within_bar'] for r in mine)} of {len(mine)} traces within "
              f"their bar (* above it), worst ratio "
              f"{max(r['reserved_ratio'] for r in mine):.4f}, worst call "
              f"share {100 * max(r['device_call_share'] for r in mine):.3f} %, "
              f"OOMs at {DEVICE_CAP}x: {sum(r['capped_ooms'] for r in mine)}, under a "
              f"{FRACTION_CAP}x fraction: "
              f"{sum(r['fraction_ooms'] for r in mine)} OOMs, "
              f"{sum(r['fraction_retries'] for r in mine)} retries")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv),
                                               "device_cap": DEVICE_CAP,
                                               "fraction_cap": FRACTION_CAP, "rows": rows},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
