#!/usr/bin/env bash
# Builds native targets of bench/CMakeLists.txt (the C++ benchmarks and the core's native
# tests) from the core's one source list; only CMake and a C++ compiler are needed.
#
#   bash bench/native/build.sh [--asan|--tsan] BUILD_DIR TARGET...
#
# Release flags, as the extension ships; --asan (ALLOCWATCH_SANITIZE: AddressSanitizer +
# UndefinedBehaviorSanitizer) and --tsan (ALLOCWATCH_TSAN: ThreadSanitizer) build everything,
# the core included, with -O1 -g and assertions on. A build folder keeps one configuration.
# Executables land in BUILD_DIR (the stand-in driver in BUILD_DIR/fake_libcuda).
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,/^set /s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; exit 0 ;; esac
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
flags=(-DCMAKE_BUILD_TYPE=Release)
case "${1:-}" in
  --asan) flags=(-DALLOCWATCH_SANITIZE=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo
                 "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g"); shift ;;
  --tsan) flags=(-DALLOCWATCH_TSAN=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo
                 "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g"); shift ;;
esac
if [ $# -lt 2 ]; then
  echo "usage: $0 [--asan|--tsan] BUILD_DIR TARGET..." >&2
  exit 2
fi
build="$1"; shift
log="$build/build.log"
mkdir -p "$build"
if ! { cmake -S "$repo" -B "$build" -DALLOCWATCH_BUILD_BENCH=ON "${flags[@]}" &&
       cmake --build "$build" --parallel --target "$@"; } >"$log" 2>&1; then
  cat "$log" >&2
  echo "building $* in $build failed" >&2
  exit 1
fi
