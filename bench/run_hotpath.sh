#!/usr/bin/env bash
# Builds and runs the hot-path benchmark of the core on the simulated device (g++ only).
# Usage: bash bench/run_hotpath.sh [--json FILE]
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="$repo/build/bench"
mkdir -p "$out"
core="$repo/allocator_ext/csrc/core"
"${CXX:-g++}" -std=c++17 -O2 -DNDEBUG -I "$repo/allocator_ext/csrc" \
  "$repo/bench/native/hotpath.cpp" "$core"/*.cpp "$repo/allocator_ext/csrc/backends/sim_device.cpp" \
  -lpthread -o "$out/hotpath"
"$out/hotpath" "$@"
