"""``overlap_moe_expert_parallel_comm``: Megatron-Core's own 1F1B EP-overlap schedule over a MoE transformer layer.

Megatron splits the layer into the nodes of its fine-grained callables (attention + router + ``mlp.preprocess``,
``mlp.dispatch``, ``mlp.routed_experts_compute``, ``mlp.combine`` + ``mlp.postprocess``), detaches every node's
inputs, frees some of them after forward and runs backward node by node, one micro-batch's forward interleaved
with the other's backward. Here ``TransformerLayerSchedulePlan.run`` drives it as ``combined_1f1b`` does:
micro-batch a forward alone, then b's forward interleaved with a's backward, then b's backward alone. Outputs, the
input gradients and every parameter gradient (summed over both micro-batches) must equal the same layer run
plainly (forward + backward per micro-batch), bitwise, for ``ep_plugin``, ``alltoall``, ``flex`` + ``deepep`` and
``flex`` + ``hybridep`` on this library; and each must equal ``alltoall`` under the same schedule within the
tolerance of tests/test_megatron_parity.py. BF16 (the schedule takes bf16 or fp16 models), CPU gloo ranks, uneven
token counts per rank.

The schedule's CUDA streams, events, NVTX ranges and ``record_stream`` are replaced by host doubles
(``support.megatron_host.overlap_schedule_is_host``); on CPU each node's work is done when it returns, so what is
not exercised here is the concurrency of the two streams itself (a node's kernels racing the other stream's):
tests/gpu/test_megatron_overlap_gpu.py runs the same model, inputs and checks (``support/megatron_overlap.py``)
on Megatron's real CUDA streams and events.
"""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from support.megatron_host import HostEvent, flex_backends_on_host, overlap_schedule_is_host  # noqa: E402
from support.megatron_overlap import Streams, check_kinds  # noqa: E402

from moe_ep_plugin.launch import spawn  # noqa: E402

# deepep / hybridep: flex with that backend (without CUDA, megatron-core >= 0.19 builds deepep's only)
KINDS = ("alltoall", "ep_plugin", *flex_backends_on_host(("deepep", "hybridep")))


def _suite(etp: int, ep: int, seed: int) -> None:
    from megatron.core import parallel_state as ps

    import moe_ep_plugin.megatron as ep_megatron
    from moe_ep_plugin.megatron.host import cuda_device_is_host, seed_model_parallel_rng

    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    seed_model_parallel_rng(seed)
    ep_megatron.install(ep_megatron.PluginOptions(transport="torch"))
    try:
        with overlap_schedule_is_host() as stream, cuda_device_is_host():
            check_kinds(KINDS, etp, ep, seed, torch.device("cpu"), Streams(stream, stream, HostEvent, lambda: None))
    finally:
        ep_megatron.uninstall()
        ps.destroy_model_parallel()


@pytest.mark.parametrize("etp,ep", [(1, 2), (2, 2)])
def test_overlap_schedule_matches_plain_layer(etp: int, ep: int) -> None:
    """Expert TP x EP 1x2 and 2x2 (attention data-parallel: Megatron's local specs have no sequence-parallel
    norm, which tensor parallelism with experts requires)."""
    spawn(_suite, etp * ep, args=(etp, ep, int(time.time()) % 1000), backend="gloo", timeout_s=600)
