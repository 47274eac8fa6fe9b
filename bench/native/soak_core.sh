#!/usr/bin/env bash
# The core's soak: 8 threads of random operations on one allocator for 10 minutes, under
# AddressSanitizer + UndefinedBehaviorSanitizer, then under ThreadSanitizer.
# Usage: bash bench/native/soak_core.sh [SECONDS]   (default 600 each)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
seconds="${1:-600}"
for s in asan tsan; do
  build="$here/../../build/soak_$s"
  bash "$here/build.sh" "--$s" "$build" core_stress
  echo "== $s, $seconds s"
  "$build/core_stress" --threads 8 --seconds "$seconds"
done
