#!/usr/bin/env bash
# Builds tests/native/core_stress.cpp with sanitizers (g++ only).
# Usage: build_core_stress.sh {asan|tsan} OUTPUT
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
case "$1" in
  asan) flags=(-fsanitize=address,undefined -fno-sanitize-recover=all) ;;
  tsan) flags=(-fsanitize=thread) ;;
  *) echo "usage: $0 {asan|tsan} OUTPUT" >&2; exit 2 ;;
esac
core="$repo/allocator_ext/csrc/core"
"${CXX:-g++}" -std=c++17 -O1 -g -fno-omit-frame-pointer "${flags[@]}" -I "$repo/allocator_ext/csrc" \
  "$repo/tests/native/core_stress.cpp" "$core"/*.cpp "$repo/allocator_ext/csrc/backends/sim_device.cpp" \
  -lpthread -o "$2"
