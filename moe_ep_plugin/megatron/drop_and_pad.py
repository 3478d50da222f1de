"""Drop-and-pad (``moe_pad_expert_input_to_capacity``) on the plugin's Buffer: every local expert gets a fixed row
count, known without a host read, so the whole dispatch and combine can be captured in a CUDA graph on the
``nvlink`` transport, as Megatron captures ``alltoall``'s.

    map [T, E] -> pairs [E * C, H] (sender, expert-major) -> Buffer.dispatch (one expert per row, exactly
    L * C rows to each rank) -> [G, L, C] received -> expert-major [L, G * C (+ padding), H]
    combine: the reverse, then each token's pairs summed in fp32

Each arrow is one call of ``ops.pad`` (one kernel on CUDA): the pair selection (``select_pairs``), the pairs' rows
and probs (``arrange`` through the tokens), the received rows to expert-major and back (``arrange``), the token sums
(``sum_pairs``), forward and backward alike.

Megatron's router returns a map with exactly ``C`` = capacity tokens per expert (kept tokens, then padding tokens
with prob 0). Each expert takes the first ``C`` tokens of its column in a stable descending sort (marked tokens
first, each group in token order), which is ``alltoall``'s permute: both dispatchers see the same rows and probs, in
the same order (source rank, then token). Every (token, expert) pair crosses as a row of its own, as in
``alltoall``, so every count is fixed by ``C``: the dispatch runs with ``num_worst_tokens`` = its exact row count,
and the expert-major order is a reshape. The ranks of the group must hold the same token count (as ``alltoall``
assumes); a rank receiving more rows than its count is an error of the dispatch.

On the ``local`` transport (a group of one rank) nothing crosses: its dispatch would hand every pair row back
unchanged, so the pairs are gathered straight into the expert-major layout and the combine sums them from there,
with no Buffer call (FP8 rows are quantized and dequantized as that transport's dispatch does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import Buffer
from .. import autograd as ep_autograd
from ..handle import DispatchHandle
from ..ops import fp8, pad


@dataclass(frozen=True)
class PadLayout:
    """One drop-and-pad dispatch: ``tokens`` ``[E * C]`` int64 the token of every pair (expert ``e`` owns pairs
    ``[e * C, (e + 1) * C)``); ``slot`` ``[T, E]`` int32 each (token, expert)'s pair (-1 where the expert does not take
    the token); ``experts`` ``[E * C, 1]`` int64 each pair's expert; ``block`` the rows of each local expert (``G *
    C`` rounded up to the alignment)."""

    tokens: torch.Tensor
    slot: torch.Tensor
    experts: torch.Tensor
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
    each expert's first ``C`` tokens as ``alltoall`` takes them (``pad.select_pairs``). No host read."""
    num_tokens, num_experts = routing_map.shape
    if not 0 < capacity <= num_tokens:
        raise ValueError(
            f"moe_expert_capacity_factor: a capacity of {capacity} tokens per expert needs 1 to "
            f"{num_tokens} tokens (the tokens this rank holds)"
        )
    tokens, slot, experts = pad.select_pairs(routing_map, capacity)
    block = -(-group_size * capacity // alignment) * alignment
    return PadLayout(tokens, slot, experts.unsqueeze(1), num_tokens, num_experts, capacity, group_size, block)


def _rows_stay(buffer: Buffer) -> bool:
    """Whether ``buffer``'s transport keeps every row on this rank (``local``): then the pairs' rows are the experts'
    rows, in blocks of the expert-major ``block``; otherwise they cross in blocks of ``C``."""
    return buffer.transport_name == "local"


def dispatch(
    buffer: Buffer,
    x: torch.Tensor,
    probs: torch.Tensor,
    layout: PadLayout,
    *,
    fp8_dispatch: bool = False,
    round_scale: bool = False,
    configs: ep_autograd.Configs = None,
) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle | None]:
    """Send every pair of ``layout`` to its expert's rank.

    Arguments:
        buffer: the Buffer of the group (``layout.group_size`` ranks; not called on the ``local`` transport).
        x: ``[T, H]`` BF16/FP32 tokens.
        probs: ``[T, E]`` router probs (any float dtype).
        layout: from :func:`pad_layout`.
        fp8_dispatch, round_scale: rows cross in FP8 and arrive dequantized (straight-through gradient).
        configs: the ``(dispatch, combine)`` Configs of this call and its backward, or None.

    Returns:
        ``(expert_x [L * block, H] x.dtype, expert_probs [L * block] float32, handle)``: local expert ``l`` owns
        rows ``[l * block, (l + 1) * block)``, its ``G * C`` pairs by source rank then token, then zero rows (prob
        0); ``handle`` for :func:`combine` (None on the ``local`` transport). Gradients reach ``x`` and ``probs``.
    """
    if _rows_stay(buffer):
        return (*_Pairs.apply(x, probs, layout, layout.block, (fp8_dispatch, round_scale)), None)
    rows, row_probs = _Pairs.apply(x, probs, layout, layout.capacity, None)
    recv_x, _, recv_probs, _, handle = ep_autograd.dispatch(
        buffer,
        rows,
        layout.experts,
        row_probs.unsqueeze(1),
        layout.num_experts,
        fp8_dispatch=fp8_dispatch,
        round_scale=round_scale,
        configs=configs,
        num_worst_tokens=layout.num_pairs,
    )
    expert_x, expert_probs = _Arrange.apply(recv_x, recv_probs.squeeze(1), layout, False)
    return expert_x, expert_probs, handle


