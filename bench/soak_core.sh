#!/usr/bin/env bash
# The core's soak: 8 threads of random operations on one allocator for 10 minutes, under
# AddressSanitizer + UndefinedBehaviorSanitizer, then under ThreadSanitizer.
# Usage: bash bench/soak_core.sh [SECONDS]   (default 600 each)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
seconds="${1:-600}"
mkdir -p "$repo/build/soak"
for s in asan tsan; do
  bash "$repo/tests/native/build_core_stress.sh" "$s" "$repo/build/soak/core_stress_$s"
  echo "== $s, $seconds s"
  "$repo/build/soak/core_stress_$s" --threads 8 --seconds "$seconds"
done
