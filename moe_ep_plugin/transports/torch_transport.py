"""The reference transport: variable-split ``torch.distributed.all_to_all_single`` (gloo on CPU, NCCL on GPU).

Every row a rank sends is one packed byte record (top-k ids, weights, source index, FP8 scales, hidden bytes),
so a dispatch is one count exchange (all_gather, the only host sync) plus one all-to-all of bytes; combine is one
all-to-all back plus an fp32 ``index_add`` in source-rank order.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from .. import fp8
from ..config import Config
from ..handle import DispatchHandle
from ..layout import localize_topk, send_positions
from .base import DispatchArgs, DispatchResult, Transport


@dataclass
class _TorchState:
    """Host-side split sizes and the send order of one dispatch layout."""

    send_idx: torch.Tensor  # [S] int64: local token of each sent row, grouped by destination rank
    send_counts: list[int]
    recv_counts: list[int]


# torch >= 2.13 renames all_gather_into_tensor (the GPU machine runs 2.11).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _row_bytes(t: torch.Tensor) -> int:
    cols = t.element_size()
    for d in t.shape[1:]:
        cols *= d
    return cols


def _as_words(t: torch.Tensor, word: torch.dtype) -> torch.Tensor:
    """``[N, ...]`` tensor → ``[N, words_per_row]`` view in ``word`` elements (int32, or uint8 for odd sizes)."""
    cols = _row_bytes(t) // torch.empty(0, dtype=word).element_size()
    if t.numel() == 0:  # empty tensors keep odd strides through .contiguous(), which .view() rejects
        return torch.empty(t.shape[0], cols, dtype=word, device=t.device)
    # Flatten first: a tensor like x.t() of shape [N, 1] counts as contiguous while its last stride is not 1.
    return t.contiguous().reshape(-1).view(torch.uint8).view(word).reshape(t.shape[0], cols)


def _pack(parts: list[torch.Tensor]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Concatenate ``parts`` per row into one record; returns it and each part's column span.

    Records are int32 words whenever every part has a whole number of words per row: copy kernels move
    4-byte elements several times faster than single bytes (a BF16 row with odd hidden falls back to bytes).
    """
    word = torch.int32 if all(_row_bytes(p) % 4 == 0 for p in parts) else torch.uint8
    views = [_as_words(p, word) for p in parts]
    spans, start = [], 0
    for v in views:
        spans.append((start, start + v.shape[1]))
        start += v.shape[1]
    return (views[0] if len(views) == 1 else torch.cat(views, dim=1)), spans


def _unpack(records: torch.Tensor, span: tuple[int, int], dtype: torch.dtype, cols: int) -> torch.Tensor:
    if records.shape[0] == 0:  # an empty slice counts as contiguous, so .view(dtype) would see the row stride
        return torch.empty(0, cols, dtype=dtype, device=records.device)
    part = records[:, span[0]:span[1]].contiguous()
    return part.view(torch.uint8).view(dtype).reshape(records.shape[0], cols)


def _send_order(is_token_in_rank: torch.Tensor, send_pos: torch.Tensor, send_counts: list[int]) -> torch.Tensor:
    """``[S]`` int64: local token of each sent row, grouped by destination rank, tokens ascending.

    Built by scattering with the (host-known) per-rank offsets, so no ``nonzero`` host sync is needed.
    """
    total = sum(send_counts)
    n, num_ranks = is_token_in_rank.shape
    starts = torch.tensor([sum(send_counts[:r]) for r in range(num_ranks)], dtype=torch.int64)
    starts = starts.to(is_token_in_rank.device)
    pos = send_pos.to(torch.int64) + starts
    pos = torch.where(is_token_in_rank, pos, total)  # unsent pairs land on a dump slot that is sliced off
    order = torch.empty(total + 1, dtype=torch.int64, device=is_token_in_rank.device)
    tokens = torch.arange(n, dtype=torch.int64, device=is_token_in_rank.device).unsqueeze(1).expand(n, num_ranks)
    order.scatter_(0, pos.reshape(-1), tokens.reshape(-1))
    return order[:total]


