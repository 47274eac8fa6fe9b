"""Prints the closing summary of bench/gpu/gpu_session.sh: the device call cost table and one line
per recorded trace. Usage: python bench/gpu/summarize_gpu_session.py COSTS.json MANIFEST.json"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _load(path: str) -> dict[str, Any] | None:
    try:
        loaded: dict[str, Any] = json.loads(Path(path).read_text())
        return loaded
    except (OSError, ValueError) as error:
        print(f"  (cannot read {path}: {error})")
        return None


def print_costs(costs: dict[str, Any]) -> None:
    print(f"device call costs on {costs.get('device')} (driver {costs.get('driver')}, "
          f"measured {costs.get('measured_on')}):")
    print(f"  {'call':18s} {'fixed us':>10s} {'per GiB us':>12s} {'2 MiB us':>10s} "
          f"{'2 GiB us':>10s}")
    for name, cost in {**costs.get("calls", {}), **costs.get("extra_calls", {})}.items():
        fixed, per_byte = cost["fixed_s"], cost["per_byte_s"]
        print(f"  {name:18s} {fixed * 1e6:10.2f} {per_byte * 2**30 * 1e6:12.1f} "
              f"{(fixed + per_byte * 2**21) * 1e6:10.2f} {(fixed + per_byte * 2**31) * 1e6:10.1f}")


def print_traces(manifest: dict[str, Any]) -> None:
    print(f"traces (torch {manifest.get('torch')}, CUDA {manifest.get('cuda')}, "
          f"{manifest.get('device')}):")
    print(f"  {'trace':26s} {'status':8s} {'steps':>5s} {'events':>7s} {'peak GiB':>8s} "
          f"{'dev alloc':>9s} {'seg_alloc':>9s} {'seg_map':>7s} {'retries':>7s} {'MiB':>5s}")
    for t in manifest.get("traces", []):
        name = f"{t['workload']}__{t['setting']}"
        if t.get("status") != "ok":
            print(f"  {name:26s} {t.get('status', '?'):8s} {t.get('error', '')[:80]}")
            continue
        stats, actions = t["stats"], t["trace"]["actions"]
        print(f"  {name:26s} {'ok':8s} {t['steps']:5d} {t['trace']['events']:7d} "
              f"{stats['reserved_bytes.all.peak'] / 2**30:8.2f} {stats['num_device_alloc']:9d} "
              f"{actions.get('segment_alloc', 0):9d} {actions.get('segment_map', 0):7d} "
              f"{stats['num_alloc_retries']:7d} {t.get('file_bytes', 0) / 2**20:5.2f}")


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__)
        return 2
    costs, manifest = _load(argv[1]), _load(argv[2])
    if costs:
        print_costs(costs)
    if manifest:
        print_traces(manifest)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
