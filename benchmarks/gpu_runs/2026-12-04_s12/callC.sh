#!/usr/bin/env bash
# Session 12, call C: the Megatron EP1 A/B (before = .device/before, the session's starting main; after = main with
# the layout kernel, the early permute and one autograd node from the routing map), a discarded warm-up run first,
# then three interleaved pairs; then the GPU tests on main (single-rank nvlink suite, drop-in matrix at EP1/EP2,
# ops, the faults group) and a 1-rank soak.
set -uo pipefail
source scripts/gpu_env.sh callC
sha256sum moe_ep_plugin/lib/libmoe_ep_kernels.so .device/before/moe_ep_plugin/lib/libmoe_ep_kernels.so
mc() {  # tree label args...
  local tree=$1 label=$2; shift 2
  (cd $tree && PYTHONPATH="$PWD:/tmp/mcore" timeout 150 torchrun --nproc-per-node 1 benchmarks/mcore_dispatchers.py \
      --kinds ep_plugin:nvlink "$@" 2>&1 | grep -v -i warn) > "$LOGS/mcore_$label.log" 2>&1
}
mc . warmup --tokens 4096,128 --iters 10
for rep in 1 2 3; do
  mc .device/before before$rep --tokens 4096,128 --breakdown
  mc . after$rep --tokens 4096,128 --breakdown
done
for f in "$LOGS"/mcore_before*.log "$LOGS"/mcore_after*.log; do echo "== $f"; grep -h "RESULT\|PHASES" $f; done
LIMIT=150 bash scripts/gpu_tests.sh nvlink_1 dropin_12 ops faults > "$LOGS/tests.out" 2>&1
tail -n 45 "$LOGS/tests.out"
timeout 70 python3 benchmarks/soak.py --transport nvlink --device cuda:0 --ranks 1 --max-seconds 45 --seed 12001000 \
  > "$LOGS/soak_1.log" 2>&1
tail -n 5 "$LOGS/soak_1.log"
