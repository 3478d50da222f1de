#!/usr/bin/env bash
# Session 11, call D: faults group (all of it); Megatron EP1 A/B interleaved (before = c7eca88, after = main).
set -uo pipefail
source scripts/gpu_env.sh callD
LIMIT=240 bash scripts/gpu_tests.sh faults > "$LOGS/tests_faults.out" 2>&1
grep -E "passed|failed|^E  .*rank" "$LOGS/tests_faults.log" | tail -6
grep -h "moe_ep_plugin: rank" "$LOGS"/tests_faults.log | sort | uniq -c
OMP_NUM_THREADS=1 python3 benchmarks/soak.py --transport nvlink --device cuda:0 --ranks 1 --rounds 1000000 --seed 11004000 \
    --max-seconds 40 > "$LOGS/soak_1.log" 2>&1 &
timeout 120 python3 -m pytest -q -s -rs -x tests/gpu/test_nvlink.py::test_nvlink_single_rank_matches_torch_transport \
    > "$LOGS/ep1_tests.log" 2>&1
wait
grep -E "passed|failed" "$LOGS/ep1_tests.log" | tail -2; grep -h "^| nvlink" "$LOGS/soak_1.log"
mc() {
  local tree=$1 label=$2; shift 2
  (cd $tree && PYTHONPATH="$PWD:/tmp/mcore" timeout 100 torchrun --nproc-per-node 1 benchmarks/mcore_dispatchers.py \
      --kinds ep_plugin:nvlink "$@" 2>&1 | grep -v -i warn) > "$LOGS/mcore_$label.log" 2>&1
  grep -h "RESULT\|PHASES" "$LOGS/mcore_$label.log" | sed "s/^/$label /"
}
for rep in 1 2; do
  mc .device/before before$rep --tokens 4096,128 --breakdown
  mc . after$rep --tokens 4096,128 --breakdown
done
