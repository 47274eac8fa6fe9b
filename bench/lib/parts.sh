# Shared by the GPU check scripts (bench/gpu/gpu_checks.sh): run parts that
# may fail without stopping the rest, then a summary whose status says whether all passed.
#   source bench/lib/parts.sh; part NAME COMMAND...; ...; parts_summary
declare -a PART_NAMES=() PART_RESULTS=()

# part NAME COMMAND...: runs one part, records its status and time, never stops the run of parts.
# A command (not a shell function) is stopped after PART_TIMEOUT seconds (default 540), so
# that one hung part cannot use up a whole device call.
part() {
  local name="$1"; shift
  local started=$SECONDS
  echo; echo "=== $name: $* ==="
  if [ "$(type -t "$1")" = function ]; then
    "$@"
  else
    timeout -k 10 "${PART_TIMEOUT:-540}" "$@"
  fi
  local rc=$?
  [ $rc -eq 124 ] && echo "--- $name: stopped after ${PART_TIMEOUT:-540} s"
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
