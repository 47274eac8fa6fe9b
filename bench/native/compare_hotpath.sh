#!/usr/bin/env bash
# The core's hot path built from two source trees and run in alternating rounds on one host,
# so that a host whose speed drifts slows both alike.
#
#   bash bench/native/compare_hotpath.sh OLD_TREE NEW_TREE [--runs N] [--rounds R] [--json FILE]
#
# A tree is a checkout's root: its CMakeLists.txt's allocwatch_core target says which sources
# make the core. Both sides build this checkout's hotpath.cpp with the same compiler and flags
# (CMake's Release, as the extension ships), so only the core differs. N runs of each side
# (default 10), in the order old, new, new, old, ... ; each run is `hotpath --rounds R`
# (default 21). Printed: per pattern, the median over runs of each side's median ns a pair,
# new / old, and the spread of the run-by-run ratios (p10-p90); then the geometric mean of the
# ratios. Absolute figures count only on an otherwise idle host (the H200 machine's).
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,/^set /s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; exit 0 ;; esac
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
usage() { echo "usage: $0 OLD_TREE NEW_TREE [--runs N] [--rounds R] [--json FILE]" >&2; exit 2; }
[ $# -ge 2 ] || usage
old="$(cd "$1" && pwd)"; new="$(cd "$2" && pwd)"; shift 2
runs=10 rounds=21 json=""
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) runs="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --json) json="$2"; shift 2 ;;
    *) usage ;;
  esac
done
for tree in "$old" "$new"; do
  [ -f "$tree/CMakeLists.txt" ] || { echo "$tree: no CMakeLists.txt (not a checkout's root)" >&2; exit 2; }
done
work="$repo/build/compare_hotpath"
rm -rf "$work/results"; mkdir -p "$work/results"

build() {  # TREE SIDE: the build's output goes to a log, shown if it fails
  local log="$work/build_$2.log"
  if ! { cmake -S "$1" -B "$work/$2" -DCMAKE_BUILD_TYPE=Release &&
         cmake --build "$work/$2" --target allocwatch_core -j &&
         "${CXX:-c++}" -std=c++17 -O3 -DNDEBUG -I "$1/allocator_ext/csrc" "$here/hotpath.cpp" \
           "$work/$2/liballocwatch_core.a" -lpthread -o "$work/$2/hotpath"; } >"$log" 2>&1; then
    cat "$log" >&2; echo "building the $2 side failed" >&2; exit 1
  fi
}
build "$old" old
build "$new" new
echo "old: $old"; echo "new: $new"; echo "$runs runs of each side, hotpath --rounds $rounds"

for ((i = 1; i <= runs; i++)); do
  order="old new"; [ $((i % 2)) -eq 0 ] && order="new old"
  for side in $order; do
    "$work/$side/hotpath" --rounds "$rounds" --json "$work/results/${side}_$i.json" >/dev/null
  done
done

python3 - "$work/results" "$runs" "$json" <<'PY'
import json, math, statistics, sys
from pathlib import Path
results, runs, out = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
def medians(side):
    per_run = [{r["pattern"]: r["median_ns"]
                for r in json.loads((results / f"{side}_{i}.json").read_text())["results"]}
               for i in range(1, runs + 1)]
    return per_run
old, new = medians("old"), medians("new")
def q(v, p):
    v = sorted(v); return v[int(p * (len(v) - 1))]
rows = []
print(f"{'pattern':36s} {'old ns':>9s} {'new ns':>9s} {'new/old':>8s} {'p10-p90 of runs':>16s}")
for name in old[0]:
    o = statistics.median(r[name] for r in old)
    n = statistics.median(r[name] for r in new)
    ratios = [b[name] / a[name] for a, b in zip(old, new)]
    rows.append({"pattern": name, "old_median_ns": o, "new_median_ns": n, "ratio": n / o,
                 "run_ratio_p10": q(ratios, 0.1), "run_ratio_p90": q(ratios, 0.9)})
    print(f"{name:36s} {o:9.1f} {n:9.1f} {n / o:8.3f} {q(ratios, 0.1):7.3f}-{q(ratios, 0.9):<7.3f}")
geo = math.exp(statistics.fmean(math.log(r["ratio"]) for r in rows))
worst = max(rows, key=lambda r: r["ratio"])
print(f"geometric mean new/old {geo:.3f}; worst {worst['ratio']:.3f} ({worst['pattern']})")
if out:
    Path(out).write_text(json.dumps({"runs": runs, "geomean_ratio": geo, "rows": rows}, indent=1))
PY
