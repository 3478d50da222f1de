#!/usr/bin/env bash
# Session 12, call B: streaming stores in permute/unpermute (.device/stcs) against main, kernels alone
# (bench_permute) and in the Megatron EP1 path, with the previous main (.device/before) interleaved; main's read now
# waits for the layout only (moe_ep_read_mark), so the permute is launched first.
set -uo pipefail
source scripts/gpu_env.sh callB
sha256sum moe_ep_plugin/lib/libmoe_ep_kernels.so .device/*/moe_ep_plugin/lib/libmoe_ep_kernels.so
for tree in . .device/stcs; do
  (cd $tree && PYTHONPATH=$PWD timeout 120 python3 benchmarks/bench_permute.py 2>&1 | grep -v -i warn) > "$LOGS/permute_$(basename $tree).log"
done
head -40 "$LOGS"/permute_*.log
mc() {  # tree label args...
  local tree=$1 label=$2; shift 2
  (cd $tree && PYTHONPATH="$PWD:/tmp/mcore" timeout 150 torchrun --nproc-per-node 1 benchmarks/mcore_dispatchers.py \
      --kinds ep_plugin:nvlink "$@" 2>&1 | grep -v -i warn) > "$LOGS/mcore_$label.log" 2>&1
}
for rep in 1 2; do
  mc .device/before before$rep --tokens 4096,128 --breakdown
  mc . after$rep --tokens 4096,128 --breakdown
  mc .device/stcs stcs$rep --tokens 4096,128 --breakdown
done
for f in "$LOGS"/mcore_*.log; do echo "== $f"; grep -h "RESULT\|PHASES" $f; done
