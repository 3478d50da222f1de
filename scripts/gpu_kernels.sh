#!/usr/bin/env bash
# GPU proof of the kernels (issue 4), for the 2 x H200 device machine: library check, GPU tests against the torch
# transport and the torch permute fallback, then the dispatch/combine and permute benchmarks, and a quick kernel
# timing of every variant library in moe_ep_plugin/lib/variants/*.so (built here with MOE_EP_NVCC_FLAGS, e.g.
# -DMOE_EP_CHUNK_ROWS=16, and `python3 -m moe_ep_plugin._build --required --output moe_ep_plugin/lib/variants/X.so`).
# Logs go to $OUT (device tool) or runs/gpu_kernels/. Needs moe_ep_plugin/lib/libmoe_ep_kernels.so (built here
# with `python3 -m moe_ep_plugin._build --required`; carry it, or it is built on the spot when nvcc exists).
# Takes about 5 minutes on 2 GPUs. On one GPU, tests/gpu runs its multi-rank suite with 2, 3 and 4 ranks sharing the
# GPU against a CPU reference: about 3 minutes per rank count (EP2 178 s, EP4 190 s in the fifth session), more than
# GPU_TESTS_LIMIT (default 240 s) allows for all three; split them over calls with pytest -k ("2-gloo", "3-gloo",
# "4-gloo", "not gloo").
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" gpu_kernels
status=0
nvidia-smi --query-gpu=index,name,memory.total,clocks.sm --format=csv | tee "$LOGS/gpu.txt"
if ! python3 -c "from moe_ep_plugin.ops import library; assert library.unavailable_reason() is None, library.unavailable_reason()"; then
    python3 -m moe_ep_plugin._build --required 2>&1 | tail -n 3 || exit 1
fi
python3 -c "from moe_ep_plugin.ops import library; r = library.unavailable_reason(); print('kernel library:', r or 'loads'); assert r is None" || exit 1
mps_on  # one GPU: tests/gpu runs 2-4 ranks on it
timeout "${GPU_TESTS_LIMIT:-240}" python3 -m pytest -q -s -rs --durations=5 tests/gpu 2>&1 | tee "$LOGS/gpu_tests.log" || status=1
mps_off
timeout 200 python3 benchmarks/bench_dispatch_combine.py --json "$LOGS/bench.json" "$@" 2>&1 | tee "$LOGS/bench.log" || status=1
timeout 60 python3 benchmarks/bench_permute.py 2>&1 | tee "$LOGS/bench_permute.log" || status=1
for lib in moe_ep_plugin/lib/variants/*.so; do
    [ -e "$lib" ] || continue
    echo "=== variant $(basename "$lib" .so)" | tee -a "$LOGS/variants.log"
    MOE_EP_KERNEL_LIB="$lib" timeout 90 python3 benchmarks/bench_dispatch_combine.py --quick --sweep "" \
        --variants "24 12" 2>&1 | tail -n 40 | tee -a "$LOGS/variants.log" || status=1
done
exit $status
