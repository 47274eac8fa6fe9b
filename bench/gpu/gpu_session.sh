#!/usr/bin/env bash
# One GPU session on the H200, run from the repository root in a single call:
#   OUT=/some/folder bash bench/gpu/gpu_session.sh
# 1. facts about the machine (GPU, driver, torch, CUDA, protobuf/grpcio versions);
# 2. builds bench/native/device_call_costs with CMake and a C++ compiler (no nvcc) and measures the cost of each kind of
#    device call -> $OUT/device_costs.json (+ its printed table in device_costs.txt);
# 3. records PyTorch memory traces of every workload x setting, one fresh process each ->
#    $OUT/traces.tar.gz (traces/*.pickle.gz + traces/manifest.json) and $OUT/traces_manifest.json;
# 4. a summary table, last.
# A part that fails is reported and the others still run; the exit status says whether all
# passed. Everything printed is also in $OUT/session.log. About 6-8 minutes in all.
# Optional: GPU_SESSION_INSTALL=1 also runs `pip install --no-build-isolation -e .` first.
set -u -o pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$repo"
: "${OUT:?set OUT to the folder whose files come back}"
mkdir -p "$OUT"
PYTHON="${PYTHON:-$(command -v python || command -v python3)}"
work="$repo/build/gpu_session"
rm -rf "$work" && mkdir -p "$work"

source "$repo/bench/lib/parts.sh"

facts() {
  nvidia-smi -L
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
  "$PYTHON" - <<'PY'
import platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| cuDNN", torch.backends.cudnn.version(), "| GPU available:", torch.cuda.is_available())
PY
  pip show protobuf grpcio 2>/dev/null | grep -E '^(Name|Version):' || echo "protobuf/grpcio: not installed"
  command -v nvcc >/dev/null && nvcc --version | tail -1 || echo "nvcc: not on PATH (not needed)"
  g++ --version | head -1
}

install_package() {
  "$PYTHON" -m pip install --no-build-isolation -e . 2>&1 | tail -20
}

device_costs() {
  bash bench/native/build_native.sh "$work/native" || return $?
  timeout 240 "$work/native/device_call_costs" --json "$OUT/device_costs.json" | tee "$OUT/device_costs.txt"
}

traces() {
  # --budget-s stops starting new recordings in time; each recording has its own timeout.
  timeout 420 "$PYTHON" bench/replay/record_traces.py --out "$work/traces" --budget-s 280 --timeout-s 120
  local rc=$?
  if [ -d "$work/traces" ]; then
    tar -czf "$OUT/traces.tar.gz" -C "$work" traces && ls -l "$OUT/traces.tar.gz"
    [ -f "$work/traces/manifest.json" ] && cp "$work/traces/manifest.json" "$OUT/traces_manifest.json"
  fi
  return $rc
}

main() {
  echo "gpu_session: $(date -u +%FT%TZ) on $(hostname), source $("$PYTHON" -m bench.lib.source_tree 2>/dev/null)"
  part "machine facts" facts
  if [ "${GPU_SESSION_INSTALL:-0}" = 1 ]; then part "pip install -e ." install_package; fi
  part "device call costs" device_costs
  part "memory traces" traces

  echo
  echo "=================== summary ==================="
  "$PYTHON" bench/gpu/summarize_gpu_session.py "$OUT/device_costs.json" "$OUT/traces_manifest.json"
  echo
  local failed=0
  parts_summary || failed=1
  echo "  total ${SECONDS} s; files in \$OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
  return $failed
}

main 2>&1 | tee "$OUT/session.log"
exit "${PIPESTATUS[0]}"
