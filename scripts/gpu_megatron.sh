#!/usr/bin/env bash
# Megatron-Core integration on the 2 x H200 device machine (issue 5), about 2-3 minutes:
#   0. tests/test_megatron_layer.py on the GPUs: Megatron's MoELayer with ep_plugin (transport auto, with and without
#      shared-expert overlap) and flex+deepep served by the plugin, against a plain-loop reference.
#   1. benchmarks/mcore_dispatchers.py at EP2, hidden 7168, top-8 of 256, 4096 and 128 tokens per rank, forward and
#      forward+backward: Megatron's alltoall vs ep_plugin on the torch (NCCL) and nvlink transports (BF16 and FP8
#      dispatch) and flex+deepep served by the plugin; prints a table (benchmarks/RESULTS.md takes it).
#   2. moe-ep-pretrain configs/megatron_dsv3_ep2.yaml: 100 steps of the DeepSeek-V3-style model, loss logged.
# Run it after scripts/gpu_kernels.sh, which builds moe_ep_plugin/lib/libmoe_ep_kernels.so (without the library
# the ep_plugin:nvlink rows report FAILED and transport "auto" falls back to torch).
#
# The device machine has no megatron-core: `bash scripts/fetch_wheels.sh` here puts its wheel (and the others the
# GPU scripts install) into .whl; name .whl in the run's carry. scripts/gpu_env.sh installs that wheel into /tmp/mcore
# when megatron.core is missing.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" gpu_megatron
LOG="$LOGS/megatron_gpu.log"  # one file: the device tool returns at most 8 files for all scripts together
status=0
python3 -W ignore -c "import megatron.core, moe_ep_plugin.megatron; print('megatron-core', megatron.core.__version__)" \
    2>&1 | tee "$LOG" || exit 1
# Which steps run: MEGATRON_STEPS (default all three), so one device call can take the benchmark alone.
steps="${MEGATRON_STEPS:-test bench pretrain}"
if [[ " $steps " == *" test "* ]]; then
    timeout 100 python3 -m pytest -q -rs tests/test_megatron_layer.py -k gpus 2>&1 | tail -n 30 | tee -a "$LOG" || status=1
fi
if [[ " $steps " == *" bench "* ]]; then
    timeout 170 torchrun --nproc-per-node "$GPUS" benchmarks/mcore_dispatchers.py --tokens 4096,128 --breakdown 2>&1 \
        | grep -v -i warn | tee -a "$LOG" || status=1
fi
if [[ " $steps " == *" pretrain "* ]]; then
    rm -rf /tmp/megatron_dsv3_ep2  # a fresh run, not a resume of an earlier one on a warm machine
    timeout 150 python3 -m moe_ep_plugin.megatron.pretrain configs/megatron_dsv3_ep2.yaml --save-dir /tmp/megatron_dsv3_ep2 \
        2>&1 | grep -v -i warn | tee -a "$LOG" || status=1
fi
exit $status
