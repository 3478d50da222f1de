#!/usr/bin/env bash
# Session 12, call D: the zero-token fix under the 1-rank soak and the single-rank suites, then two more
# interleaved Megatron EP1 pairs (before = the session's starting main), then the trainer's loop/grouped A/B.
set -uo pipefail
source scripts/gpu_env.sh callD
git log --oneline -1 2>/dev/null || true
sha256sum moe_ep_plugin/lib/libmoe_ep_kernels.so
timeout 100 python3 benchmarks/soak.py --transport nvlink --device cuda:0 --ranks 1 --max-seconds 75 --seed 12101000 \
  > "$LOGS/soak_1.log" 2>&1 &
LIMIT=150 bash scripts/gpu_tests.sh nvlink_1 dropin_12 > "$LOGS/tests.out" 2>&1
wait
tail -n 12 "$LOGS/tests.out"; grep -c MISMATCH "$LOGS/soak_1.log"; tail -n 4 "$LOGS/soak_1.log"
mc() {  # tree label args...
  local tree=$1 label=$2; shift 2
  (cd $tree && PYTHONPATH="$PWD:/tmp/mcore" timeout 150 torchrun --nproc-per-node 1 benchmarks/mcore_dispatchers.py \
      --kinds ep_plugin:nvlink "$@" 2>&1 | grep -v -i warn) > "$LOGS/mcore_$label.log" 2>&1
}
for rep in 4 5; do
  mc .device/before before$rep --tokens 4096,128 --breakdown
  mc . after$rep --tokens 4096,128 --breakdown
done
for f in "$LOGS"/mcore_before*.log "$LOGS"/mcore_after*.log; do echo "== $f"; grep -h "RESULT\|PHASES" $f; done
PYTHONPATH=. timeout 170 python3 benchmarks/trainer_ab.py configs/ep2_h200.yaml parallel.nprocs=1 > "$LOGS/trainer_ab.log" 2>&1
grep -E "variant|^.{9}(loop|grouped) " "$LOGS/trainer_ab.log" | tail -4
