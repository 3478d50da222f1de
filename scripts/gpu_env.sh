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
