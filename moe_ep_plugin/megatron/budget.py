"""Dropless ``ep_plugin`` dispatch sized on the device from a row budget: nothing is read on the host on the
``nvlink`` transport (``local`` in a group of one rank), so a CUDA graph can hold the dispatch and the combine.

    map [T, E] -> top-k [T, K] -> Buffer.dispatch with num_worst_tokens W = G * T (room for every row of every
    rank: fixed-size outputs, no count read) -> rows [W, H], local ids [W, K] (-1 past the received rows) ->
    expert-major slots on the device (permute.expert_slots: per-expert pairs, aligned, prefix-summed) -> rows
    [P, H] (permute.permute; pairs past the budget P dropped) -> experts -> unpermute [W, H] -> Buffer.combine

The rows and their order are those of ``Buffer.dispatch_experts`` (expert, then source rank, then token), so the
expert rows, outputs and gradients equal the counted path's bit for bit while every pair fits. ``tokens_per_expert``
``[L]`` int64 stays on the device: each expert's aligned block cut at P, the last expert's block also holding the
rows past the layout up to P (zero rows, prob 0: they add nothing to any output or weight gradient), so the blocks
always sum to P. Pairs past P (``excess`` > 0) are the caller's to report or accept. The ranks of the group must
hold the same token count (as ``alltoall`` and CUDA graphs assume): a rank receiving more than W rows makes the
dispatch raise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import Buffer
from .. import autograd as ep_autograd
from ..config import round_up
from ..handle import DispatchHandle
from ..ops import permute
from ..ops.routing import routing_map_to_topk


@dataclass(frozen=True)
class RowBudget:
    """``recv_rows`` W: the rows a rank can receive (every token of every rank); ``rows`` P: the expert-major rows
    its experts take."""

    recv_rows: int
    rows: int


def row_budget(
    num_tokens: int, group_size: int, topk: int, num_local: int, alignment: int, factor: float | None
) -> RowBudget:
    """The budget of a dispatch of ``num_tokens`` tokens per rank over ``group_size`` ranks, ``topk`` experts per
    token, ``num_local`` experts per rank, blocks aligned to ``alignment``: P = ``factor`` x the mean pairs
    (``num_tokens x topk``) rounded up to the alignment, at most the worst case (every token of every rank on
    ``min(topk, num_local)`` of this rank's experts, each block's padding), which ``factor`` None takes."""
    recv_rows = max(1, group_size * num_tokens)  # 0 would ask Buffer.dispatch for counted outputs
    worst = recv_rows * min(topk, num_local) + num_local * (alignment - 1)
    if factor is None:
        return RowBudget(recv_rows, worst)
    return RowBudget(recv_rows, min(worst, round_up(math.ceil(factor * num_tokens * topk), alignment)))


@dataclass
class BudgetHandle:
    """What :func:`combine` replays: the row-major dispatch's ``handle``, each received pair's expert-major row
    ``slot`` ``[W, K]`` int32 (-1: none, or past the budget) and the budget; ``blocks`` ``[L]`` int64 on the
    device: each local expert's aligned rows before the cut at P (the flex shims report their own counts from it)."""

    handle: DispatchHandle
    slot: torch.Tensor
    budget: RowBudget
    blocks: torch.Tensor


def dispatch(
    buffer: Buffer,
    budget: RowBudget,
    x: torch.Tensor,
    routing_map: torch.Tensor,
    probs: torch.Tensor,
    topk: int,
    num_experts: int,
    *,
    alignment: int = 1,
    fp8_dispatch: bool = False,
    round_scale: bool = False,
    configs: ep_autograd.Configs = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, BudgetHandle, torch.Tensor]:
    """Send ``x`` ``[T, H]`` routed by ``routing_map`` ``[T, E]`` bool with ``probs`` ``[T, E]`` (any float dtype,
    ``topk`` experts at most per token, ``num_experts`` in all) into ``budget.rows`` expert-major rows, without a
    host read on the kernel transports.

    Returns ``(expert_x [P, H] x.dtype, expert_probs [P] float32, tokens_per_expert [L] int64, handle, excess)``
    on ``x``'s device; ``excess``: ``[]`` int64, the aligned pairs past P (dropped). Gradients reach ``x`` and
    ``probs``.
    """
    topk_idx, weights = routing_map_to_topk(routing_map, probs, topk)
    return dispatch_topk(
        buffer,
        budget,
        x,
        topk_idx,
        weights,
        num_experts,
        alignment=alignment,
        fp8_dispatch=fp8_dispatch,
        round_scale=round_scale,
        configs=configs,
    )


