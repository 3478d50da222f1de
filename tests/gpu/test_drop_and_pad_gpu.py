"""Drop-and-pad (``megatron/drop_and_pad.py``) captured in one CUDA graph on the ``nvlink`` transport: the forward
(pairs, dispatch, experts, combine) and its backward (``torch.autograd.grad``) run eagerly under
``torch.cuda.set_sync_debug_mode("error")`` (no host sync) and, replayed on new tokens, probs and routing maps, equal
eager calls bit for bit (``support.graph_replay``); and the eager rows equal the ``torch`` transport's on the CPU. The
Megatron dispatcher's drop-and-pad is this path (tests/gpu/test_megatron_parity_gpu.py runs it beside ``alltoall``).

With one GPU, 2 ranks share it (gloo group, ``Buffer(device=...)``): correct, not timeable; with more, one rank per
GPU (up to 4). A group of one rank (the ``local`` transport) is captured too. Skips without a GPU or the kernel library.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from support.gpu_marks import GPUS, NEEDS_KERNELS  # noqa: E402
from support.graph_replay import check_captured  # noqa: E402

from moe_ep_plugin import Buffer  # noqa: E402
from moe_ep_plugin.launch import spawn  # noqa: E402
from moe_ep_plugin.megatron import drop_and_pad  # noqa: E402

pytestmark = NEEDS_KERNELS
TOKENS, HIDDEN, EXPERTS_PER_RANK, CAPACITY = 512, 1024, 8, 96


def _step(
    buffer: Buffer,
    world: int,
    x: torch.Tensor,
    probs: torch.Tensor,
    rmap: torch.Tensor,
    scale: torch.Tensor,
    grad_out: torch.Tensor,
    grad_probs: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """Forward and backward of one drop-and-pad layer whose experts scale their rows."""
    layout = drop_and_pad.pad_layout(rmap, CAPACITY, world, 128)
    expert_x, expert_probs, handle = drop_and_pad.dispatch(buffer, x, probs, layout, fp8_dispatch=True)
    out = drop_and_pad.combine(buffer, expert_x * scale.unsqueeze(1), handle, layout)
    grad_x, grad_p = torch.autograd.grad((out, expert_probs), (x, probs), (grad_out, grad_probs))
    return expert_x, expert_probs, out, grad_x, grad_p


def _capture(world: int) -> None:
    rank = dist.get_rank()
    device = torch.device("cuda", rank % GPUS)
    torch.cuda.set_device(device)
    buffer = Buffer(transport="nvlink", timeout_s=60, device=str(device))  # local at one rank
    experts = EXPERTS_PER_RANK * world
    rows = EXPERTS_PER_RANK * -(-world * CAPACITY // 128) * 128
    gen = torch.Generator(device).manual_seed(rank)
    x = torch.empty(TOKENS, HIDDEN, dtype=torch.bfloat16, device=device, requires_grad=True)
    probs = torch.empty(TOKENS, experts, device=device, requires_grad=True)
    rmap = torch.empty(TOKENS, experts, dtype=torch.bool, device=device)
    scale = torch.empty(rows, dtype=torch.bfloat16, device=device)
    grad_out = torch.empty(TOKENS, HIDDEN, dtype=torch.bfloat16, device=device)
    grad_probs = torch.empty(rows, device=device)

    def refill() -> None:
        with torch.no_grad():
            x.copy_(torch.randn(TOKENS, HIDDEN, generator=gen, device=device))
            probs.copy_(torch.rand(TOKENS, experts, generator=gen, device=device))
            rmap.copy_(torch.rand(TOKENS, experts, generator=gen, device=device) < 0.2)
            scale.copy_(torch.randn(rows, generator=gen, device=device))
            grad_out.copy_(torch.randn(TOKENS, HIDDEN, generator=gen, device=device))
            grad_probs.copy_(torch.randn(rows, generator=gen, device=device))

    inputs = (buffer, world, x, probs, rmap, scale, grad_out, grad_probs)
    check_captured(_step, inputs, refill, ("expert_x", "expert_probs", "combined", "grad x", "grad probs"), device)
    if rank == 0:
        print(f"ok drop-and-pad forward + backward captured and replayed at {world} rank(s)", flush=True)


@pytest.mark.parametrize("world", [1, min(max(GPUS, 2), 4)])
def test_drop_and_pad_is_captured_and_replayed(world: int) -> None:
    spawn(_capture, world, args=(world,), backend="gloo", timeout_s=300)
