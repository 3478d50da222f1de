"""Differentiable dispatch and combine (the contract: docs/buffer.md), row-major and expert-major.

- dispatch backward = ``combine(grad_recv_x, handle, topk_weights=grad_recv_topk_weights)``
- combine backward  = ``dispatch(grad_combined_x, handle=handle)`` (cached layout, no top-k)
- dispatch_experts backward = ``combine_experts(grad_expert_x, handle, expert_weights=grad_expert_probs)``
- combine_experts backward  = ``dispatch_experts(grad_combined_x, handle=handle)`` (cached expert layout)
FP8 applies to the forward dispatch only; gradients travel in the dtype of the activations (BF16 on GPU).
"""

from __future__ import annotations

import torch

from .buffer import Buffer
from .config import Config
from .handle import DispatchHandle
from .ops.routing import check_routing_map, topk_from_routing_map, topk_weights_grad


def _check_inputs(buffer: object, x: object, name: str = "x") -> None:
    if not isinstance(buffer, Buffer):
        raise TypeError(f"buffer: expected moe_ep_plugin.Buffer, got {type(buffer).__name__}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor (FP8 tuples are not differentiable), got {type(x).__name__}")


# The dispatch Functions take their non-differentiable arguments as one ``call`` tuple ``(buffer, topk_idx,
# num_experts, fp8_dispatch, expert_alignment, round_scale, configs, layout)``: Function.apply does host work per
# argument (functorch unwrapping, input bookkeeping), so fewer arguments cost less of it. ``configs``:
# ``(dispatch Config, combine Config)`` for the forward and the backward alike, or None for the Buffer's defaults.
# ``layout``: for a row-major dispatch the caller's ``(num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
# num_worst_tokens)`` (the first three None with top-k); for an expert-major dispatch from a routing map,
# ``(routing_map [N, E] bool, topk)``, else None.
Configs = tuple[Config, Config] | None
_Layout = tuple | None
_DispatchCall = tuple[Buffer, torch.Tensor | None, int | None, bool, int, bool, Configs, _Layout]


def _check_configs(configs: Configs) -> None:
    if configs is not None and not (
        isinstance(configs, tuple) and len(configs) == 2 and all(isinstance(c, Config) for c in configs)
    ):
        raise TypeError(
            f"configs: expected None or a (dispatch, combine) pair of moe_ep_plugin.Config, got {configs!r}"
        )


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, topk_weights: torch.Tensor | None, call: _DispatchCall):
        buffer, topk_idx, num_experts, fp8_dispatch, expert_alignment, round_scale, configs, layout = call
        per_rank, in_rank, per_expert, num_worst_tokens = layout
        recv_x, recv_idx, recv_weights, counts, handle, _ = buffer.dispatch(
            x,
            num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
            num_experts=num_experts,
            expert_alignment=expert_alignment,
            num_worst_tokens=num_worst_tokens,
            config=configs and configs[0],
            fp8_dispatch=fp8_dispatch,
            round_scale=round_scale,
        )
        ctx.buffer, ctx.handle, ctx.configs = buffer, handle, configs
        ctx.save_for_backward(recv_idx)
        ctx.has_weights = topk_weights is not None
        ctx.x_meta = (x.shape[1], x.dtype, x.device)
        if recv_idx is not None:
            ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_idx, recv_weights, counts, handle

    @staticmethod
    def backward(ctx, grad_recv_x, grad_recv_idx, grad_recv_weights, *unused):
        (recv_idx,) = ctx.saved_tensors
        handle: DispatchHandle = ctx.handle
        if grad_recv_x is None:
            hidden, dtype, device = ctx.x_meta
            grad_recv_x = torch.zeros(handle.num_recv_rows, hidden, dtype=dtype, device=device)
        weights_grad = None
        if ctx.has_weights:
            if grad_recv_weights is None:
                grad_recv_weights = torch.zeros(recv_idx.shape, dtype=torch.float32, device=recv_idx.device)
            # Entries for experts on other ranks were zeroed in the forward: no gradient flows through them here.
            weights_grad = grad_recv_weights.float().masked_fill(recv_idx < 0, 0.0)
        grad_x, grad_weights, _ = ctx.buffer.combine(
            grad_recv_x.contiguous(), handle, topk_weights=weights_grad, config=ctx.configs and ctx.configs[1]
        )
        return grad_x, grad_weights, None


