#!/usr/bin/env bash
# What one allocation or free costs the core on a real workload's sequence of sizes: a recorded
# trace's allocations and frees (bench/replay/trace_program.py) replayed from C++ on the
# simulated device under several settings, taking turns round by round
# (bench/native/trace_ops.cpp says how). Usage:
#   bash bench/native/run_trace_ops.sh TRACE [--rounds N] [--json FILE] [SETTING...]
# Settings default to allocwatch's defaults, PyTorch's expandable segments rules and PyTorch's
# defaults: "defaults" "native,expandable_segments:True" "native". Printed, and written to FILE
# as JSON: each setting's median ns an operation, its ratio to the first setting's, and the
# device calls of its timed passes (none once the layout has settled).
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,/^set /s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; exit 0 ;; esac
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$here/../.."
if [ $# -lt 1 ] || [ "${1:0:1}" = "-" ]; then
  echo "usage: run_trace_ops.sh TRACE [--rounds N] [--json FILE] [SETTING...]" >&2
  exit 2
fi
trace="$1"; shift
options=(); settings=()
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds|--json) options+=("$1" "${2:?$1 needs a value}"); shift 2 ;;
    *) settings+=("$1"); shift ;;
  esac
done
[ ${#settings[@]} -gt 0 ] || settings=(defaults native,expandable_segments:True native)
build="$repo/build/native"
bash "$here/build.sh" "$build" trace_ops >/dev/null
program="$(mktemp)"
trap 'rm -f "$program"' EXIT
PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" python3 -m bench.replay.trace_program "$trace" "$program" \
  >/dev/null
"$build/trace_ops" "$program" ${options[@]+"${options[@]}"} "${settings[@]}"
