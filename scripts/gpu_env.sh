# Sourced by every scripts/gpu_*.sh: `source "$(dirname "$0")/gpu_env.sh" NAME`.
# Runs from the repo root with the package importable, unbuffered Python, NVLink multicast off (the device
# machine's rule: it can take the host's shared GPUs out of service), and LOGS = $OUT or runs/NAME.
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
LOGS="${OUT:-runs/$1}"
mkdir -p "$LOGS"
# Ranks of the multi-GPU runs: one per GPU (EP1 on a one-GPU machine).
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
[ "$GPUS" -ge 1 ] || GPUS=1
# megatron-core (the device machine has none): the carried wheel, installed once per machine into /tmp/mcore.
if ! python3 -c "import megatron.core" 2>/dev/null; then
    wheel=$(ls .whl/megatron_core-*.whl 2>/dev/null | head -n 1)
    if [ -n "$wheel" ] && { [ -d /tmp/mcore/megatron ] || \
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/mcore "$wheel"; }; then
        export PYTHONPATH="$PYTHONPATH:/tmp/mcore"
    fi
fi
# mps_on / mps_off: with one GPU, an MPS daemon lets the kernels of several ranks sharing it run side by side (they
# wait on each other) instead of taking turns; without it (none there, or it fails to serve) they only run slower.
mps_on() {
    MPS=0
    [ "$GPUS" -eq 1 ] && command -v nvidia-cuda-mps-control >/dev/null && nvidia-cuda-mps-control -d || return 0
    if timeout 60 python3 -c "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()"; then
        MPS=1; echo "MPS on"
    else
        echo quit | nvidia-cuda-mps-control; echo "MPS did not serve: off"
    fi
}
mps_off() {
    if [ "${MPS:-0}" -eq 1 ]; then echo quit | nvidia-cuda-mps-control; sleep 1; MPS=0; fi
}
# deepspeed_env: DeepSpeed 0.19.8 and what the GPU image lacks for it (pydantic + pydantic-core cp312, annotated-types,
# typing-inspection, hjson, typing-extensions >= 4.14.1 for pydantic) from the carried .whl/ (scripts/fetch_wheels.sh)
# into /tmp/site, on PYTHONPATH; nothing is fetched and no DeepSpeed op is compiled (DS_BUILD_OPS=0).
deepspeed_env() {
    python3 -m pip install -q --no-index --no-deps --target /tmp/site \
      .whl/deepspeed-0.19.8-py3-none-any.whl .whl/pydantic-2.13.4-py3-none-any.whl \
      .whl/pydantic_core-2.46.4-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl \
      .whl/annotated_types-0.7.0-py3-none-any.whl .whl/typing_inspection-0.4.2-py3-none-any.whl \
      .whl/hjson-3.1.0-py3-none-any.whl .whl/typing_extensions-4.15.0-py3-none-any.whl || return 1
    export PYTHONPATH="/tmp/site:$PYTHONPATH" DS_BUILD_OPS=0
    python3 -c "import deepspeed, torch; print('deepspeed', deepspeed.__version__, 'torch', torch.__version__, \
'accelerator', deepspeed.get_accelerator().device_name())"
}
