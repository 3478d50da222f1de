# Sourced by every scripts/gpu_*.sh: `source "$(dirname "$0")/gpu_env.sh" NAME`.
# Runs from the repo root with the package importable, unbuffered Python, NVLink multicast off (the device
# machine's rule: it can take the host's shared GPUs out of service), and LOGS = $OUT or runs/NAME.
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
LOGS="${OUT:-runs/$1}"
mkdir -p "$LOGS"
