"""Megatron-LM dev's ``deepepv2`` flex backend on this library: ``get_elastic_buffer``, ``deepepv2_dispatch`` and
``deepepv2_combine`` (``megatron.core.transformer.moe.fused_a2a``'s contract; megatron-core 0.16-0.19 releases
have no ``deepepv2``, Megatron-LM's dev branch has).

``moe_flex_dispatcher_backend: deepepv2`` makes Megatron's ``_DeepepV2Manager`` call these three names from
``token_dispatcher`` at run time; :func:`moe_ep_plugin.megatron.install` binds them there and in ``fused_a2a`` where
the installed Megatron has them. The buffer is this library's DeepEP V2 :class:`moe_ep_plugin.deep_ep.ElasticBuffer`
on the plugin options' transport (no DeepEP install is needed), and the two functions have the autograd of
Megatron's ``DeepepV2Dispatch`` / ``DeepepV2Combine``: the dispatch's backward is a combine over its handle that
also reduces the probabilities' gradient, the combine's backward is a dispatch replaying the handle.

FP8 dispatch (``PluginOptions.fp8_dispatch``, which Megatron's deepepv2 does not offer) sends the forward dispatch's
rows as blockwise E4M3 with float32 scales (UE8M0-rounded with ``round_scale``) and hands the experts BF16 rows; the
backward passes stay in the rows' dtype. Work runs on the current stream, so ``async_finish`` /
``allocate_on_comm_stream`` are accepted and need no event.

``deepepv2_dispatch(..., do_cpu_sync=False)`` (DeepEP V2's name; Megatron's manager does not pass it) reads nothing on
the host in the dispatch, the combine and both backward passes: the rows come in ``R * num_max_tokens_per_rank``
capacity rows (valid prefix first, local ids -1 and probabilities 0 past it) and ``tokens_per_expert`` stays on the
device. Megatron-LM dev's ``_DeepepV2Manager`` still reads the count on the host after the dispatch (the permute it
inherits from the ``deepep`` manager: ``tokens_per_expert.sum().item()``), so ``install()`` keeps refusing a CUDA
graph holding its dispatch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..deep_ep import ElasticBuffer, EPHandle
from ..ops import fp8
from . import deepep_shim

_elastic_buffer: ElasticBuffer | None = None


def get_elastic_buffer(
    group: dist.ProcessGroup, num_max_tokens_per_rank: int, hidden: int, num_topk: int
) -> ElasticBuffer:
    """The shared :class:`ElasticBuffer` of ``group`` (collective when made): re-made when the group changes or its
    peer memory is too small for rows of ``hidden`` values. That size does not grow with the token count, so ranks
    passing different ``num_max_tokens_per_rank`` (Megatron passes each rank's own) decide alike; each dispatch
    passes its own bound.

    Arguments:
        group: the expert-parallel group (Megatron's TP x EP group).
        num_max_tokens_per_rank: the most tokens a rank dispatches.
        hidden: the hidden size.
        num_topk: experts per token.
    """
    global _elastic_buffer
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group: expected a torch.distributed.ProcessGroup, got {type(group).__name__}")
    options = deepep_shim.current_options()
    num_bytes = ElasticBuffer.get_buffer_size_hint(
        group, num_max_tokens_per_rank=num_max_tokens_per_rank, hidden=hidden, num_topk=num_topk
    )
    buf = _elastic_buffer
    if buf is None or buf.group is not group or buf.num_bytes < num_bytes:
        _elastic_buffer = ElasticBuffer(
            group,
            num_bytes=num_bytes,
            num_max_tokens_per_rank=num_max_tokens_per_rank,
            hidden=hidden,
            num_topk=num_topk,
            transport=options.transport,
            num_cpu_timeout_secs=options.timeout_s,
            ranks_per_node=options.ranks_per_node,
        )
    return _elastic_buffer


def reset_elastic_buffer() -> None:
    """Forget the shared buffer (``uninstall``); the next :func:`get_elastic_buffer` makes a fresh one."""
    global _elastic_buffer
    _elastic_buffer = None


def _forward_rows(x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``x`` as the forward dispatch sends it: the FP8 pair when the plugin options ask for FP8 dispatch."""
    options = deepep_shim.current_options()
    if not options.fp8_dispatch:
        return x
    fp8.check_fp8_hidden(x.shape[1])
    return fp8.quantize(x, round_scale=options.round_scale)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        buffer: ElasticBuffer,
        x: torch.Tensor,
        token_indices: torch.Tensor,
        token_probs: torch.Tensor,
        num_experts: int,
        num_max_tokens_per_rank: int,
        expert_alignment: int,
        num_sms: int,
        do_cpu_sync: bool,
    ) -> tuple:
        recv_x, recv_idx, recv_probs, handle, _ = buffer.dispatch(
            _forward_rows(x),
            topk_idx=token_indices,
            topk_weights=token_probs,
            num_experts=num_experts,
            num_max_tokens_per_rank=num_max_tokens_per_rank,
            expert_alignment=expert_alignment,
            num_sms=num_sms,
            do_cpu_sync=do_cpu_sync,
        )
        if isinstance(recv_x, tuple):
            recv_x = fp8.dequantize(*recv_x, dtype=x.dtype)
        ctx.buffer, ctx.handle = buffer, handle
        ctx.mark_non_differentiable(recv_idx)
        if do_cpu_sync:
            tokens_per_expert = torch.tensor(handle.num_recv_tokens_per_expert_list, dtype=torch.int64, device="cpu")
        else:  # the aligned counts from their inclusive prefix sum, on the device
            psum = handle.psum_num_recv_tokens_per_expert.long()
            tokens_per_expert = torch.diff(psum, prepend=psum.new_zeros(1))
        ctx.mark_non_differentiable(tokens_per_expert)
        return recv_x, recv_idx, recv_probs, tokens_per_expert, handle

    @staticmethod
    def backward(
        ctx: Any, grad_x: torch.Tensor, _grad_idx: Any, grad_probs: torch.Tensor, _grad_counts: Any, _grad_handle: Any
    ) -> tuple:
        grad_in, grad_in_probs, _ = ctx.buffer.combine(
            grad_x.contiguous(), handle=ctx.handle, topk_weights=grad_probs.float(), num_sms=ctx.handle.num_sms
        )
        return None, grad_in, None, grad_in_probs, None, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, buffer: ElasticBuffer, x: torch.Tensor, handle: EPHandle, num_sms: int) -> tuple:
        combined, combined_probs, _ = buffer.combine(x, handle=handle, num_sms=num_sms)
        ctx.buffer, ctx.handle = buffer, handle
        ctx.num_sms = num_sms or handle.num_sms
        return combined, combined_probs

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, _grad_probs: Any) -> tuple:
        grad_x, _, _, _, _ = ctx.buffer.dispatch(grad_out.contiguous(), handle=ctx.handle, num_sms=ctx.num_sms)
        return None, grad_x, None, None


