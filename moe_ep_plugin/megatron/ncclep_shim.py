"""Megatron-Core's ``ncclep`` flex backend on this library (the ``fused_a2a`` contract of megatron-core 0.19.2 and of
Megatron-LM main, which wrap TransformerEngine's NCCL EP ``transformer_engine.pytorch.ep``): neither
TransformerEngine's EP build nor NCCL EP is needed.

``_NCCLEPManager`` reads ``ensure_nccl_ep_bootstrapped``, ``new_nccl_ep_buffer``, ``nccl_ep_dispatch``,
``nccl_ep_combine``, ``alloc_ep_symm_buffer`` and (main) ``is_nccl_ep_bootstrapped`` from ``token_dispatcher`` at run
time, and ``destroy_model_parallel`` and main's ``nccl_ep_release_context`` call ``nccl_ep_finalize``;
:func:`moe_ep_plugin.megatron.install` binds each where the installed Megatron has it. The receive side is TE's:
rows packed expert-major (each expert's block aligned to ``alignment``), one float32 probability per row,
``tokens_per_expert`` an int32 device tensor; combine is unweighted and returns tokens in their original order.

Two modes, chosen by the bootstrap's ``recv_capacity_per_rank``:

- static (an int): ``[recv_capacity_per_rank, H]`` rows, sized on the device (``budget.dispatch_topk``: a
  fixed-size receive of ``ranks x max_tokens_per_rank`` rows, expert-major slots on the device): on the ``nvlink``
  transport (``local`` at one rank) nothing is read on the host, forward or backward, so a CUDA graph can hold it.
  Rows past the capacity are dropped and counted on the device. Unless the bootstrap drops on overflow, that is an
  error: :func:`check_over_budget` (collective, one host read; ``moe_ep_plugin.megatron.check_over_budget(model)``
  calls it, the launcher after each optimizer step) raises on every rank naming the capacity (0.19.2: NCCL EP
  traps). Megatron-LM main's call (it passes ``num_topk``) drops on overflow, as main's ``fused_a2a`` asks TE to;
  ``drop_on_overflow`` given explicitly wins; :func:`dropped_rows` counts the drops. Either way each buffer's
  ``total_recv_tokens`` (int64 ``[1]`` on the device) holds the rows the step needed before any drop, which main's
  manager accumulates into ``over_budget``/``required_recv`` and replays with a grown capacity.
- eager (None, Megatron-LM main): each dispatch returns exactly the rows it received, ``[recv_rows, H]``.

FP8 dispatch comes from the plugin options (``PluginOptions.fp8_dispatch``: FP8 on the wire, BF16 rows out), on
every GPU; main's MXFP8 recipes are refused naming them. Symmetric-memory buffers are plain tensors here (this
library's transports bring their own peer memory); zero-copy receive buffers are filled with the rows, and the
returned tensor holds the same values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .. import autograd as ep_autograd
from ..buffer import Buffer
from ..buffer_cache import get_buffer
from ..config import combine_config, dispatch_config, positive_int
from . import budget as row_budget
from . import deepep_shim
from .hybridep_shim import fit_rows


@dataclass
class _Bootstrap:
    group: dist.ProcessGroup
    num_experts: int
    max_tokens_per_rank: int
    recv_capacity_per_rank: int | None  # None: eager mode
    hidden_dim: int
    configs: tuple | None
    drop_on_overflow: bool
    buffer: Buffer
    # rows dropped at the capacity since the bootstrap, int64 [] on the Buffer's device (static mode counts on the
    # device; eager mode drops nothing)
    dropped: torch.Tensor | None = None


_state: _Bootstrap | None = None


@dataclass
class NcclEpBuffer:
    """One dispatch/combine pair's state (TE's ``EpBuffer``): the shapes it was made for and, after the dispatch,
    the layout its combine replays."""

    top_k: int
    max_tokens_per_rank: int
    recv_capacity_per_rank: int | None  # None: eager mode
    hidden_dim: int
    num_local_experts: int
    alignment: int
    handle: Any = None
    rows: int = 0  # rows the combine takes: eager, the rows received; static, the capacity
    total_recv_tokens: torch.Tensor | None = None  # int64 [1] on the device: ``rows``, what TE's EpBuffer reports


def ensure_nccl_ep_bootstrapped(
    ep_group: dist.ProcessGroup,
    num_experts: int,
    max_tokens_per_rank: int,
    recv_capacity_per_rank: int | None = None,
    hidden_dim: int = 0,
    num_sms: int = 0,
    zero_copy: bool = False,
    num_topk: int | None = None,
    drop_on_overflow: bool | None = None,
) -> None:
    """Set up the process-wide state once (collective on ``ep_group``: the shared Buffer); later calls are no-ops
    until :func:`nccl_ep_finalize`. Takes 0.19.2's call (positional up to ``zero_copy``) and main's (keywords, with
    ``num_topk``).

    Arguments:
        ep_group: the expert-parallel group (Megatron's TP x EP group).
        num_experts: experts over the group (a multiple of its size).
        max_tokens_per_rank: the most tokens a rank dispatches.
        recv_capacity_per_rank: rows each rank's receive buffer holds (static mode); None: eager mode.
        hidden_dim: the hidden size.
        num_sms: SMs of the kernels (0: the plugin options' ``num_sms``, else the Buffer's default).
        zero_copy: accepted (receive buffers from :func:`alloc_ep_symm_buffer` are filled in place; static mode).
        num_topk: experts per token (main passes it; validated).
        drop_on_overflow: drop rows past the capacity (counted) instead of raising; None: as the caller's Megatron
            does (main, which passes ``num_topk``: drop in static mode; 0.19.2: raise).
    """
    global _state
    if _state is not None:
        return
    if not isinstance(ep_group, dist.ProcessGroup):
        raise TypeError(f"ep_group: expected a torch.distributed.ProcessGroup, got {type(ep_group).__name__}")
    group_size = dist.get_world_size(ep_group)
    if positive_int(num_experts, "num_experts") % group_size:
        raise ValueError(f"num_experts: {num_experts} is not a multiple of the {group_size} ranks of ep_group")
    positive_int(max_tokens_per_rank, "max_tokens_per_rank")
    positive_int(hidden_dim, "hidden_dim")
    if num_topk is not None:
        positive_int(num_topk, "num_topk")
    if recv_capacity_per_rank is not None:
        positive_int(recv_capacity_per_rank, "recv_capacity_per_rank")
    positive_int(num_sms, "num_sms", 0)
    if drop_on_overflow is None:
        drop_on_overflow = num_topk is not None and recv_capacity_per_rank is not None
    elif not isinstance(drop_on_overflow, bool):
        raise TypeError(f"drop_on_overflow: expected a bool or None, got {drop_on_overflow!r}")
    options = deepep_shim.current_options()
    sms = num_sms or options.num_sms
    configs = None if not sms else (dispatch_config(sms, group_size), combine_config(sms, group_size))
    buffer = get_buffer(
        ep_group, hidden_dim * 2, options.transport, options.timeout_s, ranks_per_node=options.ranks_per_node
    )
    _state = _Bootstrap(
        ep_group,
        num_experts,
        max_tokens_per_rank,
        recv_capacity_per_rank,
        hidden_dim,
        configs,
        drop_on_overflow,
        buffer,
        torch.zeros((), dtype=torch.int64, device=buffer.device),
    )


def is_nccl_ep_bootstrapped() -> bool:
    """Whether the process-wide state is set up (Megatron-LM main asks before re-bootstrapping)."""
    return _state is not None


def nccl_ep_finalize() -> None:
    """Forget the bootstrap (idempotent; the shared Buffer stays with ``buffer_cache``). Main's
    ``nccl_ep_release_context`` calls it: the next bootstrap may pick another capacity or mode."""
    global _state
    _state = None


def dropped_rows() -> int:
    """Rows dropped at the capacity since the bootstrap (one host read: outside a CUDA graph)."""
    return 0 if _state is None else int(_state.dropped)


def check_over_budget() -> None:
    """Raise on every rank of the bootstrapped group when some rank dropped rows at ``recv_capacity_per_rank`` and
    the bootstrap does not drop on overflow (0.19.2's call: NCCL EP traps). Collective (one all-reduce) and one host
    read: call it on every rank where the host waits anyway; a no-op when not bootstrapped."""
    state = _state
    if state is None or state.drop_on_overflow:
        return
    # NCCL reduces on the current GPU, gloo on the host (its ranks may share a GPU)
    nccl = dist.get_backend(state.group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    words = torch.zeros(dist.get_world_size(state.group), dtype=torch.int64, device=device)
    words[dist.get_rank(state.group)] = state.dropped.to(device)
    dist.all_reduce(words, group=state.group)
    state.dropped.zero_()
    over = [(rank, int(count)) for rank, count in enumerate(words.tolist()) if count]
    if over:
        raise ValueError(
            f"recv_capacity_per_rank: rank(s) {[r for r, _ in over]} received {[c for _, c in over]} rows more "
            f"than the {state.recv_capacity_per_rank} the receive buffer holds (those rows were dropped); raise "
            f"moe_expert_rank_capacity_factor, or bootstrap with drop_on_overflow=True"
        )


def _bootstrapped() -> _Bootstrap:
    if _state is None:
        raise RuntimeError("ncclep: ensure_nccl_ep_bootstrapped(...) must run before the first buffer or dispatch")
    return _state


def alloc_ep_symm_buffer(shape: Any, dtype: torch.dtype, ep_group: dist.ProcessGroup) -> torch.Tensor:
    """A zero tensor of ``shape``/``dtype`` on the bootstrapped Buffer's device (``ep_group``'s device when not yet
    bootstrapped): the caller-owned receive buffers of the zero-copy path."""
    device = (
        _state.buffer.device
        if _state is not None
        else (
            torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend(ep_group) == "nccl"
            else torch.device("cpu")
        )
    )
    return torch.zeros(shape, dtype=dtype, device=device)


def new_nccl_ep_buffer(
    top_k: int,
    max_tokens_per_rank: int,
    recv_capacity_per_rank: int | None,
    hidden_dim: int,
    num_local_experts: int,
    alignment: int = 0,
    dispatch_fwd_quant_recipe: Any = None,
    combine_bwd_quant_recipe: Any = None,
) -> NcclEpBuffer:
    """The state of one dispatch/combine pair (TE makes a fresh ``EpBuffer`` per dispatch); the shapes must be the
    bootstrap's (``recv_capacity_per_rank`` None in eager mode). ``alignment`` (0 or 1: none) pads each expert's
    block of rows to a multiple of it. Main's quantization recipes (MXFP8 on the wire) are refused naming them: FP8
    dispatch comes from the plugin options here."""
    for name, recipe in (
        ("dispatch_fwd_quant_recipe", dispatch_fwd_quant_recipe),
        ("combine_bwd_quant_recipe", combine_bwd_quant_recipe),
    ):
        if recipe is not None:
            raise ValueError(
                f"{name}: TransformerEngine's quantized NCCL EP payloads (moe_dispatch_fwd_dtype / "
                f"moe_combine_bwd_dtype 'mxfp8') are not served; use ep_plugin.fp8_dispatch"
            )
    state = _bootstrapped()
    for name, value, bootstrap in (
        ("max_tokens_per_rank", max_tokens_per_rank, state.max_tokens_per_rank),
        ("recv_capacity_per_rank", recv_capacity_per_rank, state.recv_capacity_per_rank),
        ("hidden_dim", hidden_dim, state.hidden_dim),
    ):
        if value != bootstrap:
            raise ValueError(f"{name}: {value!r} differs from the bootstrap's {bootstrap}")
    if num_local_experts * dist.get_world_size(state.group) != state.num_experts:
        raise ValueError(
            f"num_local_experts: {num_local_experts} x the group's ranks is not the bootstrap's "
            f"{state.num_experts} experts"
        )
    positive_int(alignment, "alignment", 0)
    return NcclEpBuffer(
        positive_int(top_k, "top_k"),
        max_tokens_per_rank,
        recv_capacity_per_rank,
        hidden_dim,
        num_local_experts,
        alignment,
    )


def nccl_ep_dispatch(
    buffer: NcclEpBuffer,
    tokens: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    recv_tokens: torch.Tensor | None = None,
    recv_topk_weights: torch.Tensor | None = None,
):
    """Dispatch ``tokens`` ``[T, H]`` (BF16/FP16/FP32) to the experts
    ``topk_idx`` ``[T, K]`` (global ids, int64/int32) names, with ``topk_weights`` ``[T, K]`` float32.

    Returns ``(recv_tokens [C, H], tokens_per_expert [L] int32 (device, aligned), dispatched_probs [C] float32)``,
    C = ``recv_capacity_per_rank`` (eager mode: the rows received); rows past the layout are zero. Differentiable in
    ``tokens`` and ``topk_weights``. ``recv_tokens``/``recv_topk_weights`` (``[C, H]`` / ``[C]``), when given, are
    filled too. ``buffer.total_recv_tokens`` gets the rows received before any drop (module docstring).
    """
    state = _bootstrapped()
    if not isinstance(buffer, NcclEpBuffer):
        raise TypeError(f"buffer: expected the buffer of new_nccl_ep_buffer, got {type(buffer).__name__}")
    if buffer.handle is not None:
        raise ValueError("buffer: it already carries a dispatch (new_nccl_ep_buffer makes one per dispatch)")
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.shape[1] != buffer.hidden_dim:
        raise ValueError(f"tokens: expected [tokens, {buffer.hidden_dim}], got {getattr(tokens, 'shape', None)}")
    if tokens.shape[0] > buffer.max_tokens_per_rank:
        raise ValueError(
            f"tokens: {tokens.shape[0]} tokens, more than max_tokens_per_rank="
            f"{buffer.max_tokens_per_rank} of the bootstrap"
        )
    if not isinstance(topk_weights, torch.Tensor) or topk_weights.dtype != torch.float32:
        raise TypeError(f"topk_weights: expected float32, got {getattr(topk_weights, 'dtype', None)}")
    if topk_idx.dim() != 2 or topk_idx.shape[1] != buffer.top_k:
        raise ValueError(
            f"topk_idx: expected [tokens, {buffer.top_k}] (the buffer's top_k), got {tuple(topk_idx.shape)}"
        )
    options = deepep_shim.current_options()
    capacity = buffer.recv_capacity_per_rank
    alignment = max(buffer.alignment, 1)
    if capacity is None:  # eager mode: exactly the rows received, counted on the host
        rows, probs, tokens_per_expert, handle = ep_autograd.dispatch_experts(
            state.buffer,
            tokens,
            topk_idx,
            topk_weights,
            state.num_experts,
            fp8_dispatch=options.fp8_dispatch,
            expert_alignment=alignment,
            round_scale=options.round_scale,
            configs=state.configs,
        )
        out, out_probs = rows, probs
        capacity = num_rows = sum(tokens_per_expert)
        kept = torch.tensor(tokens_per_expert, dtype=torch.int32).to(tokens.device)
        total = torch.tensor([num_rows], dtype=torch.int64, device=tokens.device)
    else:  # static mode: sized on the device, nothing read on the host
        group_size = dist.get_world_size(state.group)
        budget = row_budget.RowBudget(group_size * buffer.max_tokens_per_rank, capacity)
        rows, out_probs, _, handle, excess = row_budget.dispatch_topk(
            state.buffer,
            budget,
            tokens,
            topk_idx.to(torch.int64),
            topk_weights,
            state.num_experts,
            alignment=alignment,
            fp8_dispatch=options.fp8_dispatch,
            round_scale=options.round_scale,
            configs=state.configs,
        )
        out, num_rows = rows, capacity
        ends = handle.blocks.cumsum(0)
        kept = (ends.clamp(max=capacity) - (ends - handle.blocks).clamp(max=capacity)).to(torch.int32)
        state.dropped += excess
        total = ends[-1:].clone()
    buffer.handle, buffer.rows, buffer.total_recv_tokens = handle, num_rows, total
    for name, given, value in (("recv_tokens", recv_tokens, out), ("recv_topk_weights", recv_topk_weights, out_probs)):
        if given is not None:
            if given.shape != value.shape or given.dtype != value.dtype:
                raise ValueError(
                    f"{name}: expected {value.dtype} {list(value.shape)}, got {given.dtype} {list(given.shape)}"
                )
            given.copy_(value.detach())
    return out, kept, out_probs


def nccl_ep_combine(
    buffer: NcclEpBuffer,
    expert_out: torch.Tensor,
    num_local_tokens: int | None = None,
    grad_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum the (already weighted) expert rows ``expert_out`` ``[C, H]`` (C as the dispatch returned) back to their
    tokens, unweighted:
    ``[num_local_tokens, H]`` in the original token order (None: ``max_tokens_per_rank`` rows, the ones past the
    dispatched tokens zero). Rows past the layout (or dropped at the capacity) are ignored. ``grad_out`` (TE's
    zero-copy backward buffer) is accepted; the backward allocates its own. Differentiable."""
    state = _bootstrapped()
    if not isinstance(buffer, NcclEpBuffer) or buffer.handle is None:
        raise ValueError("buffer: expected the buffer of a dispatch (nccl_ep_dispatch) not yet combined")
    capacity = buffer.rows if buffer.recv_capacity_per_rank is None else buffer.recv_capacity_per_rank
    if not isinstance(expert_out, torch.Tensor) or expert_out.shape != (capacity, buffer.hidden_dim):
        raise ValueError(
            f"expert_out: expected [{capacity}, {buffer.hidden_dim}], got {getattr(expert_out, 'shape', None)}"
        )
    budgeted = isinstance(buffer.handle, row_budget.BudgetHandle)
    num_tokens = (buffer.handle.handle if budgeted else buffer.handle).num_tokens
    rows = buffer.max_tokens_per_rank if num_local_tokens is None else num_local_tokens
    if rows < num_tokens:
        raise ValueError(f"num_local_tokens: {rows} is fewer than the {num_tokens} tokens dispatched")
    if budgeted:
        combined = row_budget.combine(state.buffer, expert_out, buffer.handle, configs=state.configs)
    else:
        combined = ep_autograd.combine_experts(state.buffer, expert_out, buffer.handle, configs=state.configs)
    return fit_rows(combined, rows)
