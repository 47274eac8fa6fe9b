#!/usr/bin/env bash
# Builds the native benchmark that measures the GPU (no CUDA toolkit needed):
#   OUTPUT_DIR/device_call_costs   what each kind of device call costs on the GPU
# Usage: bash bench/native/build_native.sh [OUTPUT_DIR]   (default build/native)
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,/^set /s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; exit 0 ;; esac
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="${1:-$here/../../build/native}"
bash "$here/build.sh" "$out" device_call_costs
echo "built $out/device_call_costs"
