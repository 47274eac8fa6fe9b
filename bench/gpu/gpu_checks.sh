#!/usr/bin/env bash
# The GPU checks of the PyTorch integration, the agent, tuning and reliability, in parts that
# fit the device tool's 10-minute calls. Run from the repository root on a GPU machine:
#   OUT=/some/folder bash bench/gpu/gpu_checks.sh PART...
# Parts (each prints its command; a part that fails is reported and the next still runs):
#   install      python -m pip install --no-build-isolation --no-deps -e .
#   tests        the pluggable path's and the agent's GPU tests (the torchrun ones need 2 GPUs)
#   torchrun     only the torchrun tests (2 GPUs)
#   soak-start   starts bench.gpu.gpu_soak (10 min, sidecar SIGKILLed every 60 s) in its own process
#                group on the last GPU, so other parts can use GPU 0 meanwhile
#   soak-wait    waits for it and copies its JSON and log to $OUT
#   overhead     bench.sidecar.agent_overhead (in-process A/B blocks) for allocwatch's allocator and
#                PyTorch's
#   hotpath      bench.gpu.torch_bench hotpath --rounds 31
#   corehotpath  bench/native/run_hotpath.sh: the core's hot path on the simulated device, on this
#                host's CPU (the bar of 100 ns a pair applies on the GPU machine's host)
#   train        bench.gpu.torch_bench train (transformer), then the convnet
#   lockstep     bench.gpu.step_lockstep --suite: transformer, moe and convnet against
#                expandable segments, uncapped and at 1.03 x, on fresh shapes after warm-up:
#                the two processes take turns step by step
#   patterns     bench.gpu.patterns: every pattern of the workload library in lockstep under
#                PyTorch's default, its expandable segments and allocwatch, uncapped and at 1.03 x,
#                8 rounds, each pattern a part of its own (PATTERNS="transformer graph ..." picks
#                some, default all; PATTERN_MODE=quick for fewer steps a round; PATTERN_OURS=NAME
#                judges another entry of bench/lib/allocators.py, PATTERN_ALSO="NAME ..." adds
#                processes to the lockstep), then one table: $OUT/patterns/patterns.md and .json
#                (about 8 minutes quick, 16 full, for all)
#   convnetprofile  bench.gpu.host_profile --fresh --model convnet: where the convnet's host time
#                goes on fresh shapes, allocwatch against expandable segments and then expandable
#                against itself (per op, per kernel, and one cudaMemGetInfo's cost; about 4 minutes)
#   convnetbar   the convnet's step-time bar in one verdict: bench.gpu.step_lockstep --model
#                convnet, 16 rounds of 12 steps, uncapped and at 1.03 x, each once with allocwatch's
#                process first and once with expandable's, pooled by bench.gpu.lockstep_pool
#                (about 5 minutes)
#   convnetsplit where the convnet's gap goes, 16 rounds of 12 steps each, in both process orders:
#                our core under PyTorch's page rules (ALLOCWATCH_ALLOC_CONF=native) against PyTorch's
#                allocator, the same layout on both sides; then the native back end against the
#                pluggable path, the same core; each pair pooled by bench.gpu.lockstep_pool
#                (about 4 minutes)
#   convnetcontrols  the convnet's gap against its controls, 16 rounds of 12 steps each, every pair
#                twice (once in each process order): allocwatch against expandable segments;
#                expandable segments with allocwatch's libraries loaded but not installed against
#                expandable segments (what the libraries' presence costs); and each allocator
#                against itself (how far two processes of one allocator differ); the first two
#                pooled by bench.gpu.lockstep_pool (about 6 minutes)
#   convnetloaded  convnetcontrols' second pair alone: expandable segments with allocwatch's
#                libraries loaded but not installed, against expandable segments, in both process
#                orders, pooled (about 2 minutes)
#   probes       bench/native/device_call_costs --quick: the cost table's calls plus the driver probes
#                (one unmap over several mappings; pieces of one allocation mapped by offset)
#   agentcpu     bench.sidecar.agent_cpu_cost --source pytorch, then allocwatch: the agent's CPU
#                share and its sample's time with CUDA tensors and NVML
#   policy       bench.gpu.policy_under_cap --fraction-of-peak 1.03 (POLICY_FRACTION overrides)
#   native       allocwatch native build (ahead of the parts below, so no launch pays for it)
#   distributed1 bench.gpu.distributed_train --nproc 1: DDP and FSDP, one rank on GPU 0 (NCCL),
#                under PyTorch's allocator, its expandable segments and allocwatch's
#   distributed  the same with every GPU of the host (2 at least), 2 rounds
#   distributedhook  TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1, every GPU: PyTorch's allocator,
#                allocwatch's defaults (hook switched off), allocwatch with plain segments (hook on)
#   distributedtests tests/distributed/test_distributed_gpu.py (1 GPU for one test, 2 for the others)
# Everything printed is also in $OUT/checks.log.
set -u -o pipefail
case "${1:-}" in -h|--help) sed -n '2,/^set /s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; exit 0 ;; esac
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$repo"
: "${OUT:?set OUT to the folder whose files come back}"
mkdir -p "$OUT"
PYTHON="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
SOAK_DIR=/tmp/allocwatch-soak

