"""The ``local`` transport: a group of one rank, where every row a dispatch sends stays on this rank.

The registry (``transports/__init__.py``) picks it for every one-rank group, whatever transport was asked for:
nothing crosses, so no communication kernel runs and no peer buffer is reserved. Results equal the other
transports' at one rank bit for bit: a dispatch receives the tokens that name an expert, in token order (FP8 rows
quantized and, unless ``fp8_out``, dequantized on the way as the senders do); combine sums each token's one
copy in fp32 from 0.0 (``permute.unpermute``, which also adds nothing for a token that was not sent) plus the
biases. An expert-major dispatch lays out ``x`` itself (``permute.expert_slots`` and ``permute.permute``:
kernels on CUDA, torch ops on CPU) and its combine is one ``unpermute``. One host read per fresh dispatch: the
received row count, the out-of-range ids and the counts (on CUDA all three written by the slot kernel); none for a
row-major dispatch whose ``num_worst_tokens`` has room for every token (nothing can be cut off), which a CUDA graph
can then capture.

Low-latency mode at one rank is :class:`LocalLowLatency`: the collectives form's layout and results made by gathers,
with no exchange and no host read (a CUDA graph can capture it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ..config import Config
from ..handle import DispatchHandle, ExpertLayout
from ..ops import fp8, permute
from ..ops.layout import (
    count_invalid,
    dispatch_layout,
    invalid_ids_error,
    kernel_dispatch_layout,
    send_positions,
)
from .base import (
    DispatchArgs,
    DispatchResult,
    ExpertDispatchResult,
    Transport,
    bias_sum,
    layout_contradiction,
    layout_error,
    negative_counts_error,
    padded,
    slot_weights,
)
from .low_latency_base import DispatchOutput, DispatchRequest, LowLatencyHandle
from .low_latency_torch import TorchLowLatency


@dataclass
class _LocalState:
    """Kept in ``DispatchHandle.transport_state``: ``src`` ``[N_recv]`` int64, the token of each received row;
    for an expert-major handle ``slot`` ``[N, K]`` int32, the expert-major rows of every token's top-k columns
    (-1 where none; a token that was not received has none). After a ``num_worst_tokens`` dispatch that read
    nothing, ``src`` is ``[N]`` (the received tokens first) and ``received`` ``[N]`` bool marks its real rows."""

    src: torch.Tensor
    slot: torch.Tensor | None = None
    received: torch.Tensor | None = None


class LocalTransport(Transport):
    """Dispatch and combine of a one-rank ``group`` as local copies (see the module docstring)."""

    name = "local"
    expert_layout_from_topk = True

    def __init__(self, group: dist.ProcessGroup, device: torch.device, timeout_s: float) -> None:
        super().__init__(group, device, timeout_s)
        if self.num_ranks != 1:
            raise ValueError(f"group: the local transport serves a group of one rank, got {self.num_ranks}")

    def get_dispatch_layout(
        self, topk_idx: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if permute.kernels_for(topk_idx):
            return kernel_dispatch_layout(topk_idx.contiguous(), num_experts, 1)
        return dispatch_layout(topk_idx, num_experts, 1)

    # ---- dispatch ----
    def dispatch(self, args: DispatchArgs) -> DispatchResult:
        if args.handle is not None:
            handle = args.handle
            state = _state(handle)
            recv_x, recv_scales = _rows(args, state.src, handle.num_recv_rows, state.received)
            return DispatchResult(recv_x, recv_scales, None, None, None, handle)
        in_rank = args.is_token_in_rank.contiguous()
        topk = args.topk_idx
        if topk is not None:
            per_expert = _expert_counts(topk, args.num_experts)
        else:
            per_expert = args.num_tokens_per_expert.to(torch.int64)
        n = in_rank.shape[0]
        received = None
        if args.num_worst_tokens >= max(n, 1) and not args.layout_given:
            # Room for every token, so nothing is read (a CUDA graph can capture it): the received tokens sort first
            # and the rows after them are padding; out-of-range ids are not reported in this mode (as on nvlink).
            counts = None
            rows = args.num_worst_tokens
            received = torch.arange(n, device=in_rank.device) < in_rank[:, 0].sum()
            src = torch.argsort((~in_rank[:, 0]).to(torch.uint8), stable=True)
        else:
            invalid = (
                count_invalid(topk, args.num_experts).to(torch.int64) if topk is not None else per_expert.new_zeros(1)
            )
            num_recv, counts = self._read(
                torch.cat([in_rank[:, 0].sum(dtype=torch.int64).reshape(1), invalid, per_expert]), args
            )
            if 0 < args.num_worst_tokens < num_recv:
                raise ValueError(
                    f"num_worst_tokens: smaller than the rows a rank receives (rank 0: {num_recv} rows, "
                    f"num_worst_tokens={args.num_worst_tokens}); every rank raises before any row moves"
                )
            rows = max(num_recv, args.num_worst_tokens)
            src = _received(in_rank[:, 0], num_recv)
        handle = _handle(in_rank, src, args, rows, _LocalState(src, received=received))
        recv_x, recv_scales = _rows(args, src, rows, received)
        recv_topk_idx = recv_topk_weights = None
        if topk is not None:
            local = topk.index_select(0, src)
            valid = (local >= 0) & (local < args.num_experts)
            if received is not None:
                valid &= received.unsqueeze(1)
            recv_topk_idx = padded(torch.where(valid, local, -1), rows, -1)
            if args.topk_weights is not None:
                weights = args.topk_weights.index_select(0, src)
                recv_topk_weights = padded(torch.where(valid, weights, 0.0), rows, 0)
        return DispatchResult(
            recv_x, recv_scales, recv_topk_idx, recv_topk_weights, per_expert.to(torch.int32), handle, counts
        )

    def _read(self, words: torch.Tensor, args: DispatchArgs) -> tuple[int, list[int]]:
        """The one host read of a fresh dispatch: ``words`` ``[2 + C]`` int64 on the device (received rows, ids
        outside ``[-1, num_experts)``, then ``C`` counts) → ``(received rows, counts)``; raises for out-of-range ids
        or a layout the caller passed that contradicts itself or the top-k."""
        if args.layout_given:
            words = torch.cat([words, layout_contradiction(args)])
        values = words.tolist()
        if values[1]:
            raise invalid_ids_error([0], args.num_experts)
        if args.layout_given:
            contradiction = values.pop()
            if contradiction == 2:
                raise negative_counts_error([0])
            if contradiction:
                raise layout_error([0])
        return values[0], values[2:]

    def dispatch_experts(self, args: DispatchArgs, alignment: int) -> ExpertDispatchResult:
        """The received rows are ``x``'s rows of the tokens that name an expert, so ``x`` itself is laid out
        expert-major: the slots of every token, the host read, then ``permute`` into the rows the read counted."""
        x, x_scales = _sent_rows(args.x, args.x_scales, args)
        if args.handle is not None:
            handle = args.handle
            layout: ExpertLayout = handle.expert_layout
            slot = _state(handle).slot
            if slot is None:
                raise ValueError("handle: it has no expert-major layout (it did not come from dispatch_experts)")
            rows, _, scales = permute.permute(x, slot, layout.num_rows, None, x_scales)
            return ExpertDispatchResult(rows, scales, None, handle)
        topk, n = args.topk_idx, x.shape[0]
        # The read waits for the slot kernels alone: the permute, launched after it, would hold it back by its
        # whole write of the expert rows.
        slot, words = permute.expert_slots(topk, args.num_experts, alignment)
        num_recv, counts = self._read(words, args)
        num_rows = sum(counts)
        rows, probs, scales = permute.permute(x, slot, num_rows, args.topk_weights, x_scales)
        if num_recv == n:  # every token names an expert (the usual case): no mask to derive
            in_rank = torch.ones(n, 1, dtype=torch.bool, device=x.device)
        else:
            in_rank = (slot >= 0).any(1, keepdim=True)
        src = _received(in_rank[:, 0], num_recv)
        handle = _handle(in_rank, src, args, num_recv, _LocalState(src, slot))
        recv_slot = slot if num_recv == n else slot.index_select(0, src)
        handle.expert_layout = ExpertLayout(recv_slot, counts, num_rows, alignment)
        return ExpertDispatchResult(rows, scales, probs, handle)

    # ---- combine ----
    def combine(
        self,
        x: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: torch.Tensor | None,
        bias: tuple[torch.Tensor, ...],
        config: Config,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # send_pos [N, 1]: each token's received row, -1 when it was not sent: the one copy unpermute sums
        _state(handle)
        slot = handle.send_pos
        combined = permute.unpermute_onto(bias_sum(bias), x, slot).to(x.dtype) if bias else permute.unpermute(x, slot)
        return combined, None if topk_weights is None else permute.unpermute(topk_weights, slot)

    def combine_experts(
        self,
        y: torch.Tensor,
        handle: DispatchHandle,
        expert_weights: torch.Tensor | None,
        bias: tuple[torch.Tensor, ...],
        config: Config,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One ``unpermute`` over every token's slots: a token's sum over its experts is its combined row (the
        fp32 sum of one copy rounds back to itself), 0 for a token without experts; with ``bias``, the biases plus
        that row in fp32, rounded once more (as the other transports' combine of it)."""
        slot = _state(handle).slot
        if slot is None:
            raise ValueError("handle: it has no expert-major layout (it did not come from dispatch_experts)")
        weights = slot_weights(expert_weights, replace(handle.expert_layout, recv_slot=slot))
        combined = permute.unpermute(y, slot)
        return ((bias_sum(bias) + combined.float()).to(y.dtype) if bias else combined), weights


