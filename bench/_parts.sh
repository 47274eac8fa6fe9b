# Shared by the GPU session scripts (bench/gpu_session.sh, bench/gpu_checks.sh): run parts that
# may fail without stopping the rest, then a summary whose status says whether all passed.
#   source bench/_parts.sh; part NAME COMMAND...; ...; parts_summary
declare -a PART_NAMES=() PART_RESULTS=()

# part NAME COMMAND...: runs one part, records its status and time, never stops the session.
part() {
  local name="$1"; shift
  local started=$SECONDS
  echo; echo "=== $name: $* ==="
  "$@"
  local rc=$?
  local result="ok"
  [ $rc -ne 0 ] && result="FAILED (exit $rc)"
  PART_NAMES+=("$name"); PART_RESULTS+=("$result, $((SECONDS - started)) s")
  echo "--- $name: $result, $((SECONDS - started)) s"
}

# parts_summary: one line per part; returns 1 if any failed.
parts_summary() {
  local failed=0 i
  for i in "${!PART_NAMES[@]}"; do
    printf '  %-22s %s\n' "${PART_NAMES[$i]}" "${PART_RESULTS[$i]}"
    case "${PART_RESULTS[$i]}" in FAILED*) failed=1 ;; esac
  done
  return $failed
}
