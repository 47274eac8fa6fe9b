#!/usr/bin/env bash
# Builds and runs the hot-path benchmark of the core on the simulated device.
# Usage: bash bench/native/run_hotpath.sh [--rounds N] [--json FILE]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
build="$here/../../build/native"
bash "$here/build.sh" "$build" hotpath
"$build/hotpath" "$@"