class LocalLowLatency(TorchLowLatency):
    """Low-latency mode of a one-rank group: the collectives form's layout and results (rows of local expert ``l``
    in source-token order, combine summing ``weight * row`` over k ascending in fp32), writing and reading only the
    selected rows (as the kernels do), with no exchange and no host read, so that a CUDA graph can capture it
    (out-of-range expert ids are checked on the host except while a graph is captured; packed UE8M0 scales read
    the host)."""

    name = "local"

    def refuse(self, call: str, exc: Exception, layout: tuple[int, int, int] | None, buffer_set: int) -> None:
        """No peer waits on a one-rank group: the caller raises ``exc`` itself."""

    def _check_ids(self, topk_idx: torch.Tensor, num_experts: int) -> None:
        if topk_idx.is_cuda and torch.cuda.is_current_stream_capturing():
            return
        if int(count_invalid(topk_idx, num_experts)):
            raise invalid_ids_error([0], num_experts)

    def dispatch(self, req: DispatchRequest) -> DispatchOutput:
        x, idx, m, num_experts = req.x, req.topk_idx, req.num_max_dispatch_tokens_per_rank, req.num_experts
        self._check_ids(idx, num_experts)
        n, hidden = x.shape
        valid = (idx >= 0) & (idx < num_experts)
        present = torch.zeros(n, num_experts + 1, dtype=torch.int64, device=x.device)
        present.scatter_(1, torch.where(valid, idx, num_experts), 1)  # a repeated id sends one row
        present = present[:, :num_experts]
        count = present.sum(0)
        # row_of[t, e]: token t's row in the flat [E * M] blocks, E * M (the spare row) where it names no e
        row_of = torch.where(
            present.bool(), torch.arange(num_experts, device=x.device) * m + present.cumsum(0) - 1, num_experts * m
        )
        src = torch.full((num_experts * m + 1,), n, dtype=torch.int64, device=x.device)
        src.scatter_(0, row_of.reshape(-1), torch.arange(n, device=x.device).repeat_interleave(num_experts))
        src = src[:-1]  # [E * M]: the token of each row, n for padding
        rows, scales = x, None
        if req.use_fp8:
            rows, scales = fp8.quantize(x, round_scale=req.round_scale)
            scales = fp8.pack_ue8m0(scales) if req.use_ue8m0 else scales
        # Only the selected rows are written (padding stays unset, as the kernels leave it): row_of[t, idx[t, k]]
        # for each pair, the spare row E * M where the pair names no expert (a repeated id writes its row twice).
        pair_row = torch.where(valid, row_of.gather(1, torch.where(valid, idx, 0)), num_experts * m)
        data = rows.view(torch.uint8)
        recv = data.new_empty((num_experts * m + 1, data.shape[1]))
        recv_scales = None
        if scales is not None:  # column-major in the last two dims, as DeepEP returns them; expert E is the spare
            cols = scales.new_empty((num_experts + 1, scales.shape[1], m))
            recv_scales = cols.transpose(1, 2)
        for k in range(idx.shape[1]):
            recv.index_put_((pair_row[:, k],), data)
            if recv_scales is not None:
                recv_scales.index_put_((pair_row[:, k] // m, pair_row[:, k] % m), scales)
        recv_x = recv[:-1].view(rows.dtype)
        recv_scales = None if recv_scales is None else recv_scales[:-1]
        src_info = torch.where(src < n, src, -1).to(torch.int32).view(num_experts, m)
        handle = LowLatencyHandle(
            src_info, count.view(num_experts, 1), m, hidden, num_experts, n, idx.shape[1], 0, 1, row_of
        )
        return DispatchOutput(
            recv_x.view(num_experts, m, hidden), recv_scales, count.to(torch.int32), handle, lambda: 0
        )

    def combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: LowLatencyHandle,
        zero_copy: bool,
        out: torch.Tensor,
        buffer_set: int,
    ) -> Callable[[], int]:
        self._check_ids(topk_idx, handle.num_experts)
        if zero_copy:
            x = self.combine_buffer(handle, buffer_set)
        row_of: torch.Tensor = handle.transport_state  # [N, E]: the dispatch's row of each (token, expert)
        y = x.reshape(-1, handle.hidden)
        acc = torch.zeros(handle.num_tokens, handle.hidden, dtype=torch.float32, device=x.device)
        for k in range(topk_idx.shape[1]):
            e = topk_idx[:, k]
            # a pair naming no expert reads some row (the last at most) and adds nothing
            rows = row_of.gather(1, e.clamp(0, handle.num_experts - 1).unsqueeze(1)).squeeze(1)
            rows = rows.clamp(max=y.shape[0] - 1)
            acc = torch.where(
                (e >= 0).unsqueeze(1), acc + topk_weights[:, k : k + 1] * y.index_select(0, rows).float(), acc
            )
        out.copy_(acc)
        return lambda: 0

    def clean(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        for buf in self._combine_buffers:
            if buf is not None:
                buf.zero_()


def _state(handle: DispatchHandle) -> _LocalState:
    state = handle.transport_state
    if not isinstance(state, _LocalState):
        raise ValueError("handle: it was not made by the local transport (a dispatch of this Buffer)")
    return state


def _expert_counts(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[E]`` int64: entries of ``topk_idx`` ``[N, K]`` naming each expert (out-of-range ids count nowhere)."""
    flat = topk_idx.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=topk_idx.device)
    counts.scatter_add_(0, torch.where(valid, flat, num_experts), valid.to(torch.int64))
    return counts[:num_experts]


def _received(in_rank: torch.Tensor, num_recv: int) -> torch.Tensor:
    """``[num_recv]`` int64: the tokens with ``in_rank`` ``[N]`` bool, ascending (no host sync)."""
    if num_recv == in_rank.shape[0]:
        return torch.arange(num_recv, dtype=torch.int64, device=in_rank.device)
    return torch.argsort((~in_rank).to(torch.uint8), stable=True)[:num_recv]


def _handle(
    in_rank: torch.Tensor, src: torch.Tensor, args: DispatchArgs, rows: int, state: _LocalState
) -> DispatchHandle:
    """The handle of dispatch ``args`` that received ``src``'s tokens (``in_rank`` ``[N, 1]`` bool) into ``rows``
    rows (after a dispatch that read nothing: ``state.received`` marks them, and the count stays on the device)."""
    num_tokens = in_rank.shape[0]
    if state.received is not None:  # the count stays on the device
        num_recv, prefix = None, in_rank.sum(dtype=torch.int32).reshape(1, 1)
        recv_src = torch.where(state.received, src, -1).to(torch.int32)
    else:
        num_recv = src.shape[0]
        prefix = torch.full((1, 1), num_recv, dtype=torch.int32, device=in_rank.device)
        recv_src = src.to(torch.int32)
    # every token sent: token t is row t, so the send positions are the received tokens themselves
    send_pos = recv_src.view(num_tokens, 1) if num_recv == num_tokens else send_positions(in_rank)
    return DispatchHandle(
        rank_prefix_matrix=prefix,
        is_token_in_rank=in_rank,
        send_pos=send_pos,
        recv_src_idx=recv_src,
        num_tokens=num_tokens,
        num_recv_tokens=num_recv,
        num_experts=args.num_experts,
        rank=0,
        num_ranks=1,
        num_recv_rows=rows,
        topk_idx=args.topk_idx,
        transport_state=state,
    )


def _sent_rows(
    x: torch.Tensor, x_scales: torch.Tensor | None, args: DispatchArgs
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows ``x`` (of ``args.x``) as a sender puts them on the wire and a receiver keeps them: quantized with
    ``wire_fp8`` (and dequantized back unless ``fp8_out``); FP8 input keeps its scales ``x_scales``."""
    if not args.wire_fp8:
        return x, x_scales
    q, scales = fp8.quantize(x, round_scale=args.round_scale)
    if args.fp8_out:
        return q, scales
    return fp8.dequantize(q, scales, x.dtype), None


def _rows(
    args: DispatchArgs, src: torch.Tensor, rows: int, received: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(recv_x [rows, H], recv_scales [rows, H/128] or None)``: the rows of tokens ``src``, zero rows after (and
    where ``received`` ``[len(src)]`` bool is False)."""
    if received is not None:
        # src orders all N tokens: each token's output row is its place in src while received, else none (-1),
        # so one permute stores every received row once and zeroes the rest (no copy of the gathered rows)
        place = torch.where(received, torch.arange(src.shape[0], dtype=torch.int32, device=src.device), -1)
        slot = torch.empty_like(place).index_copy_(0, src, place).unsqueeze(1)
        x, scales = _sent_rows(args.x, args.x_scales, args)
        x, _, scales = permute.permute(x, slot, rows, None, scales)
        return x, scales
    x = (
        args.x.index_select(0, src)
        if args.x.dtype != fp8.FP8_DTYPE
        else args.x.view(torch.uint8).index_select(0, src).view(fp8.FP8_DTYPE)
    )
    scales = None if args.x_scales is None else args.x_scales.index_select(0, src)
    x, scales = _sent_rows(x, scales, args)
    return padded(x, rows, 0), None if scales is None else padded(scales, rows, 0)
