"""What the multi-rank GPU suites need, as skip marks that name what is missing: a CUDA GPU, then the kernel
library (built and of this ABI). ``GPUS``: CUDA devices of this machine (0 without CUDA)."""

import pytest
import torch

from moe_ep_plugin.ops import library

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
NEEDS_KERNELS = [
    pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        GPUS >= 1 and library.unavailable_reason() is not None,
        reason=f"kernel library unavailable: {library.unavailable_reason()}",
    ),
]
