#!/usr/bin/env bash
# Session 11, call C: faults group (late peer on num_worst_tokens; CUDA errors mapped to recorded ones); Megatron EP1
# A/B interleaved (before = c7eca88, after = main), then one traced forward of each at 4096 and 128 tokens.
set -uo pipefail
source scripts/gpu_env.sh callC
LIMIT=300 bash scripts/gpu_tests.sh faults > "$LOGS/tests_faults.out" 2>&1
grep -E "passed|failed" "$LOGS/tests_faults.log" | tail -3; cat "$LOGS/tests_summary.txt"
grep -h "moe_ep_plugin: rank" "$LOGS"/tests_faults.log | sort | uniq -c
mc() {  # tree label args...
  local tree=$1 label=$2; shift 2
  (cd $tree && PYTHONPATH="$PWD:/tmp/mcore" timeout 120 torchrun --nproc-per-node 1 benchmarks/mcore_dispatchers.py \
      --kinds ep_plugin:nvlink "$@" 2>&1 | grep -v -i warn) > "$LOGS/mcore_$label.log" 2>&1
}
for rep in 1 2; do
  mc .device/before before$rep --tokens 4096,128 --breakdown
  mc . after$rep --tokens 4096,128 --breakdown
done
grep -h "RESULT\|PHASES" "$LOGS"/mcore_before*.log "$LOGS"/mcore_after*.log
mc .device/before trace_before --tokens 4096,128 --trace --iters 5
mc . trace_after --tokens 4096,128 --trace --iters 5
