#!/usr/bin/env bash
# The core's soak: 8 threads of random operations on one allocator for 10 minutes, under
# AddressSanitizer + UndefinedBehaviorSanitizer, then under ThreadSanitizer
# (tests/native/core_stress.cpp). Printed: each run's operations and invariant recounts; a
# sanitizer's report, a leak or a race fails it.
# Usage: bash bench/native/soak_core.sh [SECONDS]   (default 600 each)
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,/^set /s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; exit 0 ;; esac
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
seconds="${1:-600}"
for s in asan tsan; do
  build="$here/../../build/soak_$s"
  bash "$here/build.sh" "--$s" "$build" core_stress
  echo "== $s, $seconds s"
  "$build/core_stress" --threads 8 --seconds "$seconds"
done
