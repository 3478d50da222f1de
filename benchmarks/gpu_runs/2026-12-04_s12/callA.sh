#!/usr/bin/env bash
# Session 12, call A: the EP1 layout kernel (moe_ep_local_layout) and the permute launched before the count read.
# Tests first (single-rank nvlink suite, permute/routing/expert ops), then the Megatron EP1 A/B interleaved
# (before = .device/before, the previous main), then one traced forward of main.
set -uo pipefail
source scripts/gpu_env.sh callA
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
sha256sum moe_ep_plugin/lib/libmoe_ep_kernels.so .device/before/moe_ep_plugin/lib/libmoe_ep_kernels.so
LIMIT=240 bash scripts/gpu_tests.sh nvlink_1 ops > "$LOGS/tests.out" 2>&1
tail -n 30 "$LOGS/tests.out"
mc() {  # tree label args...
  local tree=$1 label=$2; shift 2
  (cd $tree && PYTHONPATH="$PWD:/tmp/mcore" timeout 150 torchrun --nproc-per-node 1 benchmarks/mcore_dispatchers.py \
      --kinds ep_plugin:nvlink "$@" 2>&1 | grep -v -i warn) > "$LOGS/mcore_$label.log" 2>&1
}
for rep in 1 2; do
  mc .device/before before$rep --tokens 4096,128 --breakdown
  mc . after$rep --tokens 4096,128 --breakdown
done
grep -h "RESULT\|PHASES" "$LOGS"/mcore_before*.log "$LOGS"/mcore_after*.log
mc . trace_after --tokens 4096,128 --trace --iters 5
grep -v "^PROFILE" "$LOGS/mcore_trace_after.log" | grep "TRACE\|RESULT" | head -80
