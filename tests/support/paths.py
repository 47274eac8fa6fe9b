"""Where things are, from the repository's root."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Traces recorded on an H200, beside the checkout (absent elsewhere: the tests that need them
# skip, saying why).
SHARED_TRACES = REPO.parent / "shared" / "traces"
RECORDED_TRACES = REPO / "tests" / "data" / "traces"
# Where bench/native's scripts build (run_hotpath.sh, run_trace_ops.sh): the tests that build or
# run there share it, so that the core is compiled once; they carry the xdist group of that name,
# which keeps them on one worker (two CMake runs in one folder at once would collide).
BENCH_BUILD = REPO / "build" / "native"
BENCH_BUILD_GROUP = "build/native"
