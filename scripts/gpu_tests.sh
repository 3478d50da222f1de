#!/usr/bin/env bash
# tests/gpu on the device machine in one call: the files (and, on one GPU, each shared-GPU rank count) run side by
# side as separate pytest processes under an MPS daemon, each under its own time limit, so a stuck group cannot
# take the others with it. The `faults` group (absent and late peers, disagreeing ranks) runs after them without
# MPS: its kernels trap, and under MPS a trap ends every client of the GPU. Each group's log is
# $LOGS/tests_<group>.log; a summary line per group ends the output.
#   usage: bash scripts/gpu_tests.sh [GROUP ...]      (default: every group; LIMIT=seconds per group, default 420)
# Needs moe_ep_plugin/lib (built on the CPU machine and carried) and, for the routing test, .whl (megatron-core).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" gpu_tests
LIMIT=${LIMIT:-420}
ALL=(nvlink_1 nvlink_2 nvlink_3 nvlink_4 dropin_12 dropin_3 dropin_4 lowlat hier ops faults)

group_args() {  # the pytest arguments of one group
    local m=tests/gpu/test_dropin_matrix.py
    case "$1" in
        nvlink_1) echo tests/gpu/test_nvlink.py -k "'not gloo and not peer'" ;;
        nvlink_[234]) echo tests/gpu/test_nvlink.py -k "${1#nvlink_}-gloo" ;;  # its three parts (-k "2-gloo-row_major": one)
        dropin_12) echo "$m::test_dropin_matrix[1] $m::test_dropin_matrix[2] $m::test_async_counts_at_deepep_shape" ;;
        dropin_[34]) echo "$m::test_dropin_matrix[${1#dropin_}]" ;;
        lowlat) echo tests/gpu/test_low_latency_gpu.py -k "'not peer'" ;;
        hier) echo tests/gpu/test_hierarchical_gpu.py ;;
        ops) echo tests/gpu/test_permute_gpu.py tests/gpu/test_routing_gpu.py tests/gpu/test_experts_gpu.py ;;
        faults) echo tests/gpu/test_nvlink.py tests/gpu/test_low_latency_gpu.py tests/gpu/test_dropin_matrix.py \
                     -k "'peer or disagreeing'" ;;
        *) echo "unknown group $1" >&2; return 1 ;;
    esac
}

names=("$@")
[ ${#names[@]} -gt 0 ] || names=("${ALL[@]}")
python3 -c "from moe_ep_plugin.ops import library; r = library.unavailable_reason(); print('kernel library:', r or 'loads'); assert r is None" || exit 1
run_group() {
    local args
    args=$(group_args "$1") || return 0
    eval timeout -k 10 "$LIMIT" python3 -m pytest -q -s -rs -x --durations=3 $args > "$LOGS/tests_$1.log" 2>&1
    echo "$1: exit $? after ${SECONDS}s" >> "$LOGS/tests_summary.txt"
}
mps_on
pids=()
for name in "${names[@]}"; do
    [ "$name" = faults ] || { run_group "$name" & pids+=($!); }
done
wait "${pids[@]}"
mps_off
for name in "${names[@]}"; do
    [ "$name" != faults ] || run_group faults
done
for name in "${names[@]}"; do
    echo "=== $name"; grep -E "passed|failed|rror|SKIPPED|Timeout|MISMATCH|assert" "$LOGS/tests_$name.log" | tail -n 15
done
echo "=== summary"; cat "$LOGS/tests_summary.txt"