class TorchTransport(Transport):
    """Works on any device torch.distributed serves; the semantics reference for the kernel transports."""

    name = "torch"

    def _wait(self, work: dist.Work, what: str) -> None:
        """Wait for ``work``; a peer that never joins becomes a ``TimeoutError`` after ``timeout_s``, not a hang."""
        try:
            if self.device.type == "cuda":
                work.wait()
                event = torch.cuda.Event()
                event.record()
                deadline = time.monotonic() + self.timeout_s
                while not event.query():
                    if time.monotonic() > deadline:
                        raise TimeoutError("CUDA event not reached")
                    time.sleep(1e-5)
            else:
                work.wait(timedelta(seconds=self.timeout_s))
        except Exception as exc:  # gloo reports a timeout as RuntimeError/DistBackendError
            raise TimeoutError(f"moe_ep_plugin[{self.name}] rank {self.rank}/{self.num_ranks}: {what} did not complete "
                               f"within {self.timeout_s:g} s (a peer rank never joined or failed): {exc}") from exc

    def _exchange_counts(self, num_tokens_per_rank: torch.Tensor) -> torch.Tensor:
        """All-gather every rank's per-destination counts → ``[R, R]`` int64 matrix ``C[src, dst]`` (on host)."""
        gathered = torch.empty(self.num_ranks * self.num_ranks, dtype=torch.int64, device=self.device)
        work = _all_gather_single(gathered, num_tokens_per_rank.to(torch.int64).contiguous(),
                                           group=self.group, async_op=True)
        self._wait(work, "dispatch count exchange")
        return gathered.view(self.num_ranks, self.num_ranks).cpu()

    def _all_to_all(self, records: torch.Tensor, out_rows: int, out_splits: list[int], in_splits: list[int],
                    what: str) -> torch.Tensor:
        out = records.new_empty(out_rows, records.shape[1])
        if self.num_ranks == 1:
            out.copy_(records)
            return out
        work = dist.all_to_all_single(out, records, out_splits, in_splits, group=self.group, async_op=True)
        self._wait(work, what)
        return out

    def _new_handle(self, args: DispatchArgs) -> DispatchHandle:
        counts = self._exchange_counts(args.num_tokens_per_rank)
        if self.device.type == "cuda":
            counts_dev = counts.to(self.device)
        else:
            counts_dev = counts
        is_token_in_rank = args.is_token_in_rank
        send_counts = counts[self.rank].tolist()
        send_pos = send_positions(is_token_in_rank)
        send_idx = _send_order(is_token_in_rank, send_pos, send_counts)
        recv_counts = counts[:, self.rank].tolist()
        num_recv = sum(recv_counts)
        return DispatchHandle(
            rank_prefix_matrix=counts_dev.cumsum(0).to(torch.int32), is_token_in_rank=is_token_in_rank,
            send_pos=send_pos, recv_src_idx=torch.empty(0, dtype=torch.int32),
            num_tokens=args.x.shape[0], num_recv_tokens=num_recv, num_experts=args.num_experts, rank=self.rank,
            num_ranks=self.num_ranks, num_recv_rows=max(num_recv, args.num_worst_tokens),
            transport_state=_TorchState(send_idx, send_counts, recv_counts))

    def dispatch(self, args: DispatchArgs) -> DispatchResult:
        handle = args.handle if args.handle is not None else self._new_handle(args)
        state: _TorchState = handle.transport_state
        num_recv, rows = handle.num_recv_tokens, handle.num_recv_rows
        if rows < num_recv:
            raise ValueError(f"num_worst_tokens={args.num_worst_tokens} is smaller than the {num_recv} rows rank "
                             f"{self.rank} receives")
        x, hidden = args.x, args.x.shape[1]
        x_scales = args.x_scales
        if args.wire_fp8:
            x, x_scales = fp8.quantize(x, round_scale=args.round_scale)
        parts, names = [], []
        if args.topk_idx is not None:
            parts += [args.topk_idx, torch.arange(x.shape[0], dtype=torch.int32, device=x.device).unsqueeze(1)]
            names += ["topk_idx", "src_idx"]
            if args.topk_weights is not None:
                parts.append(args.topk_weights)
                names.append("topk_weights")
        if x_scales is not None:
            parts.append(x_scales)
            names.append("scales")
        parts.append(x)
        names.append("x")
        records, spans = _pack(parts)
        records = records.index_select(0, state.send_idx)
        received = self._all_to_all(records, num_recv, state.recv_counts, state.send_counts, "dispatch")
        span = dict(zip(names, spans))

        def padded(t: torch.Tensor, fill: float) -> torch.Tensor:
            if rows == num_recv:
                return t
            out = t.new_full((rows,) + tuple(t.shape[1:]), fill)
            out[:num_recv] = t
            return out

        recv_x = padded(_unpack(received, span["x"], x.dtype, hidden), 0)
        recv_scales = None
        if x_scales is not None:
            recv_scales = padded(_unpack(received, span["scales"], torch.float32, x_scales.shape[1]), 0)
            if args.recv_bf16:
                recv_x, recv_scales = fp8.dequantize(recv_x, recv_scales, args.x.dtype), None
        recv_topk_idx = recv_topk_weights = counts = None
        recv_src_idx = handle.recv_src_idx
        if args.topk_idx is not None:
            k = args.topk_idx.shape[1]
            recv_global = _unpack(received, span["topk_idx"], torch.int64, k)
            weights = _unpack(received, span["topk_weights"], torch.float32, k) if args.topk_weights is not None else None
            recv_topk_idx, recv_topk_weights, counts = localize_topk(recv_global, weights, self.rank,
                                                                   handle.num_local_experts)
            recv_topk_idx = padded(recv_topk_idx, -1)
            recv_topk_weights = padded(recv_topk_weights, 0) if recv_topk_weights is not None else None
            recv_src_idx = _unpack(received, span["src_idx"], torch.int32, 1).reshape(-1)
            handle.recv_src_idx = recv_src_idx
        return DispatchResult(recv_x, recv_scales, recv_topk_idx, recv_topk_weights, counts, handle)

    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: Optional[torch.Tensor],
                bias: tuple[torch.Tensor, ...], config: Config) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        state: _TorchState = handle.transport_state
        num_recv = handle.num_recv_tokens
        parts = [x[:num_recv]] + ([topk_weights[:num_recv]] if topk_weights is not None else [])
        records, spans = _pack(parts)
        returned = self._all_to_all(records, len(state.send_idx), state.send_counts, state.recv_counts, "combine")
        # Rows come back grouped by rank in rank order, so index_add sums each token's copies in rank order in fp32.
        hidden = x.shape[1]
        acc = torch.zeros(handle.num_tokens, hidden, dtype=torch.float32, device=x.device)
        acc.index_add_(0, state.send_idx, _unpack(returned, spans[0], x.dtype, hidden).float())
        for b in bias:
            acc += b.float()
        combined_weights = None
        if topk_weights is not None:
            k = topk_weights.shape[1]
            combined_weights = torch.zeros(handle.num_tokens, k, dtype=torch.float32, device=x.device)
            combined_weights.index_add_(0, state.send_idx, _unpack(returned, spans[1], torch.float32, k))
        return acc.to(x.dtype), combined_weights
