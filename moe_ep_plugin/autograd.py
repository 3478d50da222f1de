"""Differentiable dispatch and combine (DESIGN.md autograd contract).

- dispatch backward = ``combine(grad_recv_x, handle, topk_weights=grad_recv_topk_weights)``
- combine backward  = ``dispatch(grad_combined_x, handle=handle)`` (cached layout, no top-k)
FP8 applies to the forward dispatch only; gradients travel in the dtype of the activations (BF16 on GPU).
"""
from __future__ import annotations

from typing import Optional

import torch

from .buffer import Buffer
from .handle import DispatchHandle


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, topk_weights: Optional[torch.Tensor], buffer: Buffer, topk_idx: torch.Tensor,
                num_experts: int, fp8_dispatch: bool, expert_alignment: int):
        recv_x, recv_idx, recv_weights, counts, handle, _ = buffer.dispatch(
            x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=num_experts,
            expert_alignment=expert_alignment, fp8_dispatch=fp8_dispatch)
        ctx.buffer, ctx.handle = buffer, handle
        ctx.save_for_backward(recv_idx)
        ctx.has_weights = topk_weights is not None
        ctx.x_meta = (x.shape[1], x.dtype)
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_idx, recv_weights, counts, handle

    @staticmethod
    def backward(ctx, grad_recv_x, grad_recv_idx, grad_recv_weights, *unused):
        (recv_idx,) = ctx.saved_tensors
        handle: DispatchHandle = ctx.handle
        if grad_recv_x is None:
            hidden, dtype = ctx.x_meta
            grad_recv_x = torch.zeros(handle.num_recv_rows, hidden, dtype=dtype, device=recv_idx.device)
        weights_grad = None
        if ctx.has_weights:
            if grad_recv_weights is None:
                grad_recv_weights = torch.zeros(recv_idx.shape, dtype=torch.float32, device=recv_idx.device)
            # Entries for experts on other ranks were zeroed in the forward: no gradient flows through them here.
            weights_grad = grad_recv_weights.float().masked_fill(recv_idx < 0, 0.0)
        grad_x, grad_weights, _ = ctx.buffer.combine(grad_recv_x.contiguous(), handle, topk_weights=weights_grad)
        return grad_x, grad_weights, None, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, buffer: Buffer, handle: DispatchHandle):
        combined, _, _ = buffer.combine(x, handle)
        ctx.buffer, ctx.handle = buffer, handle
        return combined

    @staticmethod
    def backward(ctx, grad_combined):
        grad_x, _, _, _, _, _ = ctx.buffer.dispatch(grad_combined.contiguous(), handle=ctx.handle)
        return grad_x, None, None


def dispatch(buffer: Buffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: Optional[torch.Tensor],
             num_experts: int, *, fp8_dispatch: bool = False, expert_alignment: int = 1
             ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], list[int], DispatchHandle]:
    """Differentiable :meth:`Buffer.dispatch` of BF16/FP32 ``x`` ``[N, H]`` with ``topk_idx`` ``[N, K]`` (global ids).

    Returns ``(recv_x [N_recv, H], recv_topk_idx [N_recv, K] local ids, recv_topk_weights [N_recv, K] float32,
    num_recv_tokens_per_expert_list, handle)``. Gradients reach ``x`` and ``topk_weights``. With
    ``fp8_dispatch`` the rows cross the wire in FP8 and arrive as BF16 (straight-through gradient).
    """
    if not isinstance(buffer, Buffer):
        raise TypeError(f"buffer: expected moe_ep_plugin.Buffer, got {type(buffer).__name__}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a tensor (FP8 tuples are not differentiable), got {type(x).__name__}")
    return _Dispatch.apply(x, topk_weights, buffer, topk_idx, num_experts, fp8_dispatch, expert_alignment)


def combine(buffer: Buffer, x: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """Differentiable :meth:`Buffer.combine`: ``x`` ``[N_recv, H]`` → ``[N, H]`` (fp32 sum over ranks, cast back)."""
    if not isinstance(buffer, Buffer):
        raise TypeError(f"buffer: expected moe_ep_plugin.Buffer, got {type(buffer).__name__}")
    return _Combine.apply(x, buffer, handle)
