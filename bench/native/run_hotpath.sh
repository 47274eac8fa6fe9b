#!/usr/bin/env bash
# The core's hot path on the simulated device: alloc + free pairs of cached blocks (512 B,
# 64 KiB, 4 MiB, 64 MiB, a mix with 1,000 blocks in use, and 1,000 against 100,000 blocks in
# use), under PyTorch's rules (`native`) and allocwatch's defaults, the patterns taking turns
# batch by batch so that a host whose pace drifts slows each alike (bench/native/hotpath.cpp).
# Builds it (bench/native/build.sh, Release) and runs it:
#   bash bench/native/run_hotpath.sh [--rounds N] [--json FILE]
# Printed, and written to FILE as JSON: each pattern's median ns a pair with p10 and p90, and the
# median ratio of 100,000 to 1,000 blocks in use (`scale_ratio`). Absolute figures count only on
# an otherwise idle host.
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,/^set /s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; exit 0 ;; esac
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
build="$here/../../build/native"
bash "$here/build.sh" "$build" hotpath
"$build/hotpath" "$@"
