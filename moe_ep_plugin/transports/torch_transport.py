"""The reference transport: variable-split ``torch.distributed.all_to_all_single`` (gloo on CPU, NCCL on GPU).

A dispatch is one fixed-size ``all_gather`` of per-rank and per-expert counts and the words every rank checks
(the ranks' agreement on the dispatch's shape, out-of-range ids, the layout, ``num_worst_tokens``, a
rank's refusal of its own bad input: ``refuse``), then the rows in one
``all_to_all_single`` straight from an ``index_select`` of ``x`` in send order (FP8 rows as bytes), and the
small per-row metadata (top-k ids, source index, weights, FP8 scales) in a second one. A cached-handle dispatch
sends the rows (and FP8 scales) only. Combine sends the rows back in one ``all_to_all_single`` and sums each
token's copies in fp32 from its biases, in ``summing_order`` (``permute.unpermute``'s gather-sum: no atomics).
Nothing after the count exchange waits on the host: on NCCL the collectives are ordered on the stream.
``start_dispatch``/``start_combine`` return once the all-to-alls are issued (asynchronous collectives) and hand back
the function that completes them: the hierarchical transport's chunk pipeline runs its node stage in between.
Design and timings: docs/torch_transport.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..config import Config
from ..handle import DispatchHandle
from ..ops import fp8, permute
from ..ops.layout import count_invalid, invalid_ids_error, send_positions, summing_order
from .base import (
    META_FIELDS,
    DispatchArgs,
    DispatchResult,
    Transport,
    bias_sum,
    dispatch_meta,
    layout_contradiction,
    layout_error,
    meta_mismatch,
    negative_counts_error,
    padded,
    refusal_code,
    refusal_error,
    refusal_words,
    refused,
)

# torch >= 2.13 renames all_gather_into_tensor (the GPU machine runs 2.11).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# Experts whose counts ride in the one fixed-size count exchange (DeepSeek-V3 has 256); more take a second one.
INLINE_EXPERTS = 256


@dataclass
class _TorchState:
    """The replay data of one dispatch layout (S = rows this rank sends, N = its tokens).

    ``send_idx`` ``[S]`` int64: local token of each sent row, grouped by destination rank, tokens ascending.
    ``combine_slot`` ``[N, R]`` int32: row of token ``t``'s copy from the rank at position ``j`` of
    ``summing_order`` among the rows combine gets back (laid out exactly like the sent rows), -1 where ``t`` was not
    sent there; ``permute.unpermute`` sums through it column by column.
    """

    send_idx: torch.Tensor
    combine_slot: torch.Tensor
    send_counts: list[int]
    recv_counts: list[int]


class TorchTransport(Transport):
    """Works on any device torch.distributed serves; the semantics reference for the kernel transports."""

    name = "torch"
    checks_peers_each_call = True

    def _timeout_error(self, what: str, exc: Exception | None) -> TimeoutError:
        return TimeoutError(
            f"moe_ep_plugin[{self.name}] rank {self.rank}/{self.num_ranks}: {what} did not complete "
            f"within {self.timeout_s:g} s (a peer rank never joined or failed)"
            + (f": {exc}" if exc is not None else "")
        )

    def _wait(self, work: dist.Work, what: str) -> None:
        """CPU (gloo): the host waits for ``work`` at most ``timeout_s``."""
        try:
            work.wait(timedelta(seconds=self.timeout_s))
        except Exception as exc:  # gloo reports a timeout as RuntimeError/DistBackendError
            raise self._timeout_error(what, exc) from exc

    def _start_all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int], what: str
    ) -> Callable[[], None]:
        """Issue rows of ``inp`` (grouped by destination) → ``out`` (grouped by source), both contiguous; the
        returned function completes the exchange, and work queued before calling it overlaps the transfer."""
        work = dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group, async_op=True)
        if self.device.type == "cuda":
            # Stream-ordered: the current stream waits for NCCL's and the host goes on (NCCL's own timeout covers a
            # lost peer); wait() without a timeout is what a synchronous call does. Waiting with a timeout instead
            # blocked the host for the whole transfer.
            return work.wait
        return lambda: self._wait(work, what)

    def _start_count_exchange(
        self, local: torch.Tensor, what: str = "dispatch count exchange"
    ) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
        """All-gather every rank's ``local`` ``[C]`` int64 counts → ``([R, C]`` on the device, valid in stream
        order; a function that waits at most ``timeout_s`` and returns the matrix on the host``)``. Work queued
        between the two overlaps the exchange; ``what`` names it in the timeout error."""
        gathered = torch.empty(self.num_ranks, local.numel(), dtype=torch.int64, device=self.device)
        if self.device.type != "cuda":
            work = _all_gather_single(gathered.view(-1), local, group=self.group, async_op=True)

            def finish_cpu() -> torch.Tensor:
                self._wait(work, what)
                return gathered

            return gathered, finish_cpu
        _all_gather_single(gathered.view(-1), local, group=self.group)  # stream-ordered, the host goes on
        host = torch.empty(gathered.shape, dtype=torch.int64, device="cpu", pin_memory=True)
        host.copy_(gathered, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()

        def finish_cuda() -> torch.Tensor:
            # Polled rather than synchronized so that a peer that never joins becomes an error, not a hang.
            deadline = time.monotonic() + self.timeout_s
            while not ready.query():
                if time.monotonic() > deadline:
                    raise self._timeout_error(what, None)
                time.sleep(1e-5)
            return host

        return gathered, finish_cuda

    def _check_refusals(self, what: str, codes: list[int], refusal: Exception | None) -> None:
        """When a rank's ``codes[r]`` (its ``refusal_code``, from an exchange every rank joined) is non-zero: exchange
        the refusals' messages (``refusal``: this rank's, or None) and raise ``refusal_error`` on every rank alike."""
        if any(codes):
            read = self._start_count_exchange(refusal_words(refusal, self.device), f"{what} refusal exchange")[1]
            raise refusal_error(what, codes, read().tolist())

    def _count_words(self) -> int:
        """Words each rank sends in a fresh dispatch's count exchange (see ``_start_layout``); the last one is the
        rank's ``refusal_code``."""
        return self.num_ranks + 3 + len(META_FIELDS) + INLINE_EXPERTS + 1

    def refuse(self, call: str, exc: Exception) -> None:
        local = torch.zeros(self._count_words(), dtype=torch.int64, device=self.device)
        local[-1] = refusal_code(exc)
        rows = self._start_count_exchange(local)[1]().tolist()
        self._check_refusals("dispatch", [row[-1] for row in rows], refused(call, exc))

    def _start_layout(self, args: DispatchArgs) -> Callable[[], tuple[DispatchHandle, torch.Tensor, list[int]]]:
        """Launch the first count exchange and the send order; the returned function reads the counts (raising on
        every rank alike when any rank's dispatch is bad: see ``_check_exchanged``), exchanges the per-expert counts
        and returns the handle and the received (row, local expert) pairs per local expert, ``[L]`` int32 and as a
        list.

        The exchange has the same size on every rank (per-rank counts, the words every rank checks: out-of-range
        ids, a contradicting layout, ``num_worst_tokens``, ``dispatch_meta``; then ``INLINE_EXPERTS`` words of
        per-expert counts), so ranks that disagree on ``num_experts`` get an error instead of mismatched
        collectives. With more experts than fit inline a second exchange carries the ``[E]`` counts once every
        rank knows the others agree (a second exchange for every dispatch would double the small collectives)."""
        in_rank, topk = args.is_token_in_rank, args.topk_idx
        n, num_ranks = in_rank.shape
        num_experts, me = args.num_experts, self.rank
        per_rank = args.num_tokens_per_rank.to(torch.int64)
        if topk is not None:
            valid = (topk >= 0) & (topk < num_experts)
            per_expert = torch.zeros(num_experts + 1, dtype=torch.int64, device=topk.device)
            per_expert.scatter_add_(
                0, torch.where(valid, topk, num_experts).reshape(-1), valid.reshape(-1).to(torch.int64)
            )
            per_expert = per_expert[:num_experts]
            invalid = count_invalid(topk, num_experts).to(torch.int64)
        else:  # no top-k: the caller's per-expert counts are what the receivers count
            per_expert = args.num_tokens_per_expert.to(torch.int64)
            invalid = per_rank.new_zeros(1)
        inline = num_experts <= INLINE_EXPERTS
        checks = [
            per_rank,
            invalid,
            layout_contradiction(args),
            torch.tensor([args.num_worst_tokens] + dispatch_meta(args), dtype=torch.int64, device=per_rank.device),
            per_expert if inline else per_expert.new_zeros(0),
            per_expert.new_zeros((INLINE_EXPERTS - num_experts if inline else INLINE_EXPERTS) + 1),
        ]  # + 1: no refusal
        gathered, read_counts = self._start_count_exchange(torch.cat(checks))
        start = num_ranks + 3 + len(META_FIELDS)  # where the inline per-expert counts begin

        # Send order and combine gather map from device data only, overlapping the exchange.
        send_pos = send_positions(in_rank)
        # negative counts (refused at the exchange) must not make negative indices before it
        offsets = per_rank.clamp_min(0)
        row = send_pos.to(torch.int64) + (offsets.cumsum(0) - offsets)  # [N, R]: place in send order if sent
        combine_slot = torch.where(in_rank, row, -1).to(torch.int32)
        if topk is not None:  # columns in the order combine sums the copies (without top-k: rank order already)
            combine_slot = combine_slot.gather(1, summing_order(topk, num_experts, num_ranks, n, in_rank.device))
        order = torch.empty(n * num_ranks + 1, dtype=torch.int64, device=in_rank.device)
        tokens = torch.arange(n, dtype=torch.int64, device=in_rank.device).unsqueeze(1).expand(n, num_ranks)
        order.scatter_(0, torch.where(in_rank, row, n * num_ranks).reshape(-1), tokens.reshape(-1))  # unsent: last
        num_local = num_experts // num_ranks

        def finish() -> tuple[DispatchHandle, torch.Tensor, list[int]]:
            counts = read_counts()
            rows = counts.tolist()
            self._check_refusals("dispatch", [row[-1] for row in rows], None)
            self._check_exchanged(rows, num_experts)
            local_experts = slice(start + me * num_local, start + (me + 1) * num_local)
            gathered_experts, host_experts = gathered, counts
            if not inline:
                gathered_experts, read_experts = self._start_count_exchange(per_expert)
                host_experts = read_experts()  # on CPU the device copy is valid only after this wait
                local_experts = slice(me * num_local, (me + 1) * num_local)
            # From the device copy: on CUDA no host→device copy is needed (and none could run without a sync).
            rank_prefix_matrix = gathered[:, :num_ranks].cumsum(0).to(torch.int32)
            expert_counts = gathered_experts[:, local_experts].sum(0)
            send_counts, recv_counts = counts[me, :num_ranks].tolist(), counts[:num_ranks, me].tolist()
            num_recv = sum(recv_counts)
            state = _TorchState(order[: sum(send_counts)], combine_slot, send_counts, recv_counts)
            handle = DispatchHandle(
                rank_prefix_matrix=rank_prefix_matrix,
                is_token_in_rank=in_rank,
                send_pos=send_pos,
                recv_src_idx=torch.empty(0, dtype=torch.int32, device=in_rank.device),
                num_tokens=n,
                num_recv_tokens=num_recv,
                num_experts=num_experts,
                rank=me,
                num_ranks=num_ranks,
                num_recv_rows=max(num_recv, args.num_worst_tokens),
                topk_idx=topk,
                transport_state=state,
            )
            return handle, expert_counts.to(torch.int32), host_experts[:, local_experts].sum(0).tolist()

        return finish

    def _check_exchanged(self, rows: list[list[int]], num_experts: int) -> None:
        """Raise, on every rank alike (each holds every rank's words), when any rank's dispatch is bad: ranks that
        disagree on ``dispatch_meta``, out-of-range expert ids, a contradicting layout, or a rank receiving more
        rows than its ``num_worst_tokens``."""
        r = self.num_ranks
        error = meta_mismatch([row[r + 3 : r + 3 + len(META_FIELDS)] for row in rows])
        if error is not None:
            raise error
        bad = [i for i, row in enumerate(rows) if row[r]]
        if bad:
            raise invalid_ids_error(bad, num_experts)
        bad = [i for i, row in enumerate(rows) if row[r + 1] == 2]
        if bad:
            raise negative_counts_error(bad)
        bad = [i for i, row in enumerate(rows) if row[r + 1]]
        if bad:
            raise layout_error(bad)
        received = [sum(row[j] for row in rows) for j in range(r)]
        short = [(j, received[j], rows[j][r + 2]) for j in range(r) if 0 < rows[j][r + 2] < received[j]]
        if short:
            raise ValueError(
                "num_worst_tokens: smaller than the rows a rank receives ("
                + ", ".join(f"rank {j}: {got} rows, num_worst_tokens={worst}" for j, got, worst in short)
                + "); every rank raises before any row moves"
            )

    def dispatch(self, args: DispatchArgs) -> DispatchResult:
        return self.start_dispatch(args)()

    def start_dispatch(self, args: DispatchArgs) -> Callable[[], DispatchResult]:
        """Count exchange (the host waits for it), then both all-to-alls issued; the returned function waits for
        them and unpacks the received metadata."""
        finish_layout = self._start_layout(args) if args.handle is None else None
        # Everything up to finish_layout() is queued while the count exchange is in flight.
        x, x_scales = args.x, args.x_scales
        if args.wire_fp8:
            x, x_scales = fp8.quantize(x, round_scale=args.round_scale)
        # Per-token metadata as int32 words: source index (a cached dispatch has it), global top-k ids, weights'
        # bits, scales' bits.
        parts = []
        if args.handle is None:
            parts.append(torch.arange(x.shape[0], dtype=torch.int32, device=x.device).unsqueeze(1))
        if args.topk_idx is not None:
            parts.append(args.topk_idx.to(torch.int32))
            if args.topk_weights is not None:
                parts.append(args.topk_weights.view(torch.int32))
        if x_scales is not None:
            parts.append(x_scales.view(torch.int32))
        meta = None if not parts else parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        if finish_layout is not None:
            handle, expert_counts, host_counts = finish_layout()
        else:
            handle, expert_counts, host_counts = args.handle, None, None
        state: _TorchState = handle.transport_state
        num_recv, rows = handle.num_recv_tokens, handle.num_recv_rows

        # Rows go out as they are (FP8 as bytes: not every backend reduces or moves float8 types).
        wire = x.view(torch.uint8) if x.dtype == fp8.FP8_DTYPE else x
        received = wire.new_empty(rows, wire.shape[1])
        received[num_recv:].zero_()
        waits = [
            self._start_all_to_all(
                received[:num_recv],
                wire.index_select(0, state.send_idx),
                state.recv_counts,
                state.send_counts,
                "dispatch",
            )
        ]
        recv_meta = None
        if meta is not None:
            recv_meta = meta.new_empty(num_recv, meta.shape[1])
            waits.append(
                self._start_all_to_all(
                    recv_meta,
                    meta.index_select(0, state.send_idx),
                    state.recv_counts,
                    state.send_counts,
                    "dispatch metadata",
                )
            )

        def finish() -> DispatchResult:
            for wait in waits:
                wait()
            recv_x = received.view(x.dtype)
            recv_topk_idx = recv_topk_weights = None
            col = 0
            if args.handle is None:
                # row-major even when empty
                handle.recv_src_idx = recv_meta[:, 0].clone(memory_format=torch.contiguous_format)
                col = 1
            if args.topk_idx is not None:
                k, num_local = args.topk_idx.shape[1], handle.num_local_experts
                local = recv_meta[:, col : col + k] - self.rank * num_local  # -1 (no expert) stays negative
                is_local = (local >= 0) & (local < num_local)
                recv_topk_idx = padded(torch.where(is_local, local, -1).to(torch.int64), rows, -1)
                col += k
                if args.topk_weights is not None:
                    weights = torch.where(is_local, recv_meta[:, col : col + k].view(torch.float32), 0.0)
                    recv_topk_weights = padded(weights, rows, 0)
                    col += k
            recv_scales = None
            if x_scales is not None:
                recv_scales = padded(recv_meta[:, col:].view(torch.float32).contiguous(), rows, 0)
                if args.wire_fp8 and not args.fp8_out:
                    recv_x, recv_scales = fp8.dequantize(recv_x, recv_scales, args.x.dtype), None
            return DispatchResult(
                recv_x, recv_scales, recv_topk_idx, recv_topk_weights, expert_counts, handle, host_counts
            )

        return finish

    def _start_return_rows(
        self, rows: torch.Tensor, state: _TorchState, what: str
    ) -> tuple[torch.Tensor, Callable[[], None]]:
        """Issue sending received rows ``[N_recv, C]`` back to their sources → (``[S, C]`` in send order, valid
        once the returned function has run)."""
        back = rows.new_empty(state.send_idx.shape[0], rows.shape[1])
        return back, self._start_all_to_all(back, rows, state.send_counts, state.recv_counts, what)

    def combine(
        self,
        x: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: torch.Tensor | None,
        bias: tuple[torch.Tensor, ...],
        config: Config,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.start_combine(x, handle, topk_weights, bias, config)()

    def start_combine(
        self,
        x: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: torch.Tensor | None,
        bias: tuple[torch.Tensor, ...],
        config: Config,
    ) -> Callable[[], tuple[torch.Tensor, torch.Tensor | None]]:
        """Both all-to-alls issued; the returned function waits for them and sums."""
        state: _TorchState = handle.transport_state
        num_recv = handle.num_recv_tokens
        back, wait = self._start_return_rows(x[:num_recv], state, "combine")
        back_w = wait_w = None
        if topk_weights is not None:
            back_w, wait_w = self._start_return_rows(topk_weights[:num_recv], state, "combine weights")

        def finish() -> tuple[torch.Tensor, torch.Tensor | None]:
            # unpermute's gather-sum is exactly combine's: each token's copies in the slot columns' (summing) order,
            # fp32 from 0.0, rounded once, no atomics (one pass on CUDA); with biases the sum starts from them.
            wait()
            if bias:
                combined = permute.unpermute_onto(bias_sum(bias), back, state.combine_slot).to(x.dtype)
            else:
                combined = permute.unpermute(back, state.combine_slot)
            combined_weights = None
            if back_w is not None:
                wait_w()
                combined_weights = permute.unpermute(back_w, state.combine_slot)
            return combined, combined_weights

        return finish