def _check_buffer(buffer: object) -> ElasticBuffer:
    if not isinstance(buffer, ElasticBuffer):
        raise TypeError(f"buffer: expected the ElasticBuffer of get_elastic_buffer, got {type(buffer).__name__}")
    return buffer


def deepepv2_dispatch(
    buffer: ElasticBuffer,
    x: torch.Tensor,
    token_indices: torch.Tensor,
    token_probs: torch.Tensor,
    num_experts: int,
    num_max_tokens_per_rank: int,
    expert_alignment: int = 1,
    num_sms: int = 0,
    async_finish: bool = False,
    allocate_on_comm_stream: bool = False,
    *,
    do_cpu_sync: bool = True,
) -> tuple:
    """Send each token to the ranks of its experts (DeepEP V2's non-expanded layout).

    Arguments:
        buffer: the :func:`get_elastic_buffer` buffer.
        x: ``[T, H]`` BF16 (FP16 and FP32 accepted) tokens.
        token_indices: ``[T, K]`` int64 global expert ids, -1 = none.
        token_probs: ``[T, K]`` float32 routing probabilities.
        num_experts: experts over the group.
        num_max_tokens_per_rank: the most tokens a rank dispatches (Megatron passes this rank's ``T``; 0, a rank
            without tokens, is taken as 1, a bound that still holds).
        expert_alignment: each local expert's count is rounded up to a multiple of it.
        num_sms: SMs of the kernels (0: the buffer's model).
        async_finish, allocate_on_comm_stream: accepted (the work is on the current stream).
        do_cpu_sync: False: nothing read on the host (module docstring); ``num_max_tokens_per_rank`` must then
            bound every rank's tokens (the same on every rank), as it sizes the receiving rows.

    Returns:
        ``(recv_x [R, H], recv_indices [R, K] int64 local ids / -1, recv_probs [R, K] float32,
        tokens_per_expert [L] int64 aligned counts, handle)``; ``tokens_per_expert`` on the CPU, without a CPU sync on
        the device and ``R = num_ranks * num_max_tokens_per_rank``; differentiable in ``x`` and ``token_probs``.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x: expected [tokens, hidden], got {getattr(x, 'shape', type(x).__name__)}")
    if not isinstance(token_probs, torch.Tensor) or token_probs.dtype != torch.float32:
        raise TypeError(f"token_probs: expected float32 (as DeepEP V2), got {getattr(token_probs, 'dtype', None)}")
    if not isinstance(do_cpu_sync, bool):
        raise TypeError(f"do_cpu_sync: expected a bool, got {do_cpu_sync!r}")
    recv_x, *rest = _Dispatch.apply(
        _check_buffer(buffer),
        x.contiguous(),
        token_indices,
        token_probs,
        num_experts,
        num_max_tokens_per_rank or 1,
        expert_alignment,
        num_sms,
        do_cpu_sync,
    )
    return (recv_x, *rest)


def deepepv2_combine(
    buffer: ElasticBuffer,
    x: torch.Tensor,
    handle: EPHandle,
    num_sms: int = 0,
    async_finish: bool = False,
    allocate_on_comm_stream: bool = False,
) -> tuple:
    """Sum the rows ``x`` ``[R, H]`` (one per received token, already weighted and reduced over local experts; the
    dispatch's capacity rows without a CPU sync, the rows past the valid prefix unread) back to their tokens:
    ``(combined [T, H], None)``, unweighted, differentiable in ``x``; nothing read on the host when the dispatch
    read nothing.

    Arguments:
        buffer: the dispatch's buffer.
        x: rows in the dispatch's layout.
        handle: the :func:`deepepv2_dispatch` handle.
        num_sms: SMs of the kernels (0: the handle's).
        async_finish, allocate_on_comm_stream: accepted (the work is on the current stream).
    """
    if not isinstance(handle, EPHandle):
        raise TypeError(f"handle: expected the handle of deepepv2_dispatch, got {type(handle).__name__}")
    combined, combined_probs = _Combine.apply(_check_buffer(buffer), x.contiguous(), handle, num_sms)
    return combined, combined_probs
