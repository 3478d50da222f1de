"""Dispatch layout from top-k expert ids: pure tensor ops, no host sync, any device (or one kernel on CUDA)."""

from __future__ import annotations

import torch

from ..event import current_stream_handle
from . import library


def dispatch_layout(
    topk_idx: torch.Tensor, num_experts: int, num_ranks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``topk_idx`` ``[N, K]`` int64 (-1 = none), experts laid out contiguously over ranks →
    ``(num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32, is_token_in_rank [N, R] bool)``.

    A token counts once per rank however many of its experts live there.
    """
    n = topk_idx.shape[0]
    experts_per_rank = num_experts // num_ranks
    valid = (topk_idx >= 0) & (topk_idx < num_experts)  # out-of-range ids: ignored here, rejected by dispatch
    # Invalid entries go to an extra overflow slot that is sliced off, so no boolean indexing (host sync) is needed.
    expert_slot = torch.where(valid, topk_idx, num_experts).reshape(-1)
    per_expert = torch.zeros(num_experts + 1, dtype=torch.int32, device=topk_idx.device)
    per_expert.scatter_add_(0, expert_slot, torch.ones_like(expert_slot, dtype=torch.int32))
    rank_slot = torch.where(valid, topk_idx // experts_per_rank, num_ranks)
    in_rank = torch.zeros(n, num_ranks + 1, dtype=torch.bool, device=topk_idx.device)
    in_rank.scatter_(1, rank_slot, True)
    is_token_in_rank = in_rank[:, :num_ranks].contiguous()
    num_tokens_per_rank = is_token_in_rank.sum(dim=0, dtype=torch.int32)
    return num_tokens_per_rank, per_expert[:num_experts].contiguous(), is_token_in_rank


def kernel_dispatch_layout(
    topk_idx: torch.Tensor, num_experts: int, num_ranks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`dispatch_layout` in one kernel (csrc/kernels/layout.cuh), same results, for a contiguous CUDA ``topk_idx``
    with the kernel library loaded (the nvlink transport's inputs)."""
    n, k = topk_idx.shape
    counts = torch.zeros(num_ranks + num_experts, dtype=torch.int32, device=topk_idx.device)  # one memset
    per_rank, per_expert = counts[:num_ranks], counts[num_ranks:]
    in_rank = torch.empty(n, num_ranks, dtype=torch.bool, device=topk_idx.device)
    library.check(
        library.load().moe_ep_get_dispatch_layout(
            topk_idx.data_ptr(),
            n,
            k,
            num_experts,
            num_ranks,
            per_rank.data_ptr(),
            per_expert.data_ptr(),
            in_rank.data_ptr(),
            current_stream_handle(topk_idx.get_device()),
        ),
        "get_dispatch_layout",
    )
    return per_rank, per_expert, in_rank


def count_invalid(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[1]`` int32 on ``topk_idx``'s device: how many ids lie outside ``[-1, num_experts)``. No host sync: the
    transports exchange it with their counts and every rank raises at that one read."""
    return ((topk_idx < -1) | (topk_idx >= num_experts)).sum(dtype=torch.int32).reshape(1)


def invalid_ids_error(ranks: list[int], num_experts: int) -> ValueError:
    """The error every rank raises when the count exchange reports out-of-range expert ids on ``ranks``."""
    return ValueError(
        f"topk_idx: expert ids must lie in [-1, {num_experts}); rank(s) {ranks} passed ids outside it "
        "(every rank raises at the count exchange; no dispatch result is returned)"
    )


def send_positions(is_token_in_rank: torch.Tensor) -> torch.Tensor:
    """``[N, R]`` bool → ``[N, R]`` int32: index of token ``t`` among the tokens sent to ``r`` (token order),
    -1 if not sent."""
    running = is_token_in_rank.to(torch.int32).cumsum(dim=0, dtype=torch.int32) - 1
    return torch.where(is_token_in_rank, running, torch.full_like(running, -1))


def summing_order(
    topk_idx: torch.Tensor | None, num_experts: int, num_ranks: int, num_tokens: int, device: torch.device
) -> torch.Tensor:
    """``[N, R]`` int64: the ranks in the order combine adds a token's copies to its biases (DeepEP V2's): by the last
    top-k slot of ``topk_idx`` ``[N, K]`` naming one of the rank's experts, ranks named by no slot first in ascending
    order (ids outside ``[0, num_experts)`` name none). ``topk_idx`` None (a dispatch by layout alone): ascending.
    The nvlink combine kernel computes the same order per token (csrc/kernels/intranode.cuh ``summing_order``)."""
    ranks = torch.arange(num_ranks, dtype=torch.int64, device=device)
    if topk_idx is None:
        return ranks.expand(num_tokens, num_ranks)
    k = topk_idx.shape[1]
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    owner = torch.where(valid, topk_idx // (num_experts // num_ranks), num_ranks)
    last = torch.full((num_tokens, num_ranks + 1), -1, dtype=torch.int64, device=device)
    slots = torch.arange(k, dtype=torch.int64, device=device).expand(num_tokens, k)
    last.scatter_reduce_(1, owner, slots, reduce="amax")
    # distinct keys: ties (ranks named by no slot) fall back to rank order
    return (last[:, :num_ranks] * num_ranks + ranks).argsort(dim=1)
