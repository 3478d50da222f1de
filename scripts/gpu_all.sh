#!/usr/bin/env bash
# Every GPU proof in one device call (2 x H200): Megatron-Core integration, example trainer, DeepSpeed integration,
# then the kernel tests and benchmark. Each part runs under its own time limit, so one stuck part cannot take the
# others with it; each part's files are packed into $OUT/<part>.tar.gz as soon as it ends (the device tool returns
# at most 8 files), and its console output is echoed here.
# Carry: moe_ep_plugin/lib (kernel library built here) and .whl (megatron-core, deepspeed and their missing deps).
#   usage: bash scripts/gpu_all.sh [PART ...] 2>&1 | tee $OUT/all.log
# PART: kernels, megatron_bench (the dispatcher benchmark alone), megatron (layer test, benchmark, pretraining),
# megatron_rest (layer test and pretraining), train, deepspeed, trace (host/GPU timelines of the 128-token Megatron
# forward and of a fresh expert-major dispatch); default: megatron train deepspeed kernels.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" gpu_all
RESULTS="$LOGS"
WORK="$(mktemp -d)"
mkdir -p "$RESULTS"
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown); $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())"

part() {  # part NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    mkdir -p "$WORK/$name"
    echo "=== $name: start $(date -u +%T), limit ${limit}s: $*"
    OUT="$WORK/$name" timeout -k 5 "$limit" "$@" > "$WORK/$name/console.log" 2>&1
    local rc=$?
    echo "=== $name: exit $rc at $(date -u +%T)"
    grep -v -i -E "warn|^\s*$" "$WORK/$name/console.log" | tail -n 60
    tar czf "$RESULTS/$name.tar.gz" -C "$WORK" "$name"
}

parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(megatron train deepspeed kernels)
for name in "${parts[@]}"; do
    case "$name" in
        kernels) part kernels 420 bash scripts/gpu_kernels.sh ;;
        megatron) part megatron 420 bash scripts/gpu_megatron.sh ;;
        megatron_bench) MEGATRON_STEPS=bench part megatron_bench 200 bash scripts/gpu_megatron.sh ;;
        megatron_rest) MEGATRON_STEPS="test pretrain" part megatron_rest 260 bash scripts/gpu_megatron.sh ;;
        train) part train 110 bash scripts/gpu_train.sh --set train.steps=60 ;;
        deepspeed) part deepspeed 150 bash scripts/gpu_deepspeed.sh ;;
        trace) part trace 150 bash scripts/gpu_trace.sh ;;
        *) echo "unknown part $name" ;;
    esac
done