source "$repo/bench/lib/parts.sh"

last_gpu() { echo $(( $(nvidia-smi -L | wc -l) - 1 )); }

soak_start() {
  rm -rf "$SOAK_DIR" && mkdir -p "$SOAK_DIR"
  CUDA_VISIBLE_DEVICES="$(last_gpu)" setsid "$PYTHON" -m bench.gpu.gpu_soak --minutes 10 \
    --kill-every 60 --json "$SOAK_DIR/soak.json" >"$SOAK_DIR/soak.log" 2>&1 < /dev/null &
  echo "soak running on GPU $(last_gpu), pid $!, log $SOAK_DIR/soak.log"
}

soak_wait() {
  while pgrep -f "bench.gpu.gpu_soak" >/dev/null; do sleep 5; done
  cp "$SOAK_DIR/soak.log" "$OUT/soak.log"; tail -30 "$SOAK_DIR/soak.log"
  cp "$SOAK_DIR/soak.json" "$OUT/soak.json"
}

run_part() {
  case "$1" in
    install) part install "$PYTHON" -m pip install -q --no-build-isolation --no-deps -e . ;;
    tests) part tests "$PYTHON" -m pytest -q -rs -p no:cacheprovider \
        tests/pytorch/test_torch_gpu.py tests/agent/test_agent_torch_gpu.py \
        tests/agent/test_agent_torchrun_gpu.py ;;
    torchrun) part torchrun "$PYTHON" -m pytest -q -rs -p no:cacheprovider \
        tests/agent/test_agent_torchrun_gpu.py ;;
    soak-start) part soak-start soak_start ;;
    soak-wait) part soak-wait soak_wait ;;
    overhead)
      part "overhead allocwatch" "$PYTHON" -m bench.sidecar.agent_overhead --blocks 80 --steps 50 \
        --allocator allocwatch --json "$OUT/overhead_allocwatch.json"
      part "overhead pytorch" "$PYTHON" -m bench.sidecar.agent_overhead --blocks 80 --steps 50 \
        --allocator pytorch --json "$OUT/overhead_pytorch.json" ;;
    hotpath) part hotpath "$PYTHON" -m bench.gpu.torch_bench hotpath --rounds 31 \
        --json "$OUT/hotpath.json" ;;
    corehotpath) part corehotpath bash bench/native/run_hotpath.sh --json "$OUT/hotpath_core.json" ;;
    train)
      part "train transformer" "$PYTHON" -m bench.gpu.torch_bench train --rounds 2 --steps 40 \
        --json "$OUT/train_transformer.json"
      part "train convnet" "$PYTHON" -m bench.gpu.torch_bench train --model convnet --rounds 2 \
        --steps 40 --json "$OUT/train_convnet.json" ;;
    lockstep)
      part "lockstep suite" "$PYTHON" -m bench.gpu.step_lockstep --suite "$OUT/lockstep" ;;
    patterns)
      local name mode=()
      [ "${PATTERN_MODE:-full}" = quick ] && mode=(--quick)
      [ -n "${PATTERN_OURS:-}" ] && mode+=(--ours "$PATTERN_OURS")
      # shellcheck disable=SC2206  # names, split on purpose
      [ -n "${PATTERN_ALSO:-}" ] && mode+=(--also $PATTERN_ALSO)
      for name in ${PATTERNS:-$("$PYTHON" -m bench.gpu.patterns names)}; do
        part "pattern $name" "$PYTHON" -m bench.gpu.patterns run "$OUT/patterns" --only "$name" \
          "${mode[@]}"
      done
      part "patterns table" "$PYTHON" -m bench.gpu.patterns table "$OUT/patterns" \
        --markdown "$OUT/patterns/patterns.md" --json "$OUT/patterns/patterns.json" ;;
    convnetprofile)
      part "convnet host profile, fresh shapes" "$PYTHON" -m bench.gpu.host_profile --model convnet \
        --ours allocwatch --against expandable --reps 2 --steps 12 --fresh \
        --json "$OUT/host_profile_convnet_fresh.json"
      part "convnet host profile, fresh shapes, expandable against itself" "$PYTHON" \
        -m bench.gpu.host_profile --model convnet --ours expandable --against expandable --reps 2 \
        --steps 12 --fresh --json "$OUT/host_profile_convnet_fresh_aa.json" ;;
    convnetbar)
      for cap in "" 1.03; do
        tag="${cap:+_cap${cap/./}}"
        part "convnet lockstep${cap:+ at ${cap}x}, allocwatch first" "$PYTHON" \
          -m bench.gpu.step_lockstep --model convnet --rounds 16 --steps 12 \
          ${cap:+--fraction-of-peak "$cap"} --json "$OUT/bar_convnet${tag}_allocwatch_first.json"
        part "convnet lockstep${cap:+ at ${cap}x}, expandable first" "$PYTHON" \
          -m bench.gpu.step_lockstep --model convnet --rounds 16 --steps 12 --ours expandable \
          --against allocwatch ${cap:+--fraction-of-peak "$cap"} \
          --json "$OUT/bar_convnet${tag}_expandable_first.json"
      done
      part "convnet step-time bar, pooled" "$PYTHON" -m bench.gpu.lockstep_pool \
        "$OUT"/bar_convnet*_first.json --json "$OUT/bar_convnet_pooled.json" ;;
    convnetsplit)
      local lockstep=(-m bench.gpu.step_lockstep --model convnet --rounds 16 --steps 12)
      part "convnet, our core under PyTorch's rules against PyTorch's allocator, ours first" \
        env ALLOCWATCH_ALLOC_CONF=native "$PYTHON" "${lockstep[@]}" --ours allocwatch \
        --against pytorch --json "$OUT/split_rules_allocwatch_first.json"
      part "convnet, the same, PyTorch's first" env ALLOCWATCH_ALLOC_CONF=native "$PYTHON" \
        "${lockstep[@]}" --ours pytorch --against allocwatch \
        --json "$OUT/split_rules_pytorch_first.json"
      part "convnet, the native back end against the pluggable path, native first" "$PYTHON" \
        "${lockstep[@]}" --ours allocwatch --against allocwatch-pluggable \
        --json "$OUT/split_backends_native_first.json"
      part "convnet, the same, pluggable first" "$PYTHON" "${lockstep[@]}" \
        --ours allocwatch-pluggable --against allocwatch \
        --json "$OUT/split_backends_pluggable_first.json"
      part "convnet, PyTorch's rules on both sides, pooled" "$PYTHON" -m bench.gpu.lockstep_pool \
        "$OUT"/split_rules_*_first.json --json "$OUT/split_rules_pooled.json"
      part "convnet, native against pluggable, pooled" "$PYTHON" -m bench.gpu.lockstep_pool \
        "$OUT"/split_backends_*_first.json --json "$OUT/split_backends_pooled.json" ;;
    convnetcontrols)
      local lockstep=(-m bench.gpu.step_lockstep --model convnet --rounds 16 --steps 12) pair
      for round in 1 2; do
        for pair in allocwatch:expandable expandable-loaded:expandable expandable:expandable \
                    allocwatch:allocwatch; do
          local a="${pair%%:*}" b="${pair##*:}"
          [ "$round" = 2 ] && { a="${pair##*:}"; b="${pair%%:*}"; }
          part "convnet, $a against $b" "$PYTHON" "${lockstep[@]}" --ours "$a" --against "$b" \
            --json "$OUT/control_${pair/:/_vs_}_$round.json"
        done
      done
      part "convnet, allocwatch against expandable, pooled" "$PYTHON" -m bench.gpu.lockstep_pool \
        "$OUT"/control_allocwatch_vs_expandable_*.json --json "$OUT/control_bar_pooled.json"
      part "convnet, the libraries loaded, pooled" "$PYTHON" -m bench.gpu.lockstep_pool \
        --judged expandable-loaded "$OUT"/control_expandable-loaded_vs_expandable_*.json \
        --json "$OUT/control_loaded_pooled.json" ;;
    convnetloaded)
      local lockstep=(-m bench.gpu.step_lockstep --model convnet --rounds 16 --steps 12)
      part "convnet, expandable-loaded against expandable" "$PYTHON" "${lockstep[@]}" \
        --ours expandable-loaded --against expandable --json "$OUT/loaded_1.json"
      part "convnet, expandable against expandable-loaded" "$PYTHON" "${lockstep[@]}" \
        --ours expandable --against expandable-loaded --json "$OUT/loaded_2.json"
      part "convnet, the libraries loaded, pooled" "$PYTHON" -m bench.gpu.lockstep_pool \
        --judged expandable-loaded "$OUT"/loaded_[12].json --json "$OUT/loaded_pooled.json" ;;
    probes)  # never a binary left from an earlier call: the run needs this build
      rm -rf build/native_probes
      part "build device_call_costs" bash bench/native/build_native.sh build/native_probes
      part probes build/native_probes/device_call_costs --quick --json "$OUT/device_costs_quick.json" ;;
    agentcpu)
      part "agentcpu pytorch" "$PYTHON" -m bench.sidecar.agent_cpu_cost --seconds 20 --source pytorch \
        --json "$OUT/agent_cpu_pytorch.json"
      part "agentcpu allocwatch" "$PYTHON" -m bench.sidecar.agent_cpu_cost --seconds 20 \
        --source allocwatch --json "$OUT/agent_cpu_allocwatch.json" ;;
    policy) part policy "$PYTHON" -m bench.gpu.policy_under_cap --fraction-of-peak "${POLICY_FRACTION:-1.03}" --steps 40 \
        --json "$OUT/policy.json" ;;
    native) part "native build" "$PYTHON" -m exporter.cli native build ;;
    distributed1) part "distributed, 1 GPU" env CUDA_VISIBLE_DEVICES=0 "$PYTHON" \
        -m bench.gpu.distributed_train --nproc 1 --steps 15 --warmup 2 --interval 0.5 \
        --out-dir /tmp/allocwatch-distributed1 --json "$OUT/distributed_1gpu.json" ;;
    distributed) part "distributed, every GPU" "$PYTHON" -m bench.gpu.distributed_train \
        --nproc "$(nvidia-smi -L | wc -l)" --repeats 2 --out-dir /tmp/allocwatch-distributed \
        --json "$OUT/distributed.json" ;;
    distributedhook) part "distributed, NCCL registration hook" "$PYTHON" \
        -m bench.gpu.distributed_train --nproc "$(nvidia-smi -L | wc -l)" \
        --allocators pytorch,allocwatch,allocwatch-plain --nccl-register-hook --out-dir /tmp/allocwatch-distributed-hook \
        --json "$OUT/distributed_nccl_hook.json" ;;
    distributedtests) part "distributed tests" "$PYTHON" -m pytest -q -rs -p no:cacheprovider \
        tests/distributed/test_distributed_gpu.py ;;
    *) echo "unknown part: $1 (the parts are listed at the top of bench/gpu/gpu_checks.sh)"
       part "unknown part $1" false ;;
  esac
}

main() {
  echo "gpu_checks: $(date -u +%FT%TZ) on $(hostname), source $("$PYTHON" -m bench.lib.source_tree 2>/dev/null)"
  nvidia-smi --query-gpu=index,name,driver_version,memory.used --format=csv,noheader
  for p in "$@"; do run_part "$p"; done
  echo; echo "=== summary ==="
  parts_summary
}

main "$@" 2>&1 | tee -a "$OUT/checks.log"
exit "${PIPESTATUS[0]}"
