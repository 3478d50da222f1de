#!/usr/bin/env bash
# Host/GPU timelines on the 2 x H200 device machine, about 1 minute: one 128-token Megatron-Core forward through
# ep_plugin:nvlink (each method's host span and every GPU activity: where the host, not the GPU, sets the pace), and
# one fresh expert-major dispatch + combine at 128 and 4096 tokens (GPU activities and the dispatch call's host time).
# Needs moe_ep_plugin/lib/libmoe_ep_kernels.so and the megatron-core wheel in .whl (see scripts/gpu_megatron.sh).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" gpu_trace
status=0
timeout 90 torchrun --nproc-per-node "$GPUS" benchmarks/mcore_dispatchers.py --tokens 128 --kinds ep_plugin:nvlink --trace \
    2>&1 | grep -v -i warn | tee "$LOGS/megatron_trace.log" || status=1
for tokens in 128 4096; do
    timeout 60 torchrun --nproc-per-node "$GPUS" benchmarks/trace_dispatch.py --op experts --tokens "$tokens" 2>&1 \
        | grep -v -i warn | tee -a "$LOGS/dispatch_trace.log" || status=1
done
exit $status
