#!/usr/bin/env bash
# Session 12, call E: two more interleaved Megatron EP1 pairs of the final code (before = the session's starting
# main), then a 1-rank soak of the EP1 layout path.
set -uo pipefail
source scripts/gpu_env.sh callE
mc() {  # tree label args...
  local tree=$1 label=$2; shift 2
  (cd $tree && PYTHONPATH="$PWD:/tmp/mcore" timeout 120 torchrun --nproc-per-node 1 benchmarks/mcore_dispatchers.py \
      --kinds ep_plugin:nvlink "$@" 2>&1 | grep -v -i warn) > "$LOGS/mcore_$label.log" 2>&1
}
for rep in 6 7; do
  mc .device/before before$rep --tokens 4096,128 --breakdown
  mc . after$rep --tokens 4096,128 --breakdown
done
for f in "$LOGS"/mcore_before*.log "$LOGS"/mcore_after*.log; do echo "== $f"; grep -h "RESULT" $f; done
timeout 75 python3 benchmarks/soak.py --transport nvlink --device cuda:0 --ranks 1 --max-seconds 60 --seed 12201000 \
  > "$LOGS/soak_1.log" 2>&1
grep -c MISMATCH "$LOGS/soak_1.log"; grep "| nvlink" "$LOGS/soak_1.log"
