"""Megatron-Core's multi-hot routing map → top-k expert ids and weights, the form dispatch takes.

CUDA float32 probs go through one kernel (csrc/kernels/layout.cuh ``moe_ep_routing_map_topk``) when the kernel library
loads, everything else through four torch ops; both give the same ids and weights. ``routing_map_to_topk`` is
differentiable; ``topk_from_routing_map`` (no autograd) and ``topk_weights_grad`` are its two halves for a caller
that folds the conversion into its own autograd function (the Megatron dispatcher's dispatch).
"""

from __future__ import annotations

import torch

from ..config import positive_int
from ..event import current_stream_handle
from . import library


def routing_map_to_topk(routing_map: torch.Tensor, probs: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-hot ``routing_map`` ``[T, E]`` bool and ``probs`` ``[T, E]`` → ``(topk_idx [T, K] int64,
    topk_weights [T, K] float32)``; slots beyond a token's selected experts (dropped tokens) hold -1 and weight 0.

    Experts are taken from ``routing_map``, not from the largest probs, so dense or tied probs cannot change
    which experts a token reaches. Differentiable in ``probs``.
    """
    check_routing_map(routing_map, probs, topk)
    if _ROUTING_KERNEL.usable(routing_map, probs):
        return _RoutingMapTopK.apply(probs, routing_map, topk)
    return _torch_topk(routing_map, probs, topk)


def _torch_topk(routing_map: torch.Tensor, probs: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch-op path of :func:`routing_map_to_topk` (differentiable through autograd)."""
    # Four kernels for fp32 probs (topk, gather, two wheres; other dtypes add a cast): the bool map is
    # reinterpreted as uint8 without a copy so topk ranks a token's selected experts (value 1) first; the 0/1
    # values, reinterpreted back as bool, mark the slots past its selected experts (id -1, weight 0).
    selected, idx = torch.topk(routing_map.view(torch.uint8), topk, dim=1, sorted=False)
    valid = selected.view(torch.bool)
    weights = probs.gather(1, idx)
    if weights.dtype != torch.float32:  # .float() costs host time even when it returns its input
        weights = weights.float()
    return torch.where(valid, idx, -1), torch.where(valid, weights, 0.0)


def check_routing_map(routing_map: object, probs: object, topk: object) -> None:
    """Raise ``ValueError`` naming the argument unless ``routing_map`` is a 2-D bool ``[T, E]`` tensor, ``probs`` a
    tensor of its shape and ``topk`` an int in ``[1, E]``."""
    if not isinstance(routing_map, torch.Tensor) or routing_map.dtype != torch.bool or routing_map.dim() != 2:
        raise ValueError(
            f"routing_map: expected a 2-D bool [tokens, experts] tensor, got "
            f"{getattr(routing_map, 'dtype', type(routing_map).__name__)} "
            f"{tuple(getattr(routing_map, 'shape', ()))}"
        )
    if not isinstance(probs, torch.Tensor) or probs.shape != routing_map.shape:
        raise ValueError(
            f"probs: expected shape {tuple(routing_map.shape)}, got "
            f"{tuple(probs.shape) if isinstance(probs, torch.Tensor) else type(probs).__name__}"
        )
    positive_int(topk, "topk", 1, routing_map.shape[1])


def topk_from_routing_map(
    routing_map: torch.Tensor, probs: torch.Tensor, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`routing_map_to_topk` without autograd, of arguments :func:`check_routing_map` accepted: for callers
    that give ``probs`` its gradient themselves (:func:`topk_weights_grad`)."""
    if _ROUTING_KERNEL.usable(routing_map, probs):
        return _routing_kernel(routing_map, probs, topk)
    with torch.no_grad():
        return _torch_topk(routing_map, probs, topk)


def topk_weights_grad(
    grad_weights: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, *, masked: bool = True
) -> torch.Tensor:
    """The gradient of ``topk_from_routing_map``'s weights ``[T, K]`` float32 as the ``[T, E]`` float32 gradient of its
    probs (zero where no expert was selected). ``masked=False`` when ``grad_weights`` is already 0 wherever
    ``topk_idx`` is -1 (a combine's weights are): two kernels fewer."""
    grad = torch.zeros(topk_idx.shape[0], num_experts, dtype=torch.float32, device=topk_idx.device)
    if masked:
        grad_weights = torch.where(topk_idx >= 0, grad_weights.float(), 0.0)
    # -1 slots are sent to column 0 with a zero gradient (an add, so they cannot overwrite a real one)
    return grad.scatter_add_(1, topk_idx.clamp(min=0), grad_weights)


def _routing_kernel(routing_map: torch.Tensor, probs: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One kernel: each token's selected experts in ascending order with their probs (CUDA, float32 probs)."""
    n, num_experts = routing_map.shape
    idx = torch.empty(n, topk, dtype=torch.int64, device=probs.device)
    weights = torch.empty(n, topk, dtype=torch.float32, device=probs.device)
    # The kernel reads the bool map as bytes through its pointer: no uint8 view needed.
    library.check(
        library.load().moe_ep_routing_map_topk(
            routing_map.data_ptr(),
            probs.data_ptr(),
            n,
            num_experts,
            topk,
            idx.data_ptr(),
            weights.data_ptr(),
            current_stream_handle(probs.get_device()),
        ),
        "topk_from_routing_map",
    )
    return idx, weights


class _RoutingKernel:
    """Whether the one-kernel CUDA path (csrc/kernels/layout.cuh ``moe_ep_routing_map_topk``) serves a call: CUDA
    tensors, float32 probs, contiguous rows, and the kernel library loads (checked once)."""

    def __init__(self) -> None:
        self._loaded: bool | None = None

    def usable(self, routing_map: torch.Tensor, probs: torch.Tensor) -> bool:
        if not (
            routing_map.is_cuda
            and probs.dtype == torch.float32
            and routing_map.is_contiguous()
            and probs.is_contiguous()
        ):
            return False
        if self._loaded is None:
            self._loaded = library.unavailable_reason() is None
        return self._loaded


_ROUTING_KERNEL = _RoutingKernel()


class _RoutingMapTopK(torch.autograd.Function):
    """The kernel; the gradient of the weights scatters back into the ``[T, E]`` probs."""

    @staticmethod
    def forward(ctx, probs: torch.Tensor, routing_map: torch.Tensor, topk: int):
        idx, weights = _routing_kernel(routing_map, probs, topk)
        ctx.save_for_backward(idx)
        ctx.num_experts = routing_map.shape[1]
        ctx.mark_non_differentiable(idx)
        return idx, weights

    @staticmethod
    def backward(ctx, grad_idx, grad_weights):
        (idx,) = ctx.saved_tensors
        return topk_weights_grad(grad_weights, idx, ctx.num_experts), None, None
