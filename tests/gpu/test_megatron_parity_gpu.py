"""``ep_plugin`` beside Megatron-Core's own ``alltoall`` on CUDA, with ranks sharing one GPU (``cuda:0``, a gloo
group): the layer, cases and comparison of tests/test_megatron_parity.py (``support/megatron_parity.py``) — dropless,
capacity dropping and drop-and-pad, half of them recomputed — with the layer on the GPU, the plugin's Buffer on the
tokens' GPU with the ``nvlink`` kernels, and ``alltoall`` over gloo's CUDA all-to-all; ``flex`` + ``deepep`` and
``flex`` + ``hybridep`` on this library beside them as on the CPU.

BF16 only and expert TP 1: the kernel transports carry no FP16 (refused at config time, docs/megatron.md), and
gloo has no reduce-scatter and no uneven all-gather, which Megatron's expert-TP collectives use. Skips without a
GPU or the kernel library, naming the reason.
"""
from __future__ import annotations

import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from support.gpu_marks import NEEDS_KERNELS  # noqa: E402
from support.megatron_parity import CASES, FLEX_BACKENDS, check_case  # noqa: E402

from moe_ep_plugin.launch import spawn  # noqa: E402

pytestmark = NEEDS_KERNELS


def _suite(ep: int, seed: int) -> None:
    from megatron.core import parallel_state as ps

    import moe_ep_plugin.megatron as ep_megatron
    from moe_ep_plugin.buffer_cache import destroy_buffers
    from moe_ep_plugin.megatron.host import seed_model_parallel_rng
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
    seed_model_parallel_rng(seed)
    ep_megatron.install(ep_megatron.PluginOptions(transport="nvlink", timeout_s=60))
    try:
        for i, (mode, dtype, recompute) in enumerate(CASES):
            if dtype != torch.bfloat16:
                continue
            # Megatron's flex refuses drop-and-pad with deepep
            flex = tuple(b for b in FLEX_BACKENDS if mode != "pad" or b == "hybridep")
            check_case(1, ep, mode, dtype, recompute, seed + i, flex, device)
        torch.cuda.synchronize(device)
    finally:
        ep_megatron.uninstall()
        destroy_buffers()
        ps.destroy_model_parallel()


@pytest.mark.parametrize("ep", [2, 4])
def test_moe_layer_matches_megatron_alltoall_on_one_shared_gpu(ep: int) -> None:
    """EP 2 and 4 ranks on ``cuda:0`` (4 ranks x ``Buffer.num_sms`` stay within an H100's SMs)."""
    spawn(_suite, ep, args=(ep, int(time.time()) % 1000), backend="gloo", timeout_s=600)
