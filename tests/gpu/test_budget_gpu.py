"""``ep_plugin``'s dropless dispatch sized from a row budget (``megatron/budget.py``) on the ``nvlink`` transport
(``local`` at one rank): its forward and backward run under ``torch.cuda.set_sync_debug_mode("error")`` (no host
sync), are captured in one CUDA graph and, replayed on new tokens, probs and routing maps, equal eager calls bit for
bit; the eager results equal the ``torch`` transport's on the CPU. Budgets: the worst case (never cut) and a factor
that cuts pairs (the count of the cut equal too).

With one GPU, 2 ranks share it (gloo group, ``Buffer(device=...)``): correct, not timeable; with more, one rank per
GPU (up to 4). Skips without a GPU or the kernel library.
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
from moe_ep_plugin.megatron import budget  # noqa: E402

pytestmark = NEEDS_KERNELS
TOKENS, HIDDEN, EXPERTS_PER_RANK, TOPK, ALIGNMENT = 512, 1024, 8, 4, 16


def _step(
    buffer: Buffer,
    rows: budget.RowBudget,
    x: torch.Tensor,
    probs: torch.Tensor,
    rmap: torch.Tensor,
    scale: torch.Tensor,
    grads: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, ...]:
    """Forward and backward (``grads``: of the output and of the row probs) of one budgeted dropless layer whose
    experts scale their rows."""
    expert_x, expert_probs, tokens_per_expert, handle, excess = budget.dispatch(
        buffer, rows, x, rmap, probs, TOPK, rmap.shape[1], alignment=ALIGNMENT, fp8_dispatch=True
    )
    out = budget.combine(buffer, expert_x * scale.unsqueeze(1), handle)
    grad_x, grad_p = torch.autograd.grad((out, expert_probs), (x, probs), grads)
    return expert_x, expert_probs, tokens_per_expert, excess, out, grad_x, grad_p


def _capture(world: int, factor: float | None) -> None:
    rank = dist.get_rank()
    device = torch.device("cuda", rank % GPUS)
    torch.cuda.set_device(device)
    buffer = Buffer(transport="nvlink", timeout_s=60, device=str(device))  # local at one rank
    experts = EXPERTS_PER_RANK * world
    rows = budget.row_budget(TOKENS, world, TOPK, EXPERTS_PER_RANK, ALIGNMENT, factor)
    gen = torch.Generator(device).manual_seed(rank)
    x = torch.empty(TOKENS, HIDDEN, dtype=torch.bfloat16, device=device, requires_grad=True)
    probs = torch.empty(TOKENS, experts, device=device, requires_grad=True)
    rmap = torch.empty(TOKENS, experts, dtype=torch.bool, device=device)
    scale = torch.empty(rows.rows, dtype=torch.bfloat16, device=device)
    grad_out = torch.empty(TOKENS, HIDDEN, dtype=torch.bfloat16, device=device)
    grad_probs = torch.empty(rows.rows, device=device)

    def refill() -> None:
        with torch.no_grad():
            x.copy_(torch.randn(TOKENS, HIDDEN, generator=gen, device=device))
            probs.copy_(torch.rand(TOKENS, experts, generator=gen, device=device))
            scores = torch.rand(TOKENS, experts, generator=gen, device=device)
            scores[:, 0] += 0.5  # expert 0 over the mean: a factor's budget cuts some pairs
            chosen = torch.zeros_like(rmap).scatter_(1, scores.topk(TOPK, dim=1).indices, True)
            rmap.copy_(chosen & (torch.rand(TOKENS, experts, generator=gen, device=device) > 0.1))
            scale.copy_(torch.randn(rows.rows, generator=gen, device=device))
            grad_out.copy_(torch.randn(TOKENS, HIDDEN, generator=gen, device=device))
            grad_probs.copy_(torch.randn(rows.rows, generator=gen, device=device))

    inputs = (buffer, rows, x, probs, rmap, scale, (grad_out, grad_probs))
    check_captured(
        _step,
        inputs,
        refill,
        ("expert_x", "expert_probs", "tokens_per_expert", "excess", "combined", "grad x", "grad probs"),
        device,
    )
    if rank == 0:
        print(f"ok budgeted dropless (factor {factor}) captured and replayed at {world} rank(s)", flush=True)


@pytest.mark.parametrize("factor", [None, 1.0])
@pytest.mark.parametrize("world", [1, min(max(GPUS, 2), 4)])
def test_budgeted_dropless_is_sync_free_and_replayed(world: int, factor: float | None) -> None:
    spawn(_capture, world, args=(world, factor), backend="gloo", timeout_s=300)
