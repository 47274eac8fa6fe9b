#!/usr/bin/env bash
# The drop-in check of allocwatch's native back end on a GPU machine, in one command, from the
# repository root:
#
#   cp -r ../shared/peer .peer                   # PyTorch's test_cuda.py selection (ignored)
#   OUT=/some/folder bash bench/gpu/dropin_check.sh [PART...]
#
# Parts (default: all, in this order; each has its own time limit, and a part that fails or
# times out is reported while the next still runs):
#   install    pip install --no-build-isolation --no-deps -e . (the core)
#   build      allocwatch native build: the back end against this torch (its compiler output in
#              build.log, including which release-dependent functions it overrides)
#   gputests   tests/pytorch/test_native_gpu.py (one scenario per feature, on the GPU) and
#              tests/pytorch/test_native_sim.py (the same back end, built with this machine's
#              compiler, on the simulated device)
#   workloads  bench/gpu/dropin_workloads.py: timm ResNet-50 with cudnn.benchmark, a Hugging Face
#              GPT-2 under torch.compile (default and reduce-overhead), Lightning with
#              DeviceStatsMonitor, torch.multiprocessing with CUDA tensors; each under
#              `allocwatch run` and under PyTorch's expandable segments
#   kernel     what the kernel allows for sharing expandable segments (pidfd_open,
#              pidfd_getfd, ptrace scope)
#   peer       PyTorch's own allocator tests (.peer/) under `allocwatch run` only, with at most
#              DROPIN_PEER_S seconds (default 230); the tests that fail, each with its first
#              line, those that torch 2.11 or a machine without network fail natively marked so
#   peer_pair  .peer/run_peer.sh: the same tests natively and under `allocwatch run`, compared
#
# Time: at most DROPIN_TOTAL_S seconds for all (default 420 where parts are named, 540 for the
# default of all parts); the parts before the peer tests stop starting runs once less than the
# peer's share is left. `install build gputests peer` takes about 6 minutes on one H200.
#
# Every test process runs with bench/gpu/crash_report.c preloaded where a C compiler is found:
# a process that dies of a signal prints its native stack, resolved to functions and lines
# (addr2line) in the summary.
#
# Written to $OUT (8 files at most): summary.txt (also printed last), build.log, gpu_tests.txt,
# workloads.jsonl, kernel.txt, peer_allocwatch.txt (or peer_comparison.txt), peer.tar.gz (the
# peer run's folder), logs.tar.gz (every part's log).
set -u -o pipefail
case "${1:-}" in -h|--help) sed -n '2,/^set /s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; exit 0 ;; esac
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$repo"
: "${OUT:?set OUT to the folder whose files come back}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
PYTHON="${PYTHON:-python3}"
if [ $# -eq 0 ]; then TOTAL="${DROPIN_TOTAL_S:-540}"; else TOTAL="${DROPIN_TOTAL_S:-420}"; fi
PEER_RESERVE="${DROPIN_PEER_S:-230}"
T0=$(date +%s)
WORK="$(mktemp -d /tmp/dropin.XXXXXX)"
LOGS="$WORK/logs"
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1
export ALLOCWATCH_NATIVE_DIR="${ALLOCWATCH_NATIVE_DIR:-$WORK/native-cache}"   # one build, found by every part
SUMMARY="$WORK/summary.txt"
: > "$SUMMARY"

# The crash reporter, preloaded into the test processes (nothing where no compiler is found).
REPORT=()  # the command prefix that preloads it
for cc in "${CC:-cc}" gcc "${CXX:-g++}"; do
  if command -v "$cc" > /dev/null 2>&1 &&
     "$cc" -x c -O1 -fPIC -shared bench/gpu/crash_report.c -o "$WORK/crash_report.so" 2> /dev/null; then
    REPORT=(env "LD_PRELOAD=$WORK/crash_report.so${LD_PRELOAD:+:$LD_PRELOAD}")
    break
  fi
done

left() { echo $(( TOTAL - ($(date +%s) - T0) )); }
note() { echo "$*" | tee -a "$SUMMARY"; }
say() { echo "[dropin +$(( $(date +%s) - T0 ))s] $*"; }

# part NAME LIMIT CMD...: runs CMD under a time limit (never past the total), logs it, notes
# its status in the summary.
part() {
  local name=$1 limit=$2; shift 2
  local l; l=$(( $(left) - 5 ))
  [ "$l" -lt "$limit" ] && limit=$l
  if [ "$limit" -lt 10 ]; then note "$name: SKIPPED (no time left)"; return 1; fi
  say "$name (up to ${limit}s): $*"
  local start rc; start=$(date +%s)
  timeout -k 10 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  rc=$?
  local took=$(( $(date +%s) - start ))
  case $rc in
    0) note "$name: ok (${took}s)" ;;
    124|137) note "$name: TIMED OUT after ${took}s" ;;
    *) note "$name: FAILED rc=$rc (${took}s): $(grep -v '^\s*$' "$LOGS/$name.log" | tail -3 | tr '\n' ' ' | cut -c1-400)" ;;
  esac
  return $rc
}