class _Combine(torch.autograd.Function):
    """Row-major (``combine``/``dispatch``) or, with ``experts``, expert-major
    (``combine_experts``/``dispatch_experts``): the backward is the cached dispatch of the output gradient; both
    dispatches return the rows first."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, buffer: Buffer, handle: DispatchHandle, experts: bool, configs: Configs):
        combine = buffer.combine_experts if experts else buffer.combine
        combined, _, _ = combine(x, handle, config=configs and configs[1])
        ctx.buffer, ctx.handle, ctx.experts, ctx.configs = buffer, handle, experts, configs
        return combined

    @staticmethod
    def backward(ctx, grad_combined):
        dispatch = ctx.buffer.dispatch_experts if ctx.experts else ctx.buffer.dispatch
        # the Buffer makes its inputs contiguous
        grad_x = dispatch(grad_combined, handle=ctx.handle, config=ctx.configs and ctx.configs[0])[0]
        return grad_x, None, None, None, None


class _DispatchExperts(torch.autograd.Function):
    """With a routing map in ``call`` (its ``layout`` slot), ``topk_weights`` are the ``[N, E]`` router probs: the
    top-k ids and weights come from the map inside the forward, and the weights' gradient scatters back into the
    probs' in the backward (one autograd node for both steps: host time)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, topk_weights: torch.Tensor | None, call: _DispatchCall):
        buffer, topk_idx, num_experts, fp8_dispatch, expert_alignment, round_scale, configs, routing = call
        ctx.routing = None
        if routing is not None:
            probs_dtype = topk_weights.dtype
            topk_idx, topk_weights = topk_from_routing_map(routing[0], topk_weights, routing[1])
            ctx.routing = (topk_idx, probs_dtype)
        expert_x, _, probs, tokens_per_expert, handle, _ = buffer.dispatch_experts(
            x,
            topk_idx,
            topk_weights,
            num_experts,
            expert_alignment=expert_alignment,
            fp8_dispatch=fp8_dispatch,
            round_scale=round_scale,
            config=configs and configs[0],
        )
        ctx.buffer, ctx.handle, ctx.configs = buffer, handle, configs
        ctx.has_weights = topk_weights is not None
        return expert_x, probs, tokens_per_expert, handle

    @staticmethod
    def backward(ctx, grad_expert_x, grad_probs, *unused):
        # Gradients of unused outputs arrive as zeros (materialized); combine_experts never reads padding rows,
        # and pairs of other ranks have no row here, so nothing needs masking. The engine hands each gradient over
        # in its output's dtype (float32 probs), and the Buffer makes its inputs contiguous: no conversions here.
        expert_weights = grad_probs if ctx.has_weights else None
        grad_x, grad_weights, _ = ctx.buffer.combine_experts(
            grad_expert_x, ctx.handle, expert_weights, config=ctx.configs and ctx.configs[1]
        )
        if ctx.routing is not None:
            topk_idx, probs_dtype = ctx.routing
            # combine_experts' weights are 0 where topk_idx is -1 (its contract): no mask needed
            grad_weights = topk_weights_grad(grad_weights, topk_idx, ctx.handle.num_experts, masked=False)
            if grad_weights.dtype != probs_dtype:
                grad_weights = grad_weights.to(probs_dtype)
        return grad_x, grad_weights, None


def dispatch(
    buffer: Buffer,
    x: torch.Tensor,
    topk_idx: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    num_experts: int | None = None,
    *,
    fp8_dispatch: bool = False,
    expert_alignment: int = 1,
    round_scale: bool = False,
    configs: Configs = None,
    num_tokens_per_rank: torch.Tensor | None = None,
    is_token_in_rank: torch.Tensor | None = None,
    num_tokens_per_expert: torch.Tensor | None = None,
    num_worst_tokens: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, list[int], DispatchHandle]:
    """Differentiable :meth:`Buffer.dispatch` of BF16/FP32 ``x`` ``[N, H]`` with ``topk_idx`` ``[N, K]`` (global ids),
    or without top-k from the three layout tensors (as :meth:`Buffer.dispatch` takes them).

    Returns ``(recv_x [N_recv, H], recv_topk_idx [N_recv, K] local ids or None, recv_topk_weights [N_recv, K]
    float32 or None, num_recv_tokens_per_expert_list, handle)``. Gradients reach ``x`` and ``topk_weights``. With
    ``fp8_dispatch`` the rows cross the wire in FP8 (``round_scale``: power-of-two scales) and arrive as BF16
    (straight-through gradient). ``configs``: ``(dispatch, combine)`` Configs for this call and its backward (None:
    the Buffer's defaults). ``num_worst_tokens`` as for :meth:`Buffer.dispatch` (outputs of exactly that many rows,
    no host read on the ``nvlink`` transport, an empty per-expert list).
    """
    _check_inputs(buffer, x)
    _check_configs(configs)
    layout = (num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, num_worst_tokens)
    return _Dispatch.apply(
        x, topk_weights, (buffer, topk_idx, num_experts, fp8_dispatch, expert_alignment, round_scale, configs, layout)
    )


