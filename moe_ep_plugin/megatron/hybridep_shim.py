"""Megatron-Core's ``hybridep`` flex backend on this library: ``hybrid_ep_dispatch`` / ``hybrid_ep_combine``.

``moe_token_dispatcher_type: flex`` + ``moe_flex_dispatcher_backend: hybridep`` makes Megatron's ``_HybridEPManager``
call these two names from ``token_dispatcher`` at run time; :func:`moe_ep_plugin.megatron.install` binds them
there and in ``fused_a2a`` (megatron-core 0.16.1's and 0.19.2's signatures; DeepEP's separate ``hybrid-ep`` build is
not needed). The tensors follow HybridEP's contract: a dense routing map in, rows out already grouped by local
expert (``Buffer.dispatch_experts``, each expert's block padded to ``pad_multiple``), one probability per row.

With ``num_permuted_tokens`` (a static row budget P: Megatron's drop-and-pad capacity, or 0.19.2's
``moe_expert_rank_capacity_factor``) the outputs have exactly P rows: rows of the expert-major layout past P are
dropped (they contribute nothing to the combine; the overflow flag at ``handle[-1]`` is set), a shorter layout is
padded with zero rows, and ``tokens_per_expert`` is a device tensor clipped to the budget. The budgeted form is
sized on the device (``budget.dispatch``: fixed-size receive of ``ranks x tokens`` rows, expert-major slots on the
device): on the ``nvlink`` transport (``local`` at one rank) it reads nothing on the host, forward or backward, so a
CUDA graph can hold it, as HybridEP's non-blocking mode. There the top-k width is static, ``min(E, MAX_TOPK)`` (the
kernels' limit; a token's experts past it are dropped and set the overflow flag); the transports that exchange
counts through the host anyway (``torch``, ``hierarchical``) take the widest routing-map row over the ranks (one
small all-reduce), as the counted form does. Every rank must pass the same token count (as HybridEP asks). Without
``num_permuted_tokens``, ``tokens_per_expert`` is a CPU int64 tensor read from the dispatch's counts.

FP8 dispatch (which Megatron's hybridep asserts off) comes from the plugin options (``PluginOptions.fp8_dispatch``):
rows cross the wire as FP8 and arrive dequantized to BF16.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import autograd as ep_autograd
from ..buffer_cache import get_buffer
from ..config import combine_config, dispatch_config, positive_int
from ..ops.library import MAX_TOPK
from . import budget as row_budget
from . import deepep_shim
from .options import SYNC_FREE_TRANSPORTS

HYBRIDEP_TOKEN_ALIGNMENT = 64  # HybridEP's public-API chunk, re-exported for Megatron's pad-uneven-inputs path


def fit_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` cut to, or padded with zero rows to, ``rows`` rows (differentiable)."""
    if t.shape[0] >= rows:
        return t[:rows]
    return F.pad(t, (0, 0) * (t.dim() - 1) + (0, rows - t.shape[0]))


def _configs(num_sms_dispatch: int | None, num_sms_combine: int | None, num_ranks: int) -> Any:
    """The ``(dispatch, combine)`` Configs of Megatron's SM counts (one given: both; none: the plugin options'
    ``num_sms``; None when neither says: the Buffer's defaults)."""
    first = num_sms_dispatch if num_sms_dispatch is not None else num_sms_combine
    first = first if first is not None else deepep_shim.current_options().num_sms
    if first is None:
        return None
    second = num_sms_combine if num_sms_combine is not None else first
    return dispatch_config(first if num_sms_dispatch is None else num_sms_dispatch, num_ranks), combine_config(
        second, num_ranks
    )


