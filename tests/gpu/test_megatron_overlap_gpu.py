"""``overlap_moe_expert_parallel_comm`` on CUDA: Megatron-Core's own 1F1B EP-overlap schedule
(``TransformerLayerSchedulePlan.run`` as ``combined_1f1b`` drives it) over a MoE transformer layer, with Megatron's
real CUDA streams and events: attention and experts on the compute stream (the current one), dispatch and combine
on a communication stream, one event per micro-batch, so one micro-batch's dispatch and combine race the other's
attention and experts, ordered only by the schedule's events. What tests/test_megatron_overlap.py shows on CPU
with host doubles, here on the GPU, from the same model, inputs and reference (``support/megatron_overlap.py``):
outputs, input gradients and every parameter gradient equal the same layer run plainly, bitwise, and equal
``alltoall`` under the schedule within the CPU test's tolerance; dispatchers ``alltoall``, ``ep_plugin`` (the
``nvlink`` kernels when the kernel library is usable, else the ``torch`` transport over NCCL) and ``flex`` +
``deepep`` on this library.

Two layouts: ranks sharing one GPU (``cuda:0``, a gloo group; the plugin's Buffer on the tokens' GPU with the
``nvlink`` kernels, since a gloo group cannot carry GPU rows for the ``torch`` transport; Megatron's ``alltoall``
over gloo's CUDA all-to-all), and one rank per GPU over NCCL when 2 or more GPUs are visible. Expert TP stays 1
on the shared GPU: gloo has no reduce-scatter and no uneven all-gather, which Megatron's expert-TP collectives
use. Deterministic algorithms are on (``CUBLAS_WORKSPACE_CONFIG`` set), so scatter-adds and index-adds take the
same order in the plain and the scheduled run. Skips without a GPU, and the shared layout without the kernel
library, naming the reason.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from support.gpu_marks import GPUS, NEEDS_KERNELS  # noqa: E402
from support.megatron_overlap import Streams, check_kinds  # noqa: E402

from moe_ep_plugin.launch import spawn  # noqa: E402
from moe_ep_plugin.ops import library  # noqa: E402

KINDS = ("alltoall", "ep_plugin", "deepep")


def _cuda_streams(device: torch.device) -> Streams:
    """The streams ``combined_1f1b`` sets (``set_streams``): the current stream computes, a fresh one
    communicates; a layer's last node (combine) ends on the communication stream, so the current stream waits for
    it before the test reads an output."""
    comp = torch.cuda.current_stream(device)
    comm = torch.cuda.Stream(device=device)
    return Streams(comp, comm, torch.cuda.Event, lambda: comp.wait_stream(comm))


def _suite(etp: int, ep: int, seed: int, shared_gpu: bool) -> None:
    from megatron.core import parallel_state as ps

    import moe_ep_plugin.megatron as ep_megatron
    from moe_ep_plugin.buffer_cache import destroy_buffers
    from moe_ep_plugin.megatron.host import seed_model_parallel_rng

    if shared_gpu:
        torch.cuda.set_device(0)
    device = torch.device("cuda", torch.cuda.current_device())
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when this process's cuBLAS starts
    # warn_only: an op without a deterministic CUDA kernel is named in the log instead of ending the run
    torch.use_deterministic_algorithms(True, warn_only=True)
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    seed_model_parallel_rng(seed)
    transport = "nvlink" if shared_gpu or library.unavailable_reason() is None else "torch"
    ep_megatron.install(ep_megatron.PluginOptions(transport=transport, timeout_s=60))
    try:
        check_kinds(KINDS, etp, ep, seed, device, _cuda_streams(device))
        torch.cuda.synchronize(device)
    finally:
        ep_megatron.uninstall()
        destroy_buffers()
        ps.destroy_model_parallel()


@pytest.mark.parametrize("ep", [pytest.param(ep, marks=NEEDS_KERNELS) for ep in (2, 4)])
def test_overlap_schedule_on_one_shared_gpu(ep: int) -> None:
    """EP 2 and 4 ranks on ``cuda:0`` (4 ranks x ``Buffer.num_sms`` stay within an H100's SMs)."""
    spawn(_suite, ep, args=(1, ep, int(time.time()) % 1000, True), backend="gloo", timeout_s=600)


@pytest.mark.parametrize("etp,ep", [(1, 2), (2, 2)])
def test_overlap_schedule_one_rank_per_gpu(etp: int, ep: int) -> None:
    """Expert TP x EP 1x2 on 2 GPUs and 2x2 on 4, one rank per GPU, NCCL."""
    if GPUS < etp * ep:
        pytest.skip(f"needs {etp * ep} CUDA GPUs, {GPUS} visible")
    spawn(_suite, etp * ep, args=(etp, ep, int(time.time()) % 1000, False), backend="nccl", timeout_s=600)
