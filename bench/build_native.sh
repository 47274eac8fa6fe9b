#!/usr/bin/env bash
# Builds the native benchmarks that need only g++ (no CUDA toolkit, no CMake project):
#   build/bench/device_call_costs   what each kind of device call costs on the GPU
# Usage: bash bench/build_native.sh [OUTPUT_DIR]   (run from anywhere; default build/bench)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$repo/build/bench}"
mkdir -p "$out"
CXX="${CXX:-g++}"
backend="$repo/allocator_ext/csrc/backends"
"$CXX" -std=c++17 -O2 -Wall -Wextra -Wno-unused-parameter \
  -I "$repo/allocator_ext/csrc" -I "$repo/bench" \
  "$repo/bench/device_call_costs.cpp" \
  "$backend/cuda_driver.cpp" "$backend/cuda_event_pool.cpp" "$backend/cuda_device.cpp" \
  -ldl -o "$out/device_call_costs"
echo "built $out/device_call_costs"
