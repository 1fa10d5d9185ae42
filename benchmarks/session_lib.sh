# Shared by the GPU session scripts (gpu_session.sh, gpu_ep_session.sh, gpu_layer_session.sh):
# the output folder ($OUT, default /tmp/out), the session deadline (SESSION_S, default 560 s: keep
# it below any limit the machine puts on one command), run_step (one step under its own time
# cap, its log in $OUT/<step>.log) and pytest_report. NVLink multicast stays off (NCCL NVLS,
# symmetric memory, NVSHMEM): some multi-GPU hosts do not support it. Sourced from the repo root;
# also sources device_env.sh (megatron-core from a wheel in .whl/, if there is one).
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
T_START=$(date +%s)
DEADLINE=$(( T_START + ${SESSION_S:-560} ))
SUMMARY=()

# run_step NAME CAP_S COMMAND...: runs COMMAND with stdout+stderr to $OUT/NAME.log under
# min(CAP_S, time left) seconds; records "NAME: ok|FAILED (rc)|TIMED OUT|skipped, N s".
run_step() {
  local name=$1 cap=$2
  shift 2
  local left=$(( DEADLINE - $(date +%s) ))
  if (( left < 30 )); then
    SUMMARY+=("$name: skipped (${left} s of the session left)")
    echo "== $name: skipped, ${left} s left"
    return 99
  fi
  (( cap > left )) && cap=$left
  local t0
  t0=$(date +%s)
  echo "== $name (cap ${cap} s): $*"
  # SIGINT first: pytest prints its summary, python its traceback; SIGKILL 15 s later
  timeout -s INT -k 15 "$cap" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  local dt=$(( $(date +%s) - t0 ))
  local what="ok"
  if (( rc == 124 || rc == 137 )); then what="TIMED OUT after ${cap} s"
  elif (( rc != 0 )); then what="FAILED (exit $rc)"; fi
  SUMMARY+=("$name: $what, ${dt} s")
  echo "== $name: $what, ${dt} s"
  return $rc
}

pytest_report() {  # the summary line and the failures of a pytest log, into the summary too
  [ -f "$1" ] || return 0
  local counts
  counts=$(grep -E "(passed|failed|error|skipped)" "$1" | tail -n 1)
  echo "$counts"
  grep -E "^(FAILED|ERROR)|Timeout" "$1" | cut -c1-300 | head -n ${NFAIL:-20}
  SUMMARY+=("  $counts")
}

source benchmarks/device_env.sh
