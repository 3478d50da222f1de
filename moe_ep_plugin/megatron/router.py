"""``PortableTopKRouter``: Megatron-Core's ``TopKRouter``, also on machines without CUDA.

``TopKRouter`` places its expert-bias buffers and moves its weights to ``torch.cuda.current_device()``
unconditionally. Where CUDA is not available, this subclass runs the unchanged Megatron code with
``torch.cuda.current_device`` answering ``cpu`` for the duration of its own ``__init__`` and ``forward``, so the
routing math (group-limited sigmoid, expert bias, aux losses) is Megatron's own on CPU too. With CUDA it is
exactly ``TopKRouter``.
"""

from __future__ import annotations

from typing import Any

from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter

from .host import cuda_device_is_host

# megatron-core 0.16 without TransformerEngine never binds moe_utils.te_general_gemm, so every router forward
# raises NameError; 0.19 binds it to None in that case, which is the value its code expects.
if not hasattr(moe_utils, "te_general_gemm"):
    moe_utils.te_general_gemm = None


class PortableTopKRouter(TopKRouter):
    """``TopKRouter`` that keeps its tensors on the host when CUDA is unavailable (same outputs)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with cuda_device_is_host():
            super().__init__(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any):
        with cuda_device_is_host():
            return super().forward(*args, **kwargs)
