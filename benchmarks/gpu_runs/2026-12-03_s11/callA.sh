#!/usr/bin/env bash
# Session 11, call A: the faults group (trap on kernel errors; no MPS), the single-rank nvlink suite, then a 4-rank soak.
set -uo pipefail
source scripts/gpu_env.sh callA
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
git log --oneline -1 2>/dev/null || true
sha256sum moe_ep_plugin/lib/libmoe_ep_kernels.so
LIMIT=240 bash scripts/gpu_tests.sh faults nvlink_1 > "$LOGS/tests.out" 2>&1
tail -n 40 "$LOGS/tests.out"
SECONDS_EACH=${SOAK_S:-330} bash scripts/gpu_soak.sh 4 > "$LOGS/soak.out" 2>&1
tail -n 12 "$LOGS/soak.out"
