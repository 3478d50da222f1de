#!/usr/bin/env bash
# The specialised dispatch build's EP2 fault (docs/open_work.md, item 1) in one device call, one step after the
# other (never side by side: two ranks share the one GPU, without MPS as the failing call F ran them), each step
# `tests/gpu/test_dropin_matrix.py::test_dropin_matrix[2]` with every round named before it runs
# (MOE_EP_MATRIX_TRACE), so each log says which call faulted:
#   default  the default build (moe_ep_plugin/lib): never run at EP2 without MPS, nor at all since the fused merge
#   spec     the specialised build ($SPEC_LIB): call F again
#   blocking spec with CUDA_LAUNCH_BLOCKING=1: the Python line of the faulting launch (dispatch, permute, combine)
#   eager    spec with CUDA_MODULE_LOADING=EAGER: no kernel loaded lazily mid-protocol (round 5 is the first launch
#            of dispatch_kernel<0, 0, kExpertTopk, 1, 0>; the default build launches no new dispatch kernel there)
#   memcheck spec under compute-sanitizer memcheck: the faulting kernel, its source line (-lineinfo) and address
# usage: SPEC_LIB=.device/spec/libmoe_ep_kernels.so bash scripts/gpu_specfix.sh [STEP ...]   (default: all five)
# Needs both libraries built on the CPU machine and carried (see docs/open_work.md for the run command).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" gpu_specfix
SPEC_LIB=${SPEC_LIB:-.device/spec/libmoe_ep_kernels.so}
TEST="tests/gpu/test_dropin_matrix.py::test_dropin_matrix[2]"
SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)
export MOE_EP_MATRIX_TRACE=1

limit() {  # seconds per step (the five defaults sum to 530 s, inside one 600 s call)
    case "$1" in default) echo 150 ;; memcheck) echo 200 ;; *) echo 60 ;; esac
}

run_step() {
    local name=$1 lib=$PWD/$SPEC_LIB
    local -a vars=() pre=()
    case "$name" in
        default) lib=$PWD/moe_ep_plugin/lib/libmoe_ep_kernels.so ;;
        spec) ;;
        blocking) vars=(CUDA_LAUNCH_BLOCKING=1) ;;
        eager) vars=(CUDA_MODULE_LOADING=EAGER) ;;
        memcheck)
            [ -n "$SANITIZER" ] || { echo "memcheck: no compute-sanitizer" | tee "$LOGS/specfix_memcheck.log"; return; }
            pre=("$SANITIZER" --tool memcheck --target-processes all --print-limit 20) ;;
        *) echo "unknown step $name" >&2; return ;;
    esac
    [ -f "$lib" ] || { echo "$name: no library at $lib" | tee "$LOGS/specfix_$name.log"; return; }
    local start=$SECONDS
    env MOE_EP_KERNEL_LIB="$lib" "${vars[@]}" timeout -k 10 "$(limit "$name")" "${pre[@]}" \
        python3 -m pytest -q -s -x "$TEST" > "$LOGS/specfix_$name.log" 2>&1
    local rc=$?
    # the last round each rank named before the end, and the first error line
    echo "$name: exit $rc after $((SECONDS - start))s; last rounds: $(grep -o '\[rank [0-9]*\] round [0-9]*' \
        "$LOGS/specfix_$name.log" | tail -n 2 | tr '\n' ' ')" | tee -a "$LOGS/specfix_summary.txt"
    grep -m 3 -E 'Invalid __global__|illegal memory access|Error|FAILED|passed|failed' "$LOGS/specfix_$name.log" || true
}

steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(default spec blocking eager memcheck)
for step in "${steps[@]}"; do run_step "$step"; done
