#!/usr/bin/env bash
# Issue 18's three tables in one device call on one H200 (EP1: the plugin's own costs): the DeepSpeed layer against
# stock DeepSpeed, the example trainer's loop against grouped experts, and the Megatron-Core dispatcher path
# (alltoall against ep_plugin:nvlink). With BEFORE=<folder> (a worktree of an earlier commit with its own kernel
# library built) the Megatron runs alternate between that tree and this one, one fresh process each, PAIRS times.
# Each part has its own time limit and log in $LOGS; the tables end the output. About 7 minutes.
#   usage: [BEFORE=.device/before] [PAIRS=3] bash scripts/gpu_user_paths.sh [PART ...]
# PART: deepspeed, trainer, megatron (default: all three). Carry moe_ep_plugin/lib, .whl (scripts/fetch_wheels.sh)
# and the BEFORE tree.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" gpu_user_paths
PAIRS=${PAIRS:-3}
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown); before: ${BEFORE:-none}; $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader

deepspeed_part() {
    (deepspeed_env && timeout 300 python3 benchmarks/deepspeed_compare.py --out "$LOGS/deepspeed_compare") 2>&1 \
        | grep -E -v "\[(INFO|WARNING)\]|Warning|warnings.warn" > "$LOGS/deepspeed.log"
    tail -n 12 "$LOGS/deepspeed.log"
}
trainer_part() {
    python3 -c "import yaml, tqdm" 2>/dev/null || python3 -m pip install -q --no-index --find-links .whl pyyaml tqdm
    timeout 300 python3 benchmarks/trainer_ab.py configs/ep2_h200.yaml parallel.nprocs=1 --out "$LOGS/trainer_ab" \
        > "$LOGS/trainer.log" 2>&1
    tail -n 12 "$LOGS/trainer.log"
}
mcore() {  # tree label: one fresh process of the Megatron harness in that tree
    (cd "$1" && PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout 150 torchrun --nproc-per-node 1 \
        benchmarks/mcore_dispatchers.py --kinds alltoall,ep_plugin:nvlink --tokens 4096,128 --breakdown 2>&1 \
        | grep -v -i warn) > "$LOGS/mcore_$2.log" 2>&1
    grep -h "RESULT" "$LOGS/mcore_$2.log" | sed "s/^/$2 /"
}
megatron_part() {
    for pair in $(seq 1 "$PAIRS"); do
        [ -z "${BEFORE:-}" ] || mcore "$BEFORE" "before$pair"
        mcore . "after$pair"
    done
}

parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(deepspeed trainer megatron)
for name in "${parts[@]}"; do
    echo "=== $name: start $(date -u +%T)"
    case "$name" in
        deepspeed) deepspeed_part ;;
        trainer) trainer_part ;;
        megatron) megatron_part ;;
        *) echo "unknown part $name" ;;
    esac
    echo "=== $name: end $(date -u +%T)"
done