def combine(
    buffer: Buffer,
    y: torch.Tensor,
    handle: DispatchHandle | None,
    layout: PadLayout,
    *,
    configs: ep_autograd.Configs = None,
) -> torch.Tensor:
    """Reverse of :func:`dispatch`: expert outputs ``y`` ``[L * block, H]`` BF16/FP32 → ``[T, H]`` ``y.dtype``, each
    token's pair rows summed in fp32 (expert order) and rounded once; padding rows are ignored."""
    rows = layout.num_local * layout.block
    if not isinstance(y, torch.Tensor) or y.dim() != 2 or y.shape[0] != rows:
        raise ValueError(f"y: expected [{rows}, H] expert-major rows, got {_describe(y)}")
    if _rows_stay(buffer):
        return _TokenSum.apply(y, layout, layout.block)
    # each pair row comes back to its sender unchanged (the fp32 sum of one copy)
    rows = ep_autograd.combine(buffer, _Arrange.apply(y, None, layout, True)[0], handle, configs=configs)
    return _TokenSum.apply(rows, layout, layout.capacity)


def _describe(t: object) -> str:
    return f"shape {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def _gather_pairs(rows: torch.Tensor, layout: PadLayout, block: int, probs: torch.Tensor | None = None):
    """Token rows ``[T, H]`` (and probs ``[T, E]`` float32) → the pairs' rows ``[E * block, H]`` (and their probs),
    zero rows after each expert's ``C``."""
    return pad.arrange(rows, 1, layout.num_experts, layout.capacity, block, tokens=layout.tokens, probs=probs)


class _Pairs(torch.autograd.Function):
    """``x`` ``[T, H]``, ``probs`` ``[T, E]`` → the pairs' rows in blocks of ``block`` and their float32 probs
    (``_gather_pairs``); ``wire`` = ``(fp8_dispatch, round_scale)`` rounds ``x`` through FP8 first (straight through),
    as the ``local`` transport's dispatch does (None: the Buffer's dispatch does it). The gradient sums each token's
    rows in fp32 in expert order (``pad.sum_pairs``) and takes each pair's prob gradient."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, probs: torch.Tensor, layout: PadLayout, block: int, wire: tuple[bool, bool] | None
    ):
        ctx.layout, ctx.block, ctx.probs_dtype = layout, block, probs.dtype
        if wire is not None and wire[0]:
            fp8.check_fp8_hidden(x.shape[1], "x")
            x = fp8.dequantize(*fp8.quantize(x, round_scale=wire[1]), x.dtype)
        return _gather_pairs(x, layout, block, probs.float())

    @staticmethod
    def backward(ctx, grad_rows: torch.Tensor, grad_probs: torch.Tensor):
        layout = ctx.layout
        grad_x, grad_p = pad.sum_pairs(grad_rows, layout.slot, layout.capacity, ctx.block, grad_probs)
        return grad_x, grad_p.to(ctx.probs_dtype), None, None, None


class _Arrange(torch.autograd.Function):
    """Received pair rows ``[G * L * C, H]`` (and probs) → expert-major ``[L * block, H]``, or with ``inverse`` back;
    the gradient is the other direction (``pad.arrange``)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, probs: torch.Tensor | None, layout: PadLayout, inverse: bool):
        ctx.layout, ctx.inverse = layout, inverse
        return _arrange(rows, probs, layout, inverse)

    @staticmethod
    def backward(ctx, grad_rows: torch.Tensor, grad_probs: torch.Tensor | None):
        grad_x, grad_p = _arrange(grad_rows, grad_probs, ctx.layout, not ctx.inverse)
        return grad_x, grad_p, None, None


def _arrange(rows: torch.Tensor, probs: torch.Tensor | None, layout: PadLayout, inverse: bool):
    g = layout.group_size
    return pad.arrange(rows, g, layout.num_local, layout.capacity, layout.block, probs=probs, inverse=inverse)


class _TokenSum(torch.autograd.Function):
    """The pairs' rows ``[E * block, H]`` → ``[T, H]``, each token's rows summed in fp32 in expert order
    (``pad.sum_pairs``); the gradient gathers each row's token (zero rows after each expert's ``C``)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, layout: PadLayout, block: int) -> torch.Tensor:
        ctx.layout, ctx.block = layout, block
        return pad.sum_pairs(rows, layout.slot, layout.capacity, block)[0]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather_pairs(grad, ctx.layout, ctx.block)[0], None, None