# Crash reports in a log, each frame of a library resolved to its function and source line.
resolve_crashes() {
  local log=$1 name=$2
  grep -q "=== allocwatch crash report" "$log" 2> /dev/null || return 0
  note "$name: native crash report(s) in its log; frames of allocwatch's libraries:"
  grep -oE "^/[^ (]*(allocwatch_native|_core)[^ (]*\.so\(\+0x[0-9a-f]+\)" "$log" | sort | uniq -c |
    sort -rn | head -12 | while read -r count frame; do
      local lib=${frame%%(*} offset=${frame##*(+}
      offset=${offset%)}
      local where="(addr2line missing)"
      command -v addr2line > /dev/null && where=$(addr2line -f -C -e "$lib" "$offset" 2>&1 | paste -sd' ')
      note "  ${count}x $(basename "$lib")+$offset: $where"
    done
  # The first report in full: the frames below allocwatch's (torch's, the driver's) say who
  # called it and how it got there.
  sed -n '/=== allocwatch crash report/,/=== end of crash report/p' "$log" | head -48 |
    sed 's/^/  /' | tee -a "$SUMMARY"
}

# Which C++ runtime each of allocwatch's libraries loads and which compiler built them: an
# exception crossing two runtimes (one linked statically) is a classic cause of a crash.
note_runtimes() {
  local lib cxx
  cxx=$(head -1 "$OUT/build.log" 2>/dev/null | awk '{print $1}')
  note "build: ${cxx:-?}: $("${cxx:-${CXX:-g++}}" --version 2>&1 | head -1)"
  for lib in "$@"; do
    [ -f "$lib" ] || continue
    note "build: $(basename "$lib"): $(ldd "$lib" 2>&1 | grep -E 'libstdc\+\+|libgcc_s|libc10' | awk '{print $1 "=" $3}' | tr '\n' ' ')$(nm -D --defined-only "$lib" 2>/dev/null | grep -q ' __cxa_throw$' && echo ' (defines __cxa_throw: libstdc++ linked in)')"
  done
}

do_install() {
  part install 120 "$PYTHON" -m pip install -q --no-build-isolation --no-deps -e .
}

do_build() {
  part build 200 "$PYTHON" -m exporter.cli native build
  local log; log=$(ls "$ALLOCWATCH_NATIVE_DIR"/*/build.log 2>/dev/null | head -1)
  if [ -n "$log" ]; then
    cp "$log" "$OUT/build.log"
    note "build: overrides by declaration: $(grep -o "AllocwatchAllocator::[A-Za-z]*(" "$log" | sort -u | tr '\n' ' ')"
  fi
  note_runtimes "$ALLOCWATCH_NATIVE_DIR"/*/allocwatch_native.so \
    "$("$PYTHON" -c 'import allocator_ext._core as c; print(c.__file__)' 2>/dev/null)"
}

do_gputests() {
  if [ "$(left)" -lt $(( PEER_RESERVE + 60 )) ]; then note "gputests: SKIPPED (time kept for peer)"; return; fi
  part gputests 180 ${REPORT[@]+"${REPORT[@]}"} "$PYTHON" -m pytest -q -rA -p no:cacheprovider \
    tests/pytorch/test_native_gpu.py tests/pytorch/test_native_sim.py
  cp "$LOGS/gputests.log" "$OUT/gpu_tests.txt"
  resolve_crashes "$LOGS/gputests.log" gputests
  note "gputests: $(grep -E '^(PASSED|FAILED|ERROR)' "$LOGS/gputests.log" | sed 's/tests\/[a-z_/]*\.py:://' | cut -c1-80 | tr '\n' ';' | cut -c1-900)"
  note "gputests: $(tail -1 "$LOGS/gputests.log")"
}

do_workloads() {
  local jsonl="$OUT/workloads.jsonl"
  : > "$jsonl"
  local w
  for w in timm_cudnn hf_reduce_overhead hf_compile lightning multiprocessing; do
    if [ "$(left)" -lt $(( PEER_RESERVE + 40 )) ]; then note "workload $w: SKIPPED (time kept for peer)"; continue; fi
    part "w_${w}_allocwatch" 80 "$PYTHON" -m exporter.cli run -- "$PYTHON" -m bench.gpu.dropin_workloads \
      "$w" --steps 8 --json "$jsonl"
    part "w_${w}_expandable" 60 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
      "$PYTHON" -m bench.gpu.dropin_workloads "$w" --steps 8 --json "$jsonl"
  done
  "$PYTHON" - "$jsonl" <<'EOF' | tee -a "$SUMMARY"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
by = {}
for r in rows:
    by.setdefault(r["workload"], {})[r["allocator"]] = r
for w, runs in by.items():
    parts = []
    for name, r in sorted(runs.items()):
        parts.append(f"{name} " + (f"{r['reserved_ratio']}" if r.get("ok") else f"ERROR {r.get('error', '')[:160]}"))
    print(f"workload {w}: peak reserved/requested " + " | ".join(parts))
EOF
}

do_kernel() {
  part kernel 20 "$PYTHON" - <<'EOF'
import ctypes, os, platform, sys
print("kernel", platform.release())
try:
    print("yama ptrace_scope", open("/proc/sys/kernel/yama/ptrace_scope").read().strip())
except OSError as e:
    print("yama ptrace_scope: absent", e)
libc = ctypes.CDLL(None, use_errno=True)
SYS_pidfd_open, SYS_pidfd_getfd = 434, 438
r, w = os.pipe()
pid = os.fork()
if pid == 0:  # the child takes the parent's fd, as a receiving process takes the sender's
    pidfd = libc.syscall(SYS_pidfd_open, os.getppid(), 0)
    e1 = ctypes.get_errno()
    fd = libc.syscall(SYS_pidfd_getfd, pidfd, r, 0) if pidfd >= 0 else -1
    e2 = ctypes.get_errno()
    print(f"child: pidfd_open(parent) -> {pidfd} ({os.strerror(e1) if pidfd < 0 else 'ok'}), "
          f"pidfd_getfd(parent's fd) -> {fd} ({os.strerror(e2) if fd < 0 else 'ok'})", flush=True)
    os._exit(0 if fd >= 0 else 3)
_, status = os.waitpid(pid, 0)
print("child takes a parent's fd:", "allowed" if os.waitstatus_to_exitcode(status) == 0 else "REFUSED")
pid = os.fork()
if pid == 0:
    import time; time.sleep(3); os._exit(0)
pidfd = libc.syscall(SYS_pidfd_open, pid, 0)
fd = libc.syscall(SYS_pidfd_getfd, pidfd, 0, 0) if pidfd >= 0 else -1
print("parent takes a child's fd:", "allowed" if fd >= 0 else f"REFUSED ({os.strerror(ctypes.get_errno())})")
os.waitpid(pid, 0)
EOF
  cp "$LOGS/kernel.log" "$OUT/kernel.txt"
  note "kernel: $(grep -E 'ptrace_scope|takes' "$LOGS/kernel.log" | tr '\n' ';')"
}

peer_ready() {
  if [ ! -f .peer/run_peer.sh ]; then note "$1: SKIPPED (.peer/ absent: cp -r ../shared/peer .peer)"; return 1; fi
}

# PyTorch's tests under `allocwatch run` only, as run_peer.sh runs its allocwatch half (its
# helper wheels, a clean allocator environment, a fresh pytest process after a crash).
do_peer() {
  peer_ready peer || return
  local budget; budget=$(( $(left) - 25 ))
  [ "$budget" -gt "$PEER_RESERVE" ] && budget=$PEER_RESERVE
  if [ "$budget" -lt 60 ]; then note "peer: SKIPPED (only ${budget}s left)"; return; fi
  local site="$WORK/peersite" dir="$WORK/peer"
  mkdir -p "$dir"
  "$PYTHON" -m pip install -q --disable-pip-version-check --no-index --no-deps --target "$site" \
    .peer/wheels/*.whl > "$LOGS/peer_wheels.log" 2>&1 || note "peer: the helper wheels did not install (peer_wheels.log)"
  part peer $(( budget + 30 )) ${REPORT[@]+"${REPORT[@]}"} env PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" \
    TORCH_EXTENSIONS_DIR=/tmp/peer_torch_extensions \
    "$PYTHON" .peer/peer_runner.py --name allocwatch --selection .peer/selection.txt --allocwatch \
    --allocwatch-cmd "$PYTHON -m exporter.cli run" --budget "$budget" --out "$dir" \
    --per-test-timeout 60 --watchdog 100 --env PYTORCH_CUDA_ALLOC_CONF= --env PYTORCH_ALLOC_CONF= \
    --env ALLOCWATCH_RUN= --env ALLOCWATCH_TARGET= --env ALLOCWATCH_DISABLE= --env ALLOCWATCH_ALLOC_CONF=
  "$PYTHON" -m bench.gpu.peer_failures "$dir/allocwatch.xml" > "$OUT/peer_allocwatch.txt" 2>&1
  note "peer: $(head -1 "$OUT/peer_allocwatch.txt")"
  grep -E "^  (FAIL|ERROR) " "$OUT/peer_allocwatch.txt" | cut -c1-200 | tee -a "$SUMMARY"
  resolve_crashes "$dir/allocwatch.log" peer
  tar -czf "$OUT/peer.tar.gz" -C "$WORK" peer 2>/dev/null
}

do_peer_pair() {
  peer_ready peer_pair || return
  local budget; budget=$(( $(left) - 25 ))
  if [ "$budget" -lt 120 ]; then note "peer_pair: SKIPPED (only ${budget}s left)"; return; fi
  local main=$(( (budget - 30) / 2 ))
  part peer_pair $(( budget + 20 )) ${REPORT[@]+"${REPORT[@]}"} env PROJ="$repo" OUT="$WORK/peer" PEER_TOTAL_S="$budget" \
    PEER_MAIN_S="$main" PEER_EXPANDABLE=0 bash .peer/run_peer.sh
  if [ -f "$WORK/peer/comparison.txt" ]; then
    cp "$WORK/peer/comparison.txt" "$OUT/peer_comparison.txt"
    note "peer_pair: $(head -12 "$WORK/peer/comparison.txt" | tr '\n' ' ' | cut -c1-700)"
  fi
  resolve_crashes "$WORK/peer/allocwatch.log" peer_pair
  tar -czf "$OUT/peer.tar.gz" -C "$WORK" peer 2>/dev/null
}

parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(install build kernel gputests workloads peer_pair)
note "dropin check $(date -u +%FT%TZ) on $(hostname): $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1)"
note "torch $("$PYTHON" -c 'import torch; print(torch.__version__, torch.version.cuda, torch.version.git_version[:12])' 2>&1 | tail -1); source $("$PYTHON" -m bench.lib.source_tree 2>/dev/null)"
for p in "${parts[@]}"; do
  case $p in
    install) do_install ;; build) do_build ;; gputests) do_gputests ;;
    workloads) do_workloads ;; kernel) do_kernel ;; peer) do_peer ;; peer_pair) do_peer_pair ;;
    *) note "unknown part $p" ;;
  esac
done
tar -czf "$OUT/logs.tar.gz" -C "$WORK" logs 2>/dev/null
cp "$SUMMARY" "$OUT/summary.txt"
echo
echo "##### summary ($(( $(date +%s) - T0 ))s; files in $OUT)"
cat "$SUMMARY"
