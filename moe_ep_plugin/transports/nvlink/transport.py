"""The ``nvlink`` transport: custom CUDA kernels (``csrc/``) moving rows between the GPUs of one host.

Every rank owns one peer-visible buffer (``cudaMalloc``, mapped into the other ranks with CUDA IPC) with a
staging region per source rank, sized for the worst case so senders never wait. One dispatch is:
``notify`` (barrier, count exchange → ``rank_prefix_matrix``, send order), one host read of the received row
count (skipped with ``num_worst_tokens``, which makes the dispatch CUDA-graph capturable), then one kernel
whose sender warps write rows (quantized to FP8 on the way when asked) straight into the destination's
region while its receiver warps copy published rows into the outputs. Combine is a barrier plus one kernel
that sends rows back and sums each token's copies in fp32 from its biases, in ``summing_order``. Results equal
the ``torch`` transport's: BF16 rows and FP8 bytes bit for bit, sums in the same order. ``dispatch_experts`` folds the
per-expert counts into notify and ships each row's expert-major destination rows with it (then ``permute``
expands, on all SMs); ``combine_experts`` is ``unpermute`` + ``combine``, and when that combine pulls,
``unpermute`` writes straight into the region the combine pulls from.

Every wait on a peer has a deadline (``timeout_s``, see ``runtime``): the next call on this transport (or the
host read inside a normal dispatch) raises ``TimeoutError`` naming what stalled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from ...config import Config
from ...handle import DispatchHandle, ExpertLayout
from ...ops import permute
from ...ops.layout import count_invalid, invalid_ids_error, kernel_dispatch_layout
from ...ops.library import MAX_EXPERTS, MAX_TOPK, CombineParams, DispatchParams
from ...ops.library import ptr as _ptr
from ..base import DispatchArgs, DispatchResult, ExpertDispatchResult, Transport, refusal_code, slot_weights
from .plan import combine_roles, combine_row_bytes, dispatch_roles, dispatch_slot_bytes, most_received, staging_capacity
from .runtime import NVLinkRuntime
from .state import ExpertState, NVLinkState, info_address, meta_words

_T = TypeVar("_T")


@dataclass
class _CombineLaunch:
    """A combine ready to launch but for ``params.x``: its outputs (``out`` ``[N, H]``, ``out_weights`` ``[N, K]``
    float32 or None) and ``keep``, what the parameters point to that must live until the launch."""

    params: CombineParams
    out: torch.Tensor
    out_weights: torch.Tensor | None
    keep: tuple


class NVLinkTransport(Transport):
    """Intranode kernels over CUDA-IPC peer memory; ``num_nvl_bytes`` raises the staging size above the default.

    How rows cross NVLink is decided per call from ``config.nvlink`` (``NVLinkTuning``) by ``plan``: sender warps
    storing rows into the peer's region (push), receivers loading them from the source's own region (pull), or,
    for combine with few SMs, the copy engines. Measured on 2 x H200 (benchmarks/RESULTS.md): at 24 SMs pulling is
    faster for BF16 dispatch and for combine, slower for a quantizing dispatch; below 20 SMs the copy engines
    carrying all of combine are 1.4-2.2x faster than SM stores. A pull combine costs two more launches (the copy
    into the own region and a second barrier), hence its minimum size; the expert-major ``combine_experts`` skips
    the copy: after the start barrier its ``unpermute`` writes the received rows into the own region directly
    (``x_in_region``).
    """

    name = "nvlink"
    expert_layout_from_topk = True

    @staticmethod
    def unavailable_reason(group: dist.ProcessGroup, device: torch.device) -> str | None:
        """Why the kernels cannot serve ``group`` (None when they can). Collective: every rank must call it."""
        return NVLinkRuntime.unavailable_reason(group, device)

    def __init__(
        self,
        group: dist.ProcessGroup,
        device: torch.device,
        timeout_s: float,
        num_nvl_bytes: int = 0,
        runtime: NVLinkRuntime | None = None,
    ) -> None:
        """``runtime``: the peer memory and library calls to use (default: a new :class:`NVLinkRuntime` over
        ``group``, collective); the rank, group size and device are the runtime's."""
        rt = runtime if runtime is not None else NVLinkRuntime(group, device, timeout_s, num_nvl_bytes)
        self.group, self.rank, self.num_ranks, self.timeout_s = group, rt.rank, rt.num_ranks, timeout_s
        self._rt = rt
        self.device = rt.device
        self._recv_guess = 0  # receive rows a dispatch allocates before it reads the count

    def check_error(self) -> None:
        """Raise if a kernel on this rank recorded a failure (sticky; after a timeout the CUDA context is lost)."""
        self._rt.check_error()

    def peer_region(self, peer: int) -> tuple[int, int]:
        """``(device address, bytes)`` of this rank's staging region in ``peer``'s buffer, through the CUDA-IPC
        mapping the kernels write through (benchmarks/sm_sweep.py copies there for its yardstick)."""
        return self._rt.peer_region(peer), self._rt.region_bytes

    def _num_sms(self, config: Config) -> int:
        return min(config.num_sms, self._rt.device_sms)

    def _check_capacity(self, rows: int, slot_bytes: int, what: str) -> None:
        capacity = staging_capacity(self._rt.region_bytes, slot_bytes)
        if rows > capacity:
            raise ValueError(
                f"{what}: {rows} rows per rank exceed the nvlink staging capacity of {capacity} rows of "
                f"{slot_bytes} bytes; pass a larger num_nvl_bytes to Buffer"
            )

    def destroy(self) -> None:
        """Free the peer buffer after every rank is done with it (collective)."""
        self._rt.destroy()

    # ---- layout ----
    def get_dispatch_layout(
        self, topk_idx: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return kernel_dispatch_layout(topk_idx, num_experts, self.num_ranks)

    # ---- dispatch ----
    def _notify(self, args: DispatchArgs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Barrier + count exchange (token counts into the rank prefix matrix, out-of-range expert ids, the
        ``dispatch_meta`` words every rank checks, and without top-k the per-expert counts) into ``info``
        (csrc/moe_ep.h); returns notify's outputs: the rank prefix matrix ``[R, R]`` directly followed by ``info``
        ``[2]`` (``[2 + L]`` without top-k; one host read brings both), ``send_pos`` ``[N, R]``, the send list
        ``[R, max(N, 1)]``, all int32."""
        in_rank = args.is_token_in_rank.contiguous()
        n, r = in_rank.shape[0], self.num_ranks
        if args.layout_given:  # derived, not trusted: a count contradicting is_token_in_rank would read past the rows
            counts = in_rank.sum(0, dtype=torch.int32)
        else:
            counts = args.num_tokens_per_rank
            if counts.dtype != torch.int32 or counts.device != self.device or not counts.is_contiguous():
                counts = counts.to(device=self.device, dtype=torch.int32).contiguous()
        invalid = (
            count_invalid(args.topk_idx, args.num_experts)
            if args.topk_idx is not None
            else torch.zeros(1, dtype=torch.int32, device=self.device)
        )
        per_expert = None
        if args.topk_idx is None:
            if args.num_experts > MAX_EXPERTS:
                raise ValueError(
                    f"num_tokens_per_expert: a dispatch without top-k on nvlink exchanges at most "
                    f"{MAX_EXPERTS} experts' counts, got {args.num_experts}"
                )
            per_expert = args.num_tokens_per_expert.to(device=self.device, dtype=torch.int32).contiguous()
        info = 2 + (args.num_experts // r if per_expert is not None else 0)
        prefix, send_pos, send_list = self._int32((r * r + info,), (n, r), (r, max(n, 1)))
        self._rt.notify_dispatch(
            _ptr(counts),
            _ptr(invalid),
            _ptr(in_rank),
            n,
            max(n, 1),
            prefix.data_ptr(),
            send_pos.data_ptr(),
            send_list.data_ptr(),
            info_address(prefix, r),
            meta_words(args).array,
            _ptr(per_expert),
            args.num_experts,
        )
        return prefix, send_pos, send_list

    def refuse(self, call: str, exc: Exception) -> None:
        """Join the peers' notify with this rank's refusal (``NVLinkRuntime.notify_refusal``), unless an error is
        recorded already (the peers' next calls end on their own records); the caller raises ``exc``."""
        if not self._rt.error[0]:
            self._rt.notify_refusal(refusal_code(exc))

    def _int32(self, *shapes: tuple[int, ...]) -> list[torch.Tensor]:
        return [torch.empty(shape, dtype=torch.int32, device=self.device) for shape in shapes]

    def _prefix_matrix(self, prefix: torch.Tensor) -> torch.Tensor:
        """The rank prefix matrix ``[R, R]`` int32 at the start of notify's ``prefix``."""
        return prefix[: self.num_ranks * self.num_ranks].view(self.num_ranks, self.num_ranks)

    def _speculate(
        self, prefix: torch.Tensor, info_length: int, num_experts: int, launch: Callable[[], _T]
    ) -> tuple[_T, list[int], list[int], bool]:
        """The one host read of a fresh dispatch around its speculative kernel: start reading notify's outputs at
        ``prefix`` (the rank prefix matrix ``[R, R]``, then ``info[:info_length]``), ``launch()`` the dispatch
        kernel into receive buffers of ``self._recv_guess`` rows (the most any rank received so far) while the read
        runs, then wait. Returns ``(launch's result, host_counts, info, fits)``. Raises (every rank alike) when a
        rank found out-of-range expert ids. When some rank received more rows than the guess, the guess grows to
        that and ``fits`` is False: every rank (each sees the whole count matrix) then dispatches again."""
        r = self.num_ranks
        guess = self._recv_guess
        wait = self._rt.start_read(prefix.data_ptr(), r * r + info_length)
        launched = launch()
        values = wait()
        self.check_error()
        prefix, info = values[: r * r], values[r * r :]
        if info[1]:
            raise invalid_ids_error([i for i in range(r) if info[1] >> i & 1], num_experts)
        # row minus the one above
        counts = prefix[:r] + [below - above for above, below in zip(prefix, prefix[r:], strict=False)]
        most = most_received(counts, r)
        if most > guess:
            self._recv_guess = most
        return launched, counts, info, most <= guess

    def _check_rows(self, args: DispatchArgs) -> int:
        """Validate what the kernels need of a dispatch's rows; returns the staged slot size."""
        x = args.x
        n, hidden = x.shape
        fp8_rows = args.x_scales is not None or args.wire_fp8
        k = args.topk_idx.shape[1] if args.topk_idx is not None else 0
        if k > MAX_TOPK:
            raise ValueError(f"topk_idx: the nvlink kernels take at most {MAX_TOPK} experts per token, got {k}")
        if (hidden * (1 if fp8_rows else x.element_size())) % 16:
            raise ValueError(
                f"x: the nvlink kernels need rows of a multiple of 16 bytes, got hidden={hidden} {x.dtype}"
            )
        slot = dispatch_slot_bytes(hidden, x.element_size(), fp8_rows, k)
        self._check_capacity(n, slot, "x")
        return slot

    def _launch_dispatch(
        self,
        args: DispatchArgs,
        handle: DispatchHandle,
        topk_idx: torch.Tensor | None,
        recv_x: torch.Tensor | None,
        recv_scales: torch.Tensor | None,
        topk_weights: torch.Tensor | None,
        alignment: int = 1,
        **outputs: int,
    ) -> None:
        """One dispatch kernel; ``outputs``: the mode's remaining ``moe_ep_dispatch_params`` fields, addresses as
        ints (passed to the struct's constructor with the rest: no attribute set per field)."""
        x = args.x
        n, hidden = x.shape
        state: NVLinkState = handle.transport_state
        tuning = args.config.nvlink
        num_sms = self._num_sms(args.config)
        pull, warps = dispatch_roles(tuning, args.wire_fp8, args.fp8_out)
        params = DispatchParams(
            x=x.data_ptr(),
            x_scales=_ptr(args.x_scales),
            topk_idx=_ptr(topk_idx),
            topk_weights=_ptr(topk_weights),
            rank_prefix_matrix=handle.rank_prefix_matrix.data_ptr(),
            send_list=state.send_list.data_ptr(),
            recv_x=_ptr(recv_x),
            recv_scales=_ptr(recv_scales),
            num_tokens=n,
            hidden=hidden,
            x_elem_bytes=x.element_size(),
            num_topk=topk_idx.shape[1] if topk_idx is not None else 0,
            num_local_experts=args.num_experts // self.num_ranks,
            list_stride=state.send_list.shape[1],
            num_recv_rows=handle.num_recv_rows,
            wire_fp8=int(args.wire_fp8),
            fp8_in=int(args.x_scales is not None),
            fp8_out=int(args.fp8_out),
            round_scale=int(args.round_scale),
            num_sms=num_sms,
            num_send_warps=warps,
            num_send_blocks=0,
            pull=int(pull),
            send_pos=handle.send_pos.data_ptr(),
            alignment=alignment,
            **outputs,
        )
        self._rt.dispatch(params)

    def _replay_barrier(self, handle: DispatchHandle) -> NVLinkState:
        """Start of a cached dispatch: the runtime's barrier, for a handle of this transport."""
        state = handle.transport_state
        if not isinstance(state, NVLinkState):
            raise ValueError("handle: it was not made by the nvlink transport")
        self._rt.barrier()
        return state

    def dispatch(self, args: DispatchArgs) -> DispatchResult:
        """Notify, then the dispatch kernel. With a handle: its barrier and the kernel. With ``num_worst_tokens``:
        outputs of that many rows and no host read. Otherwise the kernel starts right after notify with outputs of
        the most rows any rank received so far, while the host reads the counts; the outputs are views of their
        first ``num_recv`` rows, and when some rank received more every rank dispatches again with outputs that
        fit (each sees the whole count matrix, so all agree)."""
        self.check_error()
        self._check_rows(args)
        n = args.x.shape[0]
        if args.handle is not None:
            self._replay_barrier(args.handle)
            return self._dispatch_rows(args, args.handle)
        prefix, send_pos, send_list = self._notify(args)
        worst = args.num_worst_tokens > 0  # no host read, so out-of-range ids are not reported in this mode
        handle = DispatchHandle(
            rank_prefix_matrix=self._prefix_matrix(prefix),
            is_token_in_rank=args.is_token_in_rank.contiguous(),
            send_pos=send_pos,
            recv_src_idx=None,  # set by _dispatch_rows, which makes it
            num_tokens=n,
            num_recv_tokens=None,
            num_experts=args.num_experts,
            rank=self.rank,
            num_ranks=self.num_ranks,
            num_recv_rows=args.num_worst_tokens if worst else self._recv_guess,
            topk_idx=args.topk_idx,
            transport_state=NVLinkState(prefix, send_list),
        )
        if worst:
            return _without_topk_counts(self.num_ranks, args, self._dispatch_rows(args, handle), prefix, None)
        num_local = args.num_experts // self.num_ranks
        result, handle.transport_state.host_counts, info, fits = self._speculate(
            prefix,
            2 + (num_local if args.topk_idx is None else 0),
            args.num_experts,
            lambda: self._dispatch_rows(args, handle, speculative_rows=1),
        )
        num_recv = handle.num_recv_tokens = handle.num_recv_rows = info[0]
        if not fits:
            self._replay_barrier(handle)
            return _without_topk_counts(self.num_ranks, args, self._dispatch_rows(args, handle), prefix, info)
        handle.recv_src_idx = handle.recv_src_idx[:num_recv]
        cut = [
            None if t is None else t[:num_recv]
            for t in (result.recv_x, result.recv_scales, result.recv_topk_idx, result.recv_topk_weights)
        ]
        return _without_topk_counts(
            self.num_ranks, args, DispatchResult(*cut, result.num_recv_tokens_per_expert, handle), prefix, info
        )

    def _dispatch_rows(self, args: DispatchArgs, handle: DispatchHandle, speculative_rows: int = 0) -> DispatchResult:
        """Outputs of ``handle.num_recv_rows`` rows and the dispatch kernel into them."""
        recv_x, recv_scales = _recv_tensors(args, self.device, handle.num_recv_rows)
        has_topk = args.topk_idx is not None
        k = args.topk_idx.shape[1] if has_topk else 0
        rows = handle.num_recv_rows
        recv_topk_idx = torch.empty(rows, k, dtype=torch.int64, device=self.device) if has_topk else None
        recv_topk_weights = (
            torch.empty(rows, k, dtype=torch.float32, device=self.device)
            if has_topk and args.topk_weights is not None
            else None
        )
        expert_counts = (
            torch.zeros(args.num_experts // self.num_ranks, dtype=torch.int32, device=self.device) if has_topk else None
        )
        recv_src_idx = torch.empty(rows, dtype=torch.int32, device=self.device)
        self._launch_dispatch(
            args,
            handle,
            args.topk_idx,
            recv_x,
            recv_scales,
            args.topk_weights,
            recv_topk_idx=_ptr(recv_topk_idx),
            recv_topk_weights=_ptr(recv_topk_weights),
            recv_src_idx=recv_src_idx.data_ptr(),
            recv_expert_count=_ptr(expert_counts),
            speculative_rows=speculative_rows,
        )
        if args.handle is None or has_topk:
            handle.recv_src_idx = recv_src_idx
        return DispatchResult(recv_x, recv_scales, recv_topk_idx, recv_topk_weights, expert_counts, handle)

    def dispatch_experts(self, args: DispatchArgs, alignment: int) -> ExpertDispatchResult:
        """One notify kernel derives the whole layout from top-k (no layout step) and also exchanges per-expert
        counts, so every sender knows the row each (token, expert) pair takes in the receiver's expert-major
        layout and ships it with the token: the receivers record those rows and the weights there, and
        ``permute.permute`` (all SMs) expands the received rows. One host read in all (the received row count and
        the per-expert counts together), taken while the dispatch kernel already runs: that kernel is launched
        right after notify with receive buffers of the most rows any rank received so far; when a rank receives
        more, every rank (each sees the whole count matrix) dispatches once more with buffers that fit."""
        self.check_error()
        self._check_rows(args)
        if args.handle is not None:
            return self._expert_dispatch(args, args.handle, None)
        num_experts = args.num_experts
        if num_experts > MAX_EXPERTS:
            raise ValueError(
                f"num_experts: the nvlink expert-major kernels take at most {MAX_EXPERTS} experts, got {num_experts}"
            )
        topk_idx = args.topk_idx
        (n, k), r = topk_idx.shape, self.num_ranks
        num_local = num_experts // r
        # The dispatch kernel starts before the counts are on the host, with receive buffers of `guess` rows
        # (see _speculate); it writes recv_src_idx and recv_slot by address.
        guess = self._recv_guess
        prefix, send_offset, send_pos, send_list, expert_pos, recv_src_idx, recv_slot = self._int32(
            (r * r + 4 + 2 * num_local,), (num_experts,), (n, r), (r, max(n, 1)), (n, k), (guess,), (guess, k)
        )
        in_rank = torch.empty(n, r, dtype=torch.bool, device=self.device)
        # One kernel from top-k to the whole layout (counts, exchange, send order, expert-major positions).
        self._rt.notify_experts(
            _ptr(topk_idx),
            n,
            k,
            num_experts,
            alignment,
            max(n, 1),
            prefix.data_ptr(),
            send_pos.data_ptr(),
            send_list.data_ptr(),
            _ptr(in_rank),
            expert_pos.data_ptr(),
            send_offset.data_ptr(),
            info_address(prefix, r),
            meta_words(args).array,
        )
        state = NVLinkState(prefix, send_list, None, ExpertState(topk_idx, expert_pos, send_offset))
        handle = DispatchHandle(
            rank_prefix_matrix=self._prefix_matrix(prefix),
            is_token_in_rank=in_rank,
            send_pos=send_pos,
            recv_src_idx=None,
            num_tokens=n,
            num_recv_tokens=None,
            num_experts=num_experts,
            rank=self.rank,
            num_ranks=r,
            num_recv_rows=guess,
            topk_idx=topk_idx,
            transport_state=state,
        )

        def launch() -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
            recv_x, recv_scales = _recv_tensors(args, self.device, guess)
            probs = (
                torch.empty(guess * k + num_local * alignment, dtype=torch.float32, device=self.device)
                if args.topk_weights is not None
                else None
            )  # the most M can be
            self._launch_expert_dispatch(
                args,
                handle,
                recv_x,
                recv_scales,
                recv_src_idx,
                recv_slot,
                probs,
                alignment,
                args.topk_weights,
                speculative_rows=1,
            )
            return recv_x, recv_scales, probs

        launched, state.host_counts, info, fits = self._speculate(prefix, 3 + num_local, num_experts, launch)
        num_recv, num_rows, tokens_per_expert = info[0], info[2], info[3 : 3 + num_local]
        handle.num_recv_tokens = handle.num_recv_rows = num_recv
        if not fits:
            handle.recv_src_idx, recv_slot = self._int32((num_recv,), (num_recv, k))
            handle.expert_layout = ExpertLayout(recv_slot, tokens_per_expert, num_rows, alignment)
            return self._expert_dispatch(args, handle, args.topk_weights)
        recv_x, recv_scales, probs = launched
        handle.recv_src_idx = recv_src_idx[:num_recv]
        handle.expert_layout = ExpertLayout(recv_slot[:num_recv], tokens_per_expert, num_rows, alignment)
        x, _, scales = permute.permute(recv_x, handle.expert_layout.recv_slot, num_rows, None, recv_scales)
        return ExpertDispatchResult(x, scales, None if probs is None else probs[:num_rows], handle)

    def _launch_expert_dispatch(
        self,
        args: DispatchArgs,
        handle: DispatchHandle,
        rows: torch.Tensor,
        scales: torch.Tensor | None,
        recv_src_idx: torch.Tensor,
        recv_slot: torch.Tensor,
        probs: torch.Tensor | None,
        alignment: int,
        weights: torch.Tensor | None,
        speculative_rows: int = 0,
    ) -> None:
        """The expert-major dispatch kernel into the received rows ``rows`` ``[rows, H]`` and ``scales``
        ``[rows, H/128]`` float32 (FP8 rows) or None, writing ``recv_src_idx`` and ``recv_slot``."""
        expert: ExpertState = handle.transport_state.expert
        self._launch_dispatch(
            args,
            handle,
            expert.topk_idx,
            rows,
            scales,
            weights,
            alignment,
            recv_src_idx=recv_src_idx.data_ptr(),
            expert_major=1,
            expert_pos=expert.expert_pos.data_ptr(),
            send_offset=expert.send_offset.data_ptr(),
            expert_info=info_address(handle.transport_state.prefix, self.num_ranks),
            recv_slot=recv_slot.data_ptr(),
            expert_probs=_ptr(probs),
            speculative_rows=speculative_rows,
        )

    def _expert_dispatch(
        self, args: DispatchArgs, handle: DispatchHandle, weights: torch.Tensor | None
    ) -> ExpertDispatchResult:
        """Replay ``handle``'s expert-major dispatch (a barrier, the kernel, then permute), with ``weights`` (the
        forward's, whose probs it returns) or without (a cached dispatch: its probs are the caller's)."""
        if weights is None:
            state = handle.transport_state
            if not isinstance(state, NVLinkState) or state.expert is None:
                raise ValueError(
                    "handle: it has no nvlink expert-major state (it did not come from "
                    "NVLinkTransport.dispatch_experts)"
                )
        layout: ExpertLayout = handle.expert_layout
        self._replay_barrier(handle)
        rows, scales = _recv_tensors(args, self.device, handle.num_recv_rows)
        probs = torch.empty(layout.num_rows, dtype=torch.float32, device=self.device) if weights is not None else None
        # A replay rewrites recv_slot and recv_src_idx with the values they already hold.
        self._launch_expert_dispatch(
            args, handle, rows, scales, handle.recv_src_idx, layout.recv_slot, probs, layout.alignment, weights
        )
        x, _, scales = permute.permute(rows, layout.recv_slot, layout.num_rows, None, scales)
        return ExpertDispatchResult(x, scales, probs, handle)

    # ---- combine ----
    def _combine_launch(
        self,
        hidden: int,
        dtype: torch.dtype,
        handle: DispatchHandle,
        topk_weights: torch.Tensor | None,
        bias: tuple[torch.Tensor, ...],
        config: Config,
    ) -> _CombineLaunch:
        """Validate a combine of ``handle.num_recv_rows`` rows ``[hidden]`` of ``dtype``, allocate its outputs and
        pick how rows travel (``plan.combine_roles``); ``params.x`` is left for the caller."""
        elem_bytes = dtype.itemsize
        k = topk_weights.shape[1] if topk_weights is not None else 0
        if k > MAX_TOPK:
            raise ValueError(f"topk_weights: the nvlink kernels take at most {MAX_TOPK} columns, got {k}")
        if (hidden * elem_bytes) % 16:
            raise ValueError(f"x: the nvlink kernels need rows of a multiple of 16 bytes, got hidden={hidden} {dtype}")
        self._check_capacity(handle.num_tokens, combine_row_bytes(hidden, elem_bytes, k), "x")
        state = handle.transport_state
        own = isinstance(state, NVLinkState)
        if own:  # this transport's views of notify's int32 output: nothing to convert
            rpm, send_pos = handle.rank_prefix_matrix, handle.send_pos
        else:
            rpm, send_pos = (
                t
                if t.dtype == torch.int32 and t.device == self.device and t.is_contiguous()
                else t.to(device=self.device, dtype=torch.int32).contiguous()
                for t in (handle.rank_prefix_matrix, handle.send_pos)
            )
        out = torch.empty(handle.num_tokens, hidden, dtype=dtype, device=self.device)
        out_weights = (
            torch.empty(handle.num_tokens, k, dtype=torch.float32, device=self.device)
            if topk_weights is not None
            else None
        )
        num_sms = self._num_sms(config)
        host_counts = state.host_counts if own else None  # read by this transport's own dispatches
        row_bytes = hidden * elem_bytes
        pull, copy_engine, warps, blocks = combine_roles(
            config.nvlink,
            num_sms,
            None if host_counts is None else most_received(host_counts, self.num_ranks),
            row_bytes,
            lambda: self._rt.pull_rows(row_bytes, k),
        )
        # copy engine and pull: where each peer's rows sit in x (kept alive in the result until the launch)
        counts = state.copy_counts() if copy_engine or pull else None
        order = _summing_order_source(handle, self.device)
        params = CombineParams(
            topk_weights=_ptr(topk_weights),
            rank_prefix_matrix=rpm.data_ptr(),
            send_pos=send_pos.data_ptr(),
            bias0=_ptr(bias[0]) if len(bias) > 0 else 0,
            bias1=_ptr(bias[1]) if len(bias) > 1 else 0,
            out=out.data_ptr(),
            out_weights=_ptr(out_weights),
            num_tokens=handle.num_tokens,
            hidden=hidden,
            dtype=permute.DTYPE_CODES[dtype],  # what the kernel sums in fp32 and rounds the sum to
            num_topk=k,
            num_recv_rows=handle.num_recv_rows,
            num_sms=num_sms,
            num_send_warps=warps,
            num_send_blocks=blocks,
            host_counts=0 if counts is None else counts.address,
            pull=int(pull),
            topk_idx=_ptr(order),
            idx_topk=0 if order is None else order.shape[1],
            num_local_experts=handle.num_local_experts,
        )
        if copy_engine:
            params.copy_engine = 1
            params.copy_piece_rows, params.copy_streams = config.nvlink.copy_piece_rows, config.nvlink.copy_streams
        return _CombineLaunch(params, out, out_weights, (counts, rpm, send_pos, topk_weights, order))

    def _launch_combine(self, params: CombineParams, start_barrier: bool = True) -> None:
        """The start barrier (unless the caller launched it) and the combine kernel, on the current stream."""
        if start_barrier:
            self._rt.barrier()
        self._rt.combine(params)

    def combine(
        self,
        x: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: torch.Tensor | None,
        bias: tuple[torch.Tensor, ...],
        config: Config,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.check_error()
        launch = self._combine_launch(x.shape[1], x.dtype, handle, topk_weights, bias, config)
        launch.params.x = _ptr(x)
        self._launch_combine(launch.params)
        return launch.out, launch.out_weights

    def combine_experts(
        self,
        y: torch.Tensor,
        handle: DispatchHandle,
        expert_weights: torch.Tensor | None,
        bias: tuple[torch.Tensor, ...],
        config: Config,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The base class's ``unpermute`` + :meth:`combine` (same bits), except when the combine pulls: after the
        start barrier (peers are done reading this rank's own region), ``unpermute`` writes the ``[N_recv, H]``
        received rows straight into that region, where the combine kernel reads them (``x_in_region``): no row
        copies, R - 1 copy launches fewer (expert weights are still copied)."""
        self.check_error()
        layout: ExpertLayout = handle.expert_layout
        slot = layout.recv_slot
        weights = slot_weights(expert_weights, layout)  # [N_recv, K] float32, alive until the launch
        launch = self._combine_launch(y.shape[1], y.dtype, handle, weights, bias, config)
        params = launch.params
        # num_recv_rows fit the region below its weights area: _pull_combine checked the most any rank receives
        if params.pull and slot.shape[0] == handle.num_recv_rows:
            self._rt.barrier()
            permute.unpermute(y, slot, out=self._rt.own_rows(slot.shape[0], y.shape[1], y.dtype))
            params.x, params.x_in_region = self._rt.own_region, 1
            self._launch_combine(params, start_barrier=False)
            return launch.out, launch.out_weights
        recv_y = permute.unpermute(y, slot)
        params.x = recv_y.data_ptr()
        self._launch_combine(params)
        return launch.out, launch.out_weights


def _summing_order_source(handle: DispatchHandle, device: torch.device) -> torch.Tensor | None:
    """The dispatch's top-k ids ``[N, K]`` int64 on ``device``, from which the combine kernel derives each token's
    summing order (``ops.layout.summing_order``); None (ascending order) for a dispatch by layout alone."""
    order = handle.topk_idx
    if order is None or order.shape[1] == 0:
        return None
    return order.to(device=device, dtype=torch.int64).contiguous()


def _recv_tensors(args: DispatchArgs, device: torch.device, rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(recv_x [rows, H], recv_scales [rows, H/128] float32 or None)`` in the dtype the mode receives: FP8 rows
    (arriving as FP8 with their scales), or dequantized back to the input's dtype."""
    x = args.x
    fp8_rows = args.x_scales is not None or args.wire_fp8
    dequant = args.wire_fp8 and not args.fp8_out
    dtype = torch.float8_e4m3fn if fp8_rows and not dequant else x.dtype
    recv_x = torch.empty(rows, x.shape[1], dtype=dtype, device=device)
    recv_scales = (
        torch.empty(rows, x.shape[1] // 128, dtype=torch.float32, device=device) if fp8_rows and not dequant else None
    )
    return recv_x, recv_scales


def _without_topk_counts(
    num_ranks: int, args: DispatchArgs, result: DispatchResult, prefix: torch.Tensor, info: list[int] | None
) -> DispatchResult:
    """``result`` with, for a dispatch without top-k, the per-local-expert counts notify summed from every rank's
    ``num_tokens_per_expert`` (``info[2:]``): on the device, and as read (``info``) when read."""
    if args.topk_idx is not None:
        return result
    r, num_local = num_ranks, args.num_experts // num_ranks
    result.num_recv_tokens_per_expert = prefix[r * r + 2 : r * r + 2 + num_local]
    result.host_counts = None if info is None else info[2 : 2 + num_local]
    return result
