#!/usr/bin/env bash
# A recorded trace's program through the core, timed an operation under several settings
# (bench/native/trace_ops.cpp says how). Usage:
#   bash bench/native/run_trace_ops.sh TRACE [--rounds N] [--json FILE] [SETTING...]
# Settings default to allocwatch's defaults, PyTorch's expandable segments rules and PyTorch's
# defaults: "defaults" "native,expandable_segments:True" "native".
set -euo pipefail
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
python3 "$repo/bench/replay/trace_program.py" "$trace" "$program" >/dev/null
"$build/trace_ops" "$program" ${options[@]+"${options[@]}"} "${settings[@]}"