def dispatch_topk(
    buffer: Buffer,
    budget: RowBudget,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    weights: torch.Tensor,
    num_experts: int,
    *,
    alignment: int = 1,
    fp8_dispatch: bool = False,
    round_scale: bool = False,
    configs: ep_autograd.Configs = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, BudgetHandle, torch.Tensor]:
    """:func:`dispatch` of tokens already routed as top-k: ``topk_idx`` ``[T, K]`` int64 global expert ids (-1:
    none) with ``weights`` ``[T, K]`` float32. Same outputs; gradients reach ``x`` and ``weights``."""
    recv_x, recv_idx, recv_weights, _, handle = ep_autograd.dispatch(
        buffer,
        x,
        topk_idx,
        weights,
        num_experts,
        fp8_dispatch=fp8_dispatch,
        round_scale=round_scale,
        configs=configs,
        num_worst_tokens=budget.recv_rows,
    )
    num_local = num_experts // buffer.group_size
    slot, words = permute.expert_slots(recv_idx, num_local, alignment)
    rows = budget.rows
    slot = torch.where(slot < rows, slot, -1)  # pairs past the budget: dropped from the layout and the combine
    expert_x, expert_probs = _ToExperts.apply(recv_x, recv_weights, slot, rows)
    blocks = words[2:]
    ends = blocks.cumsum(0)
    tokens_per_expert = ends.clamp(max=rows) - (ends - blocks).clamp(max=rows)
    tokens_per_expert[-1] += rows - ends[-1].clamp(max=rows)
    excess = (ends[-1] - rows).clamp(min=0)
    return expert_x, expert_probs, tokens_per_expert, BudgetHandle(handle, slot, budget, blocks), excess


def combine(
    buffer: Buffer, y: torch.Tensor, handle: BudgetHandle, *, configs: ep_autograd.Configs = None
) -> torch.Tensor:
    """Reverse of :func:`dispatch`: expert outputs ``y`` ``[P, H]`` BF16/FP32 → ``[T, H]`` ``y.dtype``: each
    received row's experts summed in fp32 (top-k order), then each token's rows over ranks (``Buffer.combine``);
    padding rows and dropped pairs add nothing."""
    rows = _FromExperts.apply(y, handle.slot, handle.budget.rows)
    return ep_autograd.combine(buffer, rows, handle.handle, configs=configs)


class _ToExperts(torch.autograd.Function):
    """Received rows ``[W, H]`` and weights ``[W, K]`` float32 → expert-major rows ``[P, H]`` and probs ``[P]``
    (``permute.permute``); the rows' gradient sums each row's pairs (``unpermute``), the weights' gathers them."""

    @staticmethod
    def forward(ctx, recv_x: torch.Tensor, recv_weights: torch.Tensor, slot: torch.Tensor, rows: int):
        ctx.save_for_backward(slot)
        expert_x, expert_probs, _ = permute.permute(recv_x, slot, rows, recv_weights)
        return expert_x, expert_probs

    @staticmethod
    def backward(ctx, grad_x: torch.Tensor, grad_probs: torch.Tensor):
        (slot,) = ctx.saved_tensors
        # a zero appended at index P serves every -1 slot (a negative index counts from the end)
        grad_weights = torch.cat([grad_probs.float(), grad_probs.new_zeros(1, dtype=torch.float32)])[slot]
        return permute.unpermute(grad_x.contiguous(), slot), grad_weights, None, None


class _FromExperts(torch.autograd.Function):
    """Expert outputs ``[P, H]`` → received rows ``[W, H]`` (``permute.unpermute``); the gradient is the rows'
    gradient laid out expert-major again (``permute.permute``)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, slot: torch.Tensor, rows: int):
        ctx.save_for_backward(slot)
        ctx.rows = rows
        return permute.unpermute(y, slot)

    @staticmethod
    def backward(ctx, grad_rows: torch.Tensor):
        (slot,) = ctx.saved_tensors
        return permute.permute(grad_rows.contiguous(), slot, ctx.rows)[0], None, None
