"""Megatron-Core's ``ncclep`` flex backend on this library (megatron-core 0.19.2's ``fused_a2a`` contract, which
wraps TransformerEngine's NCCL EP ``transformer_engine.pytorch.ep``): neither TransformerEngine's EP build nor
NCCL EP is needed.

``_NCCLEPManager`` reads ``ensure_nccl_ep_bootstrapped``, ``new_nccl_ep_buffer``, ``nccl_ep_dispatch``,
``nccl_ep_combine`` and ``alloc_ep_symm_buffer`` from ``token_dispatcher`` at run time, and
``parallel_state.destroy_model_parallel`` imports ``fused_a2a.nccl_ep_finalize``; :func:`moe_ep_plugin.megatron.install`
binds all six where the installed megatron-core has them. The receive side is TE's: rows packed expert-major into
``[recv_capacity_per_rank, H]`` (each expert's block aligned to ``alignment``), one float32 probability per row,
``tokens_per_expert`` an int32 device tensor; combine is unweighted and returns tokens in their original order.

A rank receiving more rows than ``recv_capacity_per_rank`` is an error on every rank naming the ranks and the
capacity (NCCL EP traps), unless the bootstrap asked for ``drop_on_overflow=True`` (Megatron-LM main's argument):
then rows past the capacity are dropped, counted in :func:`dropped_rows`. ``num_topk``/``drop_on_overflow`` are
accepted so that both the 0.19.2 and the newer call work. FP8 dispatch comes from the plugin options
(``PluginOptions.fp8_dispatch``: FP8 on the wire, BF16 rows out), on every GPU. Symmetric-memory buffers are plain
tensors here (this library's transports bring their own peer memory); zero-copy receive buffers are filled with the
rows, and the returned tensor holds the same values.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .. import autograd as ep_autograd
from ..buffer import Buffer
from ..buffer_cache import get_buffer
from ..config import combine_config, dispatch_config
from . import deepep_shim
from .hybridep_shim import fit_rows
from .options import as_token_dtype, carried


@dataclass
class _Bootstrap:
    group: dist.ProcessGroup
    num_experts: int
    max_tokens_per_rank: int
    recv_capacity_per_rank: int
    hidden_dim: int
    configs: tuple | None
    drop_on_overflow: bool
    buffer: Buffer
    dropped_rows: int = 0


_state: _Bootstrap | None = None


@dataclass
class NcclEpBuffer:
    """One dispatch/combine pair's state (TE's ``EpBuffer``): the shapes it was made for and, after the dispatch,
    the layout its combine replays."""

    top_k: int
    max_tokens_per_rank: int
    recv_capacity_per_rank: int
    hidden_dim: int
    num_local_experts: int
    alignment: int
    handle: Any = None
    rows: int = 0  # rows of the expert-major layout the dispatch made (before the capacity cut)


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return value


def ensure_nccl_ep_bootstrapped(ep_group: dist.ProcessGroup, num_experts: int, max_tokens_per_rank: int,
                                recv_capacity_per_rank: int | None = None, hidden_dim: int = 0, num_sms: int = 0,
                                zero_copy: bool = False, num_topk: int | None = None,
                                drop_on_overflow: bool = False) -> None:
    """Set up the process-wide state once (collective on ``ep_group``: the shared Buffer); later calls are no-ops.

    Arguments:
        ep_group: the expert-parallel group (Megatron's TP x EP group).
        num_experts: experts over the group (a multiple of its size).
        max_tokens_per_rank: the most tokens a rank dispatches.
        recv_capacity_per_rank: rows each rank's receive buffer holds (None: the most a rank can receive,
            ``group size * max_tokens_per_rank * num_topk``, which needs ``num_topk``).
        hidden_dim: the hidden size.
        num_sms: SMs of the kernels (0: the plugin options' ``num_sms``, else the Buffer's default).
        zero_copy: accepted (receive buffers from :func:`alloc_ep_symm_buffer` are filled in place).
        num_topk: experts per token (only needed without ``recv_capacity_per_rank``).
        drop_on_overflow: drop rows past the capacity (counted) instead of raising.
    """
    global _state
    if _state is not None:
        return
    if not isinstance(ep_group, dist.ProcessGroup):
        raise TypeError(f"ep_group: expected a torch.distributed.ProcessGroup, got {type(ep_group).__name__}")
    group_size = dist.get_world_size(ep_group)
    if _positive("num_experts", num_experts) % group_size:
        raise ValueError(f"num_experts: {num_experts} is not a multiple of the {group_size} ranks of ep_group")
    _positive("max_tokens_per_rank", max_tokens_per_rank)
    _positive("hidden_dim", hidden_dim)
    if recv_capacity_per_rank is None:
        recv_capacity_per_rank = group_size * max_tokens_per_rank * _positive("num_topk", num_topk)
    _positive("recv_capacity_per_rank", recv_capacity_per_rank)
    if isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms < 0:
        raise ValueError(f"num_sms: expected an int >= 0 (0: the default), got {num_sms!r}")
    options = deepep_shim.current_options()
    sms = num_sms or options.num_sms
    configs = None if not sms else (dispatch_config(sms, group_size), combine_config(sms, group_size))
    buffer = get_buffer(ep_group, hidden_dim * 2, options.transport, options.timeout_s,
                        ranks_per_node=options.ranks_per_node)
    _state = _Bootstrap(ep_group, num_experts, max_tokens_per_rank, recv_capacity_per_rank, hidden_dim, configs,
                        bool(drop_on_overflow), buffer)


def nccl_ep_finalize() -> None:
    """Forget the bootstrap (idempotent; the shared Buffer stays with ``buffer_cache``)."""
    global _state
    _state = None


def dropped_rows() -> int:
    """Rows dropped at the capacity since the bootstrap (``drop_on_overflow=True``)."""
    return 0 if _state is None else _state.dropped_rows


def _bootstrapped() -> _Bootstrap:
    if _state is None:
        raise RuntimeError("ncclep: ensure_nccl_ep_bootstrapped(...) must run before the first buffer or dispatch")
    return _state


def alloc_ep_symm_buffer(shape: Any, dtype: torch.dtype, ep_group: dist.ProcessGroup) -> torch.Tensor:
    """A zero tensor of ``shape``/``dtype`` on the bootstrapped Buffer's device (``ep_group``'s device when not yet
    bootstrapped): the caller-owned receive buffers of the zero-copy path."""
    device = _state.buffer.device if _state is not None else (
        torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(ep_group) == "nccl" else
        torch.device("cpu"))
    return torch.zeros(shape, dtype=dtype, device=device)


def new_nccl_ep_buffer(top_k: int, max_tokens_per_rank: int, recv_capacity_per_rank: int, hidden_dim: int,
                       num_local_experts: int, alignment: int = 0) -> NcclEpBuffer:
    """The state of one dispatch/combine pair (TE makes a fresh ``EpBuffer`` per dispatch); the shapes must be the
    bootstrap's. ``alignment`` (0 or 1: none) pads each expert's block of rows to a multiple of it."""
    state = _bootstrapped()
    for name, value, bootstrap in (("max_tokens_per_rank", max_tokens_per_rank, state.max_tokens_per_rank),
                                   ("recv_capacity_per_rank", recv_capacity_per_rank, state.recv_capacity_per_rank),
                                   ("hidden_dim", hidden_dim, state.hidden_dim)):
        if value != bootstrap:
            raise ValueError(f"{name}: {value!r} differs from the bootstrap's {bootstrap}")
    if num_local_experts * dist.get_world_size(state.group) != state.num_experts:
        raise ValueError(f"num_local_experts: {num_local_experts} x the group's ranks is not the bootstrap's "
                         f"{state.num_experts} experts")
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 0:
        raise ValueError(f"alignment: expected an int >= 0, got {alignment!r}")
    return NcclEpBuffer(_positive("top_k", top_k), max_tokens_per_rank, recv_capacity_per_rank, hidden_dim,
                        num_local_experts, alignment)


def nccl_ep_dispatch(buffer: NcclEpBuffer, tokens: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                     recv_tokens: torch.Tensor | None = None, recv_topk_weights: torch.Tensor | None = None):
    """Dispatch ``tokens`` ``[T, H]`` (BF16/FP32; FP16 on the ``torch`` transport, carried as FP32) to the experts
    ``topk_idx`` ``[T, K]`` (global ids, int64/int32) names, with ``topk_weights`` ``[T, K]`` float32.

    Returns ``(recv_tokens [C, H], tokens_per_expert [L] int32 (device, aligned), dispatched_probs [C] float32)``,
    C = ``recv_capacity_per_rank``; rows past the layout are zero. Differentiable in ``tokens`` and
    ``topk_weights``. ``recv_tokens``/``recv_topk_weights`` (``[C, H]`` / ``[C]``), when given, are filled too.
    """
    state = _bootstrapped()
    if not isinstance(buffer, NcclEpBuffer):
        raise TypeError(f"buffer: expected the buffer of new_nccl_ep_buffer, got {type(buffer).__name__}")
    if buffer.handle is not None:
        raise ValueError("buffer: it already carries a dispatch (new_nccl_ep_buffer makes one per dispatch)")
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.shape[1] != buffer.hidden_dim:
        raise ValueError(f"tokens: expected [tokens, {buffer.hidden_dim}], got {getattr(tokens, 'shape', None)}")
    if tokens.shape[0] > buffer.max_tokens_per_rank:
        raise ValueError(f"tokens: {tokens.shape[0]} tokens, more than max_tokens_per_rank="
                         f"{buffer.max_tokens_per_rank} of the bootstrap")
    if not isinstance(topk_weights, torch.Tensor) or topk_weights.dtype != torch.float32:
        raise TypeError(f"topk_weights: expected float32, got {getattr(topk_weights, 'dtype', None)}")
    if topk_idx.dim() != 2 or topk_idx.shape[1] != buffer.top_k:
        raise ValueError(f"topk_idx: expected [tokens, {buffer.top_k}] (the buffer's top_k), got "
                         f"{tuple(topk_idx.shape)}")
    options = deepep_shim.current_options()
    rows, probs, tokens_per_expert, handle = ep_autograd.dispatch_experts(
        state.buffer, carried(tokens, options, "tokens"), topk_idx, topk_weights, state.num_experts,
        fp8_dispatch=options.fp8_dispatch, expert_alignment=max(buffer.alignment, 1),
        round_scale=options.round_scale, configs=state.configs)
    rows = as_token_dtype(rows, tokens.dtype)
    num_rows, capacity = sum(tokens_per_expert), buffer.recv_capacity_per_rank
    # Every rank learns every rank's row count: an overflow raises on all of them (NCCL EP would trap).
    counts = [torch.zeros(1, dtype=torch.int64, device=tokens.device) for _ in range(dist.get_world_size(state.group))]
    dist.all_gather(counts, torch.tensor([num_rows], dtype=torch.int64, device=tokens.device), group=state.group)
    over = [(r, int(c)) for r, c in enumerate(counts) if int(c) > capacity]
    if over and not state.drop_on_overflow:
        raise ValueError(f"recv_capacity_per_rank: rank(s) {[r for r, _ in over]} received "
                         f"{[c for _, c in over]} rows, more than the {capacity} the receive buffer holds "
                         f"(raise moe_expert_rank_capacity_factor, or bootstrap with drop_on_overflow=True)")
    state.dropped_rows += max(0, num_rows - capacity)
    buffer.handle, buffer.rows = handle, num_rows
    ends = torch.tensor(tokens_per_expert, dtype=torch.int64, device="cpu").cumsum(0)
    starts = ends - torch.tensor(tokens_per_expert, dtype=torch.int64, device="cpu")
    kept = (ends.clamp(max=capacity) - starts.clamp(max=capacity)).to(torch.int32).to(tokens.device)
    out, out_probs = fit_rows(rows, capacity), fit_rows(probs, capacity)
    for name, given, value in (("recv_tokens", recv_tokens, out), ("recv_topk_weights", recv_topk_weights, out_probs)):
        if given is not None:
            if given.shape != value.shape or given.dtype != value.dtype:
                raise ValueError(f"{name}: expected {value.dtype} {list(value.shape)}, got {given.dtype} "
                                 f"{list(given.shape)}")
            given.copy_(value.detach())
    return out, kept, out_probs


def nccl_ep_combine(buffer: NcclEpBuffer, expert_out: torch.Tensor, num_local_tokens: int | None = None,
                    grad_out: torch.Tensor | None = None) -> torch.Tensor:
    """Sum the (already weighted) expert rows ``expert_out`` ``[C, H]`` back to their tokens, unweighted:
    ``[num_local_tokens, H]`` in the original token order (None: ``max_tokens_per_rank`` rows, the ones past the
    dispatched tokens zero). Rows past the layout (or dropped at the capacity) are ignored. ``grad_out`` (TE's
    zero-copy backward buffer) is accepted; the backward allocates its own. Differentiable."""
    state = _bootstrapped()
    if not isinstance(buffer, NcclEpBuffer) or buffer.handle is None:
        raise ValueError("buffer: expected the buffer of a dispatch (nccl_ep_dispatch) not yet combined")
    capacity = buffer.recv_capacity_per_rank
    if not isinstance(expert_out, torch.Tensor) or expert_out.shape != (capacity, buffer.hidden_dim):
        raise ValueError(f"expert_out: expected [{capacity}, {buffer.hidden_dim}], got "
                         f"{getattr(expert_out, 'shape', None)}")
    num_tokens = buffer.handle.num_tokens
    rows = buffer.max_tokens_per_rank if num_local_tokens is None else num_local_tokens
    if rows < num_tokens:
        raise ValueError(f"num_local_tokens: {rows} is fewer than the {num_tokens} tokens dispatched")
    carried_out = carried(expert_out, deepep_shim.current_options(), "expert_out")
    combined = ep_autograd.combine_experts(state.buffer, fit_rows(carried_out, buffer.rows), buffer.handle,
                                           configs=state.configs)
    return fit_rows(as_token_dtype(combined, expert_out.dtype), rows)
