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