def _group_maxima(routing_map: torch.Tensor, group: dist.ProcessGroup) -> tuple[int, int]:
    """``(widest routing_map row, most tokens)`` over the group: the top-k width every rank converts to (at least
    1; the ranks must agree on it) and the tokens that size a receive for every rank's. One small all-reduce and a
    host read per dispatch, which HybridEP's dense-map kernels do not need."""
    width = routing_map.sum(1).max() if routing_map.shape[0] else routing_map.new_zeros((), dtype=torch.int64)
    words = torch.stack([width.to(torch.int64), width.new_tensor(routing_map.shape[0], dtype=torch.int64)])
    dist.all_reduce(words, op=dist.ReduceOp.MAX, group=group)
    width, tokens = words.tolist()
    return max(1, width), tokens


def hybrid_ep_dispatch(
    x: torch.Tensor,
    routing_map: torch.Tensor,
    probs: torch.Tensor,
    group: dist.ProcessGroup,
    num_local_experts: int,
    num_sms_dispatch_api: int | None = None,
    num_sms_combine_api: int | None = None,
    num_blocks_permute: int | None = None,
    num_blocks_unpermute: int | None = None,
    fused: bool = False,
    num_permuted_tokens: int | None = None,
    pad_multiple: int | None = None,
    num_sms_preprocessing_api: int | None = None,
):
    """Dispatch ``x`` ``[T, H]`` (BF16/FP16/FP32) routed by
    ``routing_map`` ``[T, E]`` bool with ``probs`` ``[T, E]`` float32 (dense, 0 where not routed) straight into the
    expert-major layout.

    Arguments:
        x, routing_map, probs, group: as above; ``E`` = ``num_local_experts`` times the group size.
        num_local_experts: experts on each rank.
        num_sms_dispatch_api, num_sms_combine_api: SMs of the dispatch and combine kernels (None: the plugin
            options' ``num_sms``, else the Buffer's default); even.
        num_blocks_permute, num_blocks_unpermute, fused, num_sms_preprocessing_api: HybridEP's kernel split knobs:
            accepted (this library's permute is fused into its dispatch).
        num_permuted_tokens: the static row budget P (module docstring), or None.
        pad_multiple: each expert's block padded to a multiple of this (FP8/FP4 GEMM alignment), or None.

    Returns:
        ``(dispatched_hidden [P or M, H], dispatched_probs [P or M] float32, None, tokens_per_expert [L] int64,
        handle)``; ``handle[-1]`` is the overflow flag (int32 ``[1]`` on ``x``'s device, nonzero when rows were
        dropped). Differentiable in ``x`` and ``probs``.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x: expected a [tokens, hidden] tensor, got {getattr(x, 'shape', type(x).__name__)}")
    if not isinstance(probs, torch.Tensor) or probs.dtype != torch.float32:
        raise TypeError(f"probs: expected float32 (as HybridEP), got {getattr(probs, 'dtype', type(probs).__name__)}")
    num_ranks = dist.get_world_size(group)
    num_experts = num_local_experts * num_ranks
    if routing_map.dim() != 2 or routing_map.shape[1] != num_experts:
        raise ValueError(
            f"routing_map: expected [tokens, {num_experts}] (num_local_experts={num_local_experts} "
            f"x {num_ranks} ranks), got {tuple(routing_map.shape)}"
        )
    for name, value in (("num_permuted_tokens", num_permuted_tokens), ("pad_multiple", pad_multiple)):
        if value is not None:
            positive_int(value, name, 0)
    options = deepep_shim.current_options()
    buffer = get_buffer(
        group,
        x.size(1) * max(x.element_size(), 2),
        options.transport,
        options.timeout_s,
        ranks_per_node=options.ranks_per_node,
        device=x.device,
    )
    configs = _configs(num_sms_dispatch_api, num_sms_combine_api, num_ranks)
    if num_permuted_tokens is not None:
        return _budgeted_dispatch(
            buffer, x, routing_map, probs, group, num_experts, num_permuted_tokens, pad_multiple, configs
        )
    topk, _ = _group_maxima(routing_map, group)
    expert_x, expert_probs, tokens_per_expert, handle = ep_autograd.dispatch_experts_from_routing_map(
        buffer,
        x,
        routing_map,
        probs,
        topk,
        num_experts,
        fp8_dispatch=options.fp8_dispatch,
        expert_alignment=pad_multiple or 1,
        round_scale=options.round_scale,
        configs=configs,
    )
    rows = sum(tokens_per_expert)
    overflow = torch.zeros(1, dtype=torch.int32, device=x.device)
    counts = torch.tensor(tokens_per_expert, dtype=torch.int64, device="cpu")
    return expert_x, expert_probs, None, counts, (buffer, handle, rows, None, configs, overflow)


def _budgeted_dispatch(
    buffer: Any,
    x: torch.Tensor,
    routing_map: torch.Tensor,
    probs: torch.Tensor,
    group: dist.ProcessGroup,
    num_experts: int,
    num_permuted_tokens: int,
    pad_multiple: int | None,
    configs: Any,
) -> tuple:
    """The ``num_permuted_tokens`` form of :func:`hybrid_ep_dispatch`, sized on the device (module docstring):
    ``(rows [P, H], probs [P] float32, None, tokens_per_expert [L] int64 on x's device (each expert's aligned
    block clipped to P), handle)``; ``handle[-1]``: int32 ``[1]``, 1 when aligned rows past P, or a token's
    experts past the static top-k width, were dropped."""
    options = deepep_shim.current_options()
    num_ranks = dist.get_world_size(group)
    if buffer.transport_name in SYNC_FREE_TRANSPORTS:
        # static, no host read: Megatron's ranks of one EP group carry as many tokens each; a rank that receives
        # more raises on every rank (the kernels' worst-token check)
        topk, tokens = min(num_experts, MAX_TOPK), x.shape[0]
    else:
        topk, tokens = _group_maxima(routing_map, group)
    budget = row_budget.RowBudget(max(1, num_ranks * tokens), num_permuted_tokens)
    expert_x, expert_probs, _, handle, excess = row_budget.dispatch(
        buffer,
        budget,
        x,
        routing_map,
        probs,
        topk,
        num_experts,
        alignment=pad_multiple or 1,
        fp8_dispatch=options.fp8_dispatch,
        round_scale=options.round_scale,
        configs=configs,
    )
    ends = handle.blocks.cumsum(0)
    clipped = ends.clamp(max=num_permuted_tokens) - (ends - handle.blocks).clamp(max=num_permuted_tokens)
    too_wide = (routing_map.sum(1) > topk).any()
    overflow = ((excess > 0) | too_wide).to(torch.int32).reshape(1)
    handle_out = (buffer, handle, num_permuted_tokens, num_permuted_tokens, configs, overflow)
    return expert_x, expert_probs, None, clipped, handle_out


def hybrid_ep_combine(
    x: torch.Tensor,
    handle: Any,
    num_permuted_tokens: Any | None = None,
    pad_multiple: int | None = None,
    fused: bool = False,
) -> torch.Tensor:
    """Sum the expert rows ``x`` (the dispatch's layout: ``[P or M, H]``) back to their tokens → ``[T, H]`` x.dtype
    (summed in fp32; unweighted; rows dropped by the budget contribute nothing). ``num_permuted_tokens``/
    ``pad_multiple``/``fused`` are taken from the handle (accepted for Megatron's call). Differentiable (backward:
    the cached dispatch of the gradient)."""
    if not (isinstance(handle, tuple) and len(handle) == 6):
        raise TypeError(f"handle: expected the handle returned by hybrid_ep_dispatch, got {type(handle).__name__}")
    buffer, dispatch_handle, rows, budget, configs, _ = handle
    expected = rows if budget is None else budget
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[0] != expected:
        raise ValueError(
            f"x: expected [{expected}, hidden] (the dispatch's rows), got {getattr(x, 'shape', type(x).__name__)}"
        )
    if isinstance(dispatch_handle, row_budget.BudgetHandle):
        return row_budget.combine(buffer, x, dispatch_handle, configs=configs)
    return ep_autograd.combine_experts(buffer, fit_rows(x, rows), dispatch_handle, configs=configs)