def combine(buffer: Buffer, x: torch.Tensor, handle: DispatchHandle, *, configs: Configs = None) -> torch.Tensor:
    """Differentiable :meth:`Buffer.combine`: ``x`` ``[N_recv, H]`` → ``[N, H]`` (fp32 sum over ranks, cast back);
    ``configs`` as for :func:`dispatch`."""
    _check_inputs(buffer, x)
    _check_configs(configs)
    return _Combine.apply(x, buffer, handle, False, configs)


def dispatch_experts(
    buffer: Buffer,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor | None,
    num_experts: int,
    *,
    fp8_dispatch: bool = False,
    expert_alignment: int = 1,
    round_scale: bool = False,
    configs: Configs = None,
) -> tuple[torch.Tensor, torch.Tensor | None, list[int], DispatchHandle]:
    """Differentiable :meth:`Buffer.dispatch_experts` of BF16/FP32 ``x`` ``[N, H]``, ``topk_idx`` ``[N, K]`` global ids.

    Returns ``(expert_x [M, H] x.dtype, expert_probs [M] float32 or None, tokens_per_expert list[int], handle)``.
    Gradients reach ``x`` and ``topk_weights`` (padding rows get none). With ``fp8_dispatch`` rows cross the
    wire in FP8 (``round_scale``: power-of-two scales) and arrive dequantized (straight-through gradient, sent
    back in ``x.dtype``). ``configs`` as for :func:`dispatch`.
    """
    _check_inputs(buffer, x)
    _check_configs(configs)
    return _DispatchExperts.apply(
        x, topk_weights, (buffer, topk_idx, num_experts, fp8_dispatch, expert_alignment, round_scale, configs, None)
    )


def dispatch_experts_from_routing_map(
    buffer: Buffer,
    x: torch.Tensor,
    routing_map: torch.Tensor,
    probs: torch.Tensor,
    topk: int,
    num_experts: int,
    *,
    fp8_dispatch: bool = False,
    expert_alignment: int = 1,
    round_scale: bool = False,
    configs: Configs = None,
) -> tuple[torch.Tensor, torch.Tensor | None, list[int], DispatchHandle]:
    """:func:`dispatch_experts` of ``x`` ``[N, H]`` routed by Megatron-Core's multi-hot ``routing_map`` ``[N, E]``
    bool with router ``probs`` ``[N, E]`` (any float dtype): each token's selected experts (at most ``topk``; the
    slots past them are -1) in ascending order, weighted by their probs, as ``ops.routing.routing_map_to_topk``
    gives them. Same returns; gradients reach ``x`` and ``probs`` (zero where no expert was selected)."""
    _check_inputs(buffer, x)
    _check_configs(configs)
    check_routing_map(routing_map, probs, topk)
    return _DispatchExperts.apply(
        x, probs, (buffer, None, num_experts, fp8_dispatch, expert_alignment, round_scale, configs, (routing_map, topk))
    )


def combine_experts(
    buffer: Buffer, y: torch.Tensor, handle: DispatchHandle, *, configs: Configs = None
) -> torch.Tensor:
    """Differentiable :meth:`Buffer.combine_experts`: expert outputs ``y`` ``[M, H]`` → ``[N, H]`` (its gradient is
    the cached expert-major dispatch of the output gradient; padding rows get zeros); ``configs`` as for
    :func:`dispatch`."""
    _check_inputs(buffer, y, "y")
    _check_configs(configs)
    return _Combine.apply(y, buffer, handle, True, configs)
