#!/usr/bin/env bash
# DeepSpeed integration on 2 GPUs (nvidia-h200-x2), run from the repo root; needs .whl/ carried (git-ignored).
# 1. installs DeepSpeed 0.19.8 and what the GPU image lacks from .whl/ (gpu_env.sh's deepspeed_env);
# 2. trains the example at EP 2 with stock DeepSpeed MoE, then with the plugin (same weights and data), and prints
#    the step-time table; 3. the plugin again with FP8 dispatch; 4. benchmarks/deepspeed_compare.py at EP1 (stock,
#    plugin loop, plugin grouped, profiled). A few minutes in all.
set -euo pipefail
source "$(dirname "$0")/gpu_env.sh" gpu_deepspeed
deepspeed_env
# $1: output file, then the example's arguments; returns the example's exit status (the script goes on)
run() {
  local out="$1"; shift
  set +e
  timeout 150 python3 examples/deepspeed_moe.py "$@" 2>&1 | grep -E -v "\[(INFO|WARNING)\]|Warning|warnings.warn" \
    | tee "$LOGS/$out"
  local rc=${PIPESTATUS[0]}
  set -e
  [ "$rc" -eq 0 ] || echo "FAILED (exit $rc): examples/deepspeed_moe.py $*"
  return "$rc"
}
# transport auto = the NVLink kernels when built and usable, else torch (NCCL all_to_all_single); if the auto
# run fails, the torch transport is measured instead so the table still comes back
run deepspeed_compare.txt --config configs/deepspeed_moe_gpu.yaml --compare \
  || run deepspeed_compare_torch.txt --config configs/deepspeed_moe_gpu.yaml --compare moe.transport=torch || true
run deepspeed_plugin_fp8.txt --config configs/deepspeed_moe_gpu.yaml moe.fp8_dispatch=true || true
# EP1 on one GPU: stock against the plugin with the expert loop and with grouped GEMMs in one run, then profiled
# (traces, top ops, layer-part host times, host syncs by line) into $LOGS/deepspeed_compare/
timeout 300 python3 benchmarks/deepspeed_compare.py --profile --out "$LOGS/deepspeed_compare" 2>&1 \
  | grep -E -v "\[(INFO|WARNING)\]|Warning|warnings.warn" | tee "$LOGS/deepspeed_compare_ep1.txt" \
  || echo "FAILED: benchmarks/deepspeed_compare.py"
