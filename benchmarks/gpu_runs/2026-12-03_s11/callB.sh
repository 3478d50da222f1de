#!/usr/bin/env bash
# Session 11, call B: faults group (recorded error checked before any CUDA work); EP1 bypass correctness (single-rank
# nvlink suite, dropin matrix at EP1, a 1-rank soak) beside a 2-rank soak; Megatron EP1 before (c7eca88) / after.
set -uo pipefail
source scripts/gpu_env.sh callB
sha256sum moe_ep_plugin/lib/libmoe_ep_kernels.so
LIMIT=300 bash scripts/gpu_tests.sh faults > "$LOGS/tests_faults.out" 2>&1
tail -n 12 "$LOGS/tests_faults.out"
grep -h "moe_ep_plugin: rank" "$LOGS"/tests_faults.log | sort | uniq -c
export OMP_NUM_THREADS=1
python3 benchmarks/soak.py --transport nvlink --device cuda:0 --ranks 2 --rounds 1000000 --seed 11002000 --max-seconds 90 > "$LOGS/soak_2.log" 2>&1 &
python3 benchmarks/soak.py --transport nvlink --device cuda:0 --ranks 1 --rounds 1000000 --seed 11001000 --max-seconds 90 > "$LOGS/soak_1.log" 2>&1 &
timeout 200 python3 -m pytest -q -s -rs -x tests/gpu/test_nvlink.py::test_nvlink_single_rank_matches_torch_transport "tests/gpu/test_dropin_matrix.py::test_dropin_matrix[1]" > "$LOGS/ep1_tests.log" 2>&1 || true
wait
grep -E "passed|failed|rror" "$LOGS/ep1_tests.log" | tail -5
tail -n 1 "$LOGS"/soak_1.log "$LOGS"/soak_2.log
unset OMP_NUM_THREADS
for tree in .device/before .; do
  echo "=== megatron $tree"
  (cd $tree && PYTHONPATH="$PWD:/tmp/mcore" timeout 150 torchrun --nproc-per-node 1 benchmarks/mcore_dispatchers.py --tokens 4096,128 --breakdown \
      --kinds alltoall,ep_plugin:nvlink 2>&1 | grep -v -i warn) > "$LOGS/mcore_$(basename $tree).log" 2>&1
  tail -n 25 "$LOGS/mcore_$(basename $tree).log"
done
