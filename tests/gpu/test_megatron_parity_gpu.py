"""``ep_plugin`` beside Megatron-Core's own ``alltoall`` on CUDA, with ranks sharing one GPU (``cuda:0``, a gloo
group): the layer, cases and comparison of tests/test_megatron_parity.py (``support/megatron_parity.py``) — dropless,
capacity dropping and drop-and-pad, half of them recomputed — with the layer on the GPU, the plugin's Buffer on the
tokens' GPU with the ``nvlink`` kernels, and ``alltoall`` over gloo's CUDA all-to-all; ``flex`` + ``deepep`` and
``flex`` + ``hybridep`` on this library beside them as on the CPU.

TP x EP 1x2, 1x4 and 2x2 (expert TP = TP, sequence parallel), BF16 and FP16 (the kernels move FP16 rows as BF16
ones and sum them in fp32, docs/megatron.md "FP16"). Megatron's TP gathers and reduce-scatters of CUDA tensors run on
host copies over gloo (``support.megatron_host.tp_collectives_through_host``); the plugin's dispatch over the TP x EP
group runs on the kernels. Skips without a GPU or the kernel library, naming the reason.
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
from support.megatron_host import tp_collectives_through_host  # noqa: E402
from support.megatron_parity import CASES, FLEX_BACKENDS, check_case  # noqa: E402

from moe_ep_plugin.launch import spawn  # noqa: E402

pytestmark = NEEDS_KERNELS


def _suite(tp: int, ep: int, seed: int) -> None:
    from megatron.core import parallel_state as ps

    import moe_ep_plugin.megatron as ep_megatron
    from moe_ep_plugin.buffer_cache import destroy_buffers
    from moe_ep_plugin.megatron.host import seed_model_parallel_rng

    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    ps.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=tp)
    seed_model_parallel_rng(seed)
    ep_megatron.install(ep_megatron.PluginOptions(transport="nvlink", timeout_s=60))
    try:
        with tp_collectives_through_host():
            for i, (mode, dtype, recompute) in enumerate(CASES):
                # Megatron's flex refuses drop-and-pad with deepep; install() with hybridep at expert TP > 1
                flex = tuple(b for b in FLEX_BACKENDS if mode != "pad" or (b == "hybridep" and tp == 1))
                check_case(tp, ep, mode, dtype, recompute, seed + i, flex, device)
        torch.cuda.synchronize(device)
    finally:
        ep_megatron.uninstall()
        destroy_buffers()
        ps.destroy_model_parallel()


@pytest.mark.parametrize("tp,ep", [(1, 2), (1, 4), (2, 2)], ids=["2", "4", "tp2xep2"])
def test_moe_layer_matches_megatron_alltoall_on_one_shared_gpu(tp: int, ep: int) -> None:
    """TP x EP ranks on ``cuda:0`` (4 ranks x ``Buffer.num_sms`` stay within an H100's SMs)."""
    spawn(_suite, tp * ep, args=(tp, ep, int(time.time()) % 1000), backend="gloo", timeout_s=600)
