"""Drop-and-pad (``moe_pad_expert_input_to_capacity``) on the plugin's Buffer: every local expert gets a fixed row
count, known without a host read, so the whole dispatch and combine can be captured in a CUDA graph on the
``nvlink`` transport, as Megatron captures ``alltoall``'s.

    map [T, E] -> pairs [E * C, H] (sender, expert-major) -> Buffer.dispatch (one expert per row, exactly
    L * C rows to each rank) -> [G, L, C] received -> expert-major [L, G * C (+ padding), H]
    combine: the reverse, then each token's pairs summed in fp32

Megatron's router returns a map with exactly ``C`` = capacity tokens per expert (kept tokens, then padding tokens
with prob 0). Each expert takes the first ``C`` tokens of its column in a stable descending sort (marked tokens
first, each group in token order), which is ``alltoall``'s permute: both dispatchers see the same rows and probs, in
the same order (source rank, then token). Every (token, expert) pair crosses as a row of its own, as in
``alltoall``, so every count is fixed by ``C``: the dispatch runs with ``num_worst_tokens`` = its exact row count,
and the expert-major order is a reshape. The ranks of the group must hold the same token count (as ``alltoall``
assumes); a rank receiving more rows than its count is an error of the dispatch.

In a group of one rank the Buffer's ``local`` transport keeps the pairs (its dispatch with room for every row reads
nothing either).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import Buffer
from .. import autograd as ep_autograd
from ..handle import DispatchHandle
from ..ops import permute


@dataclass(frozen=True)
class PadLayout:
    """One drop-and-pad dispatch: ``tokens`` ``[E * C]`` int64 the token of every pair row (expert ``e`` owns rows
    ``[e * C, (e + 1) * C)``); ``block`` the rows of each local expert (``G * C`` rounded up to the alignment)."""

    tokens: torch.Tensor
    num_tokens: int
    num_experts: int
    capacity: int
    group_size: int
    block: int

    @property
    def num_local(self) -> int:
        return self.num_experts // self.group_size

    @property
    def num_pairs(self) -> int:
        return self.num_experts * self.capacity


def pad_layout(routing_map: torch.Tensor, capacity: int, group_size: int, alignment: int) -> PadLayout:
    """``routing_map`` ``[T, E]`` bool (``E`` a multiple of ``group_size``), ``capacity`` ``C`` <= T → the layout:
    each expert's first ``C`` tokens as ``alltoall`` takes them. Device ops only (no host read)."""
    num_tokens, num_experts = routing_map.shape
    if not 0 < capacity <= num_tokens:
        raise ValueError(
            f"moe_expert_capacity_factor: a capacity of {capacity} tokens per expert needs 1 to "
            f"{num_tokens} tokens (the tokens this rank holds)"
        )
    order = routing_map.t().to(torch.int8).argsort(dim=1, descending=True, stable=True)
    rows = group_size * capacity
    return PadLayout(
        order[:, :capacity].reshape(-1),
        num_tokens,
        num_experts,
        capacity,
        group_size,
        -(-rows // alignment) * alignment,
    )


def dispatch(
    buffer: Buffer,
    x: torch.Tensor,
    probs: torch.Tensor,
    layout: PadLayout,
    *,
    fp8_dispatch: bool = False,
    round_scale: bool = False,
    configs: ep_autograd.Configs = None,
) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
    """Send every pair of ``layout`` to its expert's rank.

    Arguments:
        buffer: the Buffer of the group (``layout.group_size`` ranks).
        x: ``[T, H]`` BF16/FP32 tokens.
        probs: ``[T, E]`` router probs (any float dtype).
        layout: from :func:`pad_layout`.
        fp8_dispatch, round_scale: rows cross in FP8 and arrive dequantized (straight-through gradient).
        configs: the ``(dispatch, combine)`` Configs of this call and its backward, or None.

    Returns:
        ``(expert_x [L * block, H] x.dtype, expert_probs [L * block] float32, handle)``: local expert ``l`` owns
        rows ``[l * block, (l + 1) * block)``, its ``G * C`` pairs by source rank then token, then zero rows (prob
        0); ``handle`` for :func:`combine`. Gradients reach ``x`` and ``probs``.
    """
    rows = _Pairs.apply(x, layout.tokens)
    row_probs = probs.t().gather(1, layout.tokens.view(layout.num_experts, layout.capacity)).reshape(-1).float()
    # each row's expert, [E * C, 1] (an expand: repeat_interleave would read its output size on the host)
    experts = torch.arange(layout.num_experts, device=x.device).unsqueeze(1).expand(-1, layout.capacity)
    experts = experts.reshape(-1, 1)
    recv_x, _, recv_probs, _, handle = ep_autograd.dispatch(
        buffer,
        rows,
        experts,
        row_probs.unsqueeze(1),
        layout.num_experts,
        fp8_dispatch=fp8_dispatch,
        round_scale=round_scale,
        configs=configs,
        num_worst_tokens=layout.num_pairs,
    )
    return _expert_major(recv_x, layout), _expert_major(recv_probs.squeeze(1), layout), handle


def combine(
    buffer: Buffer, y: torch.Tensor, handle: DispatchHandle, layout: PadLayout, *, configs: ep_autograd.Configs = None
) -> torch.Tensor:
    """Reverse of :func:`dispatch`: expert outputs ``y`` ``[L * block, H]`` BF16/FP32 → ``[T, H]`` ``y.dtype``, each
    token's pair rows summed in fp32 (expert order) and rounded once; padding rows are ignored."""
    # each pair row comes back to its sender unchanged (the fp32 sum of one copy)
    rows = ep_autograd.combine(buffer, _received_order(y, layout), handle, configs=configs)
    return _TokenSum.apply(rows, layout.tokens, layout.num_tokens)


def _expert_major(received: torch.Tensor, layout: PadLayout) -> torch.Tensor:
    """Received rows ``[G * L * C, ...]`` (source rank, expert, token) → ``[L * block, ...]`` (expert, source rank,
    token; zero rows after each expert's ``G * C``)."""
    g, c = layout.group_size, layout.capacity
    tail = received.shape[1:]
    blocks = received.reshape(g, layout.num_local, c, *tail).transpose(0, 1).reshape(layout.num_local, g * c, *tail)
    if layout.block > g * c:
        padding = blocks.new_zeros(layout.num_local, layout.block - g * c, *tail)
        blocks = torch.cat([blocks, padding], dim=1)
    return blocks.reshape(layout.num_local * layout.block, *tail)


def _received_order(y: torch.Tensor, layout: PadLayout) -> torch.Tensor:
    """Inverse of :func:`_expert_major` for ``[L * block, H]`` rows (the padding dropped)."""
    g, c = layout.group_size, layout.capacity
    blocks = y.reshape(layout.num_local, layout.block, y.shape[1])[:, : g * c]
    return blocks.reshape(layout.num_local, g, c, y.shape[1]).transpose(0, 1).reshape(-1, y.shape[1])


class _Pairs(torch.autograd.Function):
    """``x`` ``[T, H]`` → its rows ``tokens`` ``[P]``; the gradient sums each token's rows in fp32, in pair order
    (``permute.sum_by_index``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(tokens)
        ctx.num_tokens = x.shape[0]
        return x.index_select(0, tokens)

    @staticmethod
    def backward(ctx, grad_rows: torch.Tensor):
        (tokens,) = ctx.saved_tensors
        return permute.sum_by_index(grad_rows, tokens, ctx.num_tokens), None


class _TokenSum(torch.autograd.Function):
    """Pair rows ``[P, H]`` → ``[T, H]``, each token's rows summed in fp32 in pair order (``permute.sum_by_index``);
    the gradient gathers each row's token."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, tokens: torch.Tensor, num_tokens: int) -> torch.Tensor:
        ctx.save_for_backward(tokens)
        return permute.sum_by_index(rows, tokens, num_tokens)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (tokens,) = ctx.saved_tensors
        return grad.index_select(0, tokens), None, None
