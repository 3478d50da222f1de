"""The ``nvlink`` transport: custom CUDA kernels (``csrc/``) moving rows between the GPUs of one host.

Every rank owns one peer-visible buffer (``cudaMalloc``, mapped into the other ranks with CUDA IPC) with a
staging region per source rank, sized for the worst case so senders never wait. One dispatch is:
``notify`` (barrier, count exchange → ``rank_prefix_matrix``, send order), one host read of the received row
count (skipped with ``num_worst_tokens``, which makes the dispatch CUDA-graph capturable), then one kernel
whose sender warps write rows (quantized to FP8 on the way when asked) straight into the destination's
region while its receiver warps copy published rows into the outputs. Combine is a barrier plus one kernel
that sends rows back and sums each token's copies in fp32, in source-rank order. Results equal the ``torch``
transport's: BF16 rows and FP8 bytes bit for bit, sums in the same order. ``dispatch_experts`` folds the
per-expert counts into notify and ships each row's expert-major destination rows with it (then ``permute``
expands, on all SMs); ``combine_experts`` is ``unpermute`` + ``combine``, and when that combine pulls,
``unpermute`` writes straight into the region the combine pulls from. At world size 1, when every token names an
expert, neither kernel runs: one layout call (no notify) and ``permute`` expand ``x`` itself, and ``unpermute``
writes the combined output.

Every wait on a peer has a deadline (``timeout_s``, see ``runtime``): the next call on this transport (or the
host read inside a normal dispatch) raises ``TimeoutError`` naming what stalled.
"""
from __future__ import annotations

import ctypes
import functools
import math
from dataclasses import dataclass, field
from typing import Callable, Optional, TypeVar

import torch
import torch.distributed as dist

from ...config import Config
from ...handle import DispatchHandle, ExpertLayout
from ...ops import permute
from ...ops.layout import count_invalid, invalid_ids_error, kernel_dispatch_layout
from ...ops.library import MAX_EXPERTS, MAX_TOPK, META_WORDS, CombineParams, DispatchParams
from ..base import DispatchArgs, DispatchResult, ExpertDispatchResult, Transport, dispatch_meta, slot_weights
from .plan import (combine_roles, combine_row_bytes, dispatch_roles, dispatch_slot_bytes, fused_combine_roles,
                   most_received, staging_capacity)
from .runtime import NVLinkRuntime

_T = TypeVar("_T")


def _ptr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


_MetaWords = ctypes.c_int32 * META_WORDS


def _meta_words(args: DispatchArgs) -> ctypes.Array:
    """``dispatch_meta(args)`` as the ``MOE_EP_META_WORDS`` int32 words notify exchanges (zero-padded)."""
    return _MetaWords(*dispatch_meta(args))


class _Carve:
    """Int32 tensors of several shapes in one allocation, each starting 16-byte aligned. Their addresses are known
    before any view exists, so a kernel can be launched on them first, and only the tensors callers see get a view
    (host time: one allocation instead of several, one torch call per view, none for addresses)."""

    def __init__(self, device: torch.device, *shapes: tuple[int, ...]):
        self._shapes = shapes
        self._starts, total = _carve_starts(shapes)
        self._flat = torch.empty(total, dtype=torch.int32, device=device)
        self._base = self._flat.data_ptr()

    def ptr(self, i: int, offset: int = 0) -> int:
        """Address of element ``offset`` of tensor ``i``."""
        return self._base + 4 * (self._starts[i] + offset)

    def view(self, i: int, shape: Optional[tuple[int, ...]] = None) -> torch.Tensor:
        """Tensor ``i``, or its first elements as a contiguous ``shape``, in one torch call."""
        shape = self._shapes[i] if shape is None else shape
        if len(shape) == 1:
            return self._flat[self._starts[i]:self._starts[i] + shape[0]]
        return self._flat.as_strided(shape, (shape[1], 1), self._starts[i])


@functools.lru_cache(maxsize=256)
def _carve_starts(shapes: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], int]:
    """Where each of ``shapes`` starts in a :class:`_Carve` (int32 elements, 16-byte aligned), and the total: the same
    few shapes recur call after call, so this is computed once per shape set (host time)."""
    starts, total = [], 0
    for shape in shapes:
        starts.append(total)
        total += (math.prod(shape) + 3) // 4 * 4
    return tuple(starts), total


class _StayingTokens:
    """What a world-size-1 handle takes when every one of ``n`` tokens stays: ``(recv_src_idx [n] int32 0, 1, ...,
    n - 1, send_pos [n, 1] (the same values), is_token_in_rank [n, 1] bool all True)``, views of two kept tensors
    (regrown twice as long when too short); :attr:`address` is the send list's (the same values, at least one row).
    The views of the last ``n`` are handed out again (host time: a repeated token count makes no torch call)."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._views: tuple[torch.Tensor, ...] = ()  # those of the token count self._n (set by _grow / __call__)
        self._grow(1)

    def _grow(self, rows: int) -> None:
        self._range = torch.arange(rows, dtype=torch.int32, device=self._device)
        self._ones = torch.ones(rows, 1, dtype=torch.bool, device=self._device)
        self.address = self._range.data_ptr()
        self._n: Optional[int] = None

    def __call__(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if n != self._n:
            if self._range.shape[0] < n:
                self._grow(max(n, 2 * self._range.shape[0]))
            tokens = self._range[:n]
            self._views, self._n = (tokens, tokens.view(n, 1), self._ones[:n]), n
        return self._views


@dataclass
class _ExpertState:
    """What a cached expert-major dispatch replays: the forward's top-k ``[N, K]`` int64 and the addresses (inside
    the notify outputs the handle's state keeps) of each entry's position among this rank's entries for its expert
    ``[N, K]`` int32, ``send_offset`` ``[E]`` int32 and notify's ``info`` ``[3 + 2L]`` int32 (csrc/moe_ep.h)."""

    topk_idx: torch.Tensor
    expert_pos: int
    send_offset: int
    info: int


@dataclass
class _NVLinkState:
    """Kept in ``DispatchHandle.transport_state``: notify's outputs (kept alive: the kernels read them by address),
    the address and row stride of the tokens sent to each rank, in order (``[R, list_stride]`` int32), the count
    matrix on the host (``host_counts[i * R + j]``: rows rank i sends to rank j; None after a ``num_worst_tokens``
    dispatch, which reads nothing back) and, for an expert-major handle, its layout state."""

    notified: _Carve
    send_list: int
    list_stride: int
    host_counts: Optional[list[int]] = None
    expert: Optional[_ExpertState] = None
    _counts_array: Optional[ctypes.Array] = field(default=None, repr=False)

    def copy_counts(self) -> Optional[ctypes.Array]:
        """``host_counts`` as the C array the copy-engine and pull combines read (built once), or None."""
        if self.host_counts is None:
            return None
        if self._counts_array is None:
            self._counts_array = (ctypes.c_int32 * len(self.host_counts))(*self.host_counts)
        return self._counts_array


@dataclass
class _CombineLaunch:
    """A combine ready to launch but for ``params.x``: its outputs (``out`` ``[N, H]``, ``out_weights`` ``[N, K]``
    float32 or None) and ``keep``, what the parameters point to that must live until the launch."""

    params: CombineParams
    out: torch.Tensor
    out_weights: Optional[torch.Tensor]
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
    def unavailable_reason(group: dist.ProcessGroup, device: torch.device) -> Optional[str]:
        """Why the kernels cannot serve ``group`` (None when they can). Collective: every rank must call it."""
        return NVLinkRuntime.unavailable_reason(group, device)

    def __init__(self, group: dist.ProcessGroup, device: torch.device, timeout_s: float, num_nvl_bytes: int = 0) -> None:
        super().__init__(group, device, timeout_s)
        self._rt = NVLinkRuntime(group, device, timeout_s, num_nvl_bytes)
        self.device = self._rt.device
        self._recv_guess = 0  # receive rows a dispatch allocates before it reads the count
        self._rows_guess = 0  # expert-major rows a fused (or EP1 aligned) dispatch allocates before it reads the count
        self._staying = _StayingTokens(self.device)
        self._local_fallback = False  # the last fresh EP1 expert-major dispatch had a token without an expert

    def check_error(self) -> None:
        """Raise if a kernel on this rank recorded a failure (sticky; after a timeout the CUDA context is lost)."""
        self._rt.check_error()

    def _num_sms(self, config: Config) -> int:
        return min(config.num_sms, self._rt.device_sms)

    def _check_capacity(self, rows: int, slot_bytes: int, what: str) -> None:
        capacity = staging_capacity(self._rt.region_bytes, slot_bytes)
        if rows > capacity:
            raise ValueError(f"{what}: {rows} rows per rank exceed the nvlink staging capacity of {capacity} rows of "
                             f"{slot_bytes} bytes; pass a larger num_nvl_bytes to Buffer")

    def destroy(self) -> None:
        """Free the peer buffer after every rank is done with it (collective)."""
        self._rt.destroy()

    # ---- layout ----
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return kernel_dispatch_layout(topk_idx, num_experts, self.num_ranks)

    # ---- dispatch ----
    def _notify(self, args: DispatchArgs) -> _Carve:
        """Barrier + count exchange (token counts into the rank prefix matrix, out-of-range expert ids, the
        ``dispatch_meta`` words every rank checks, and without top-k the per-expert counts) into ``info``
        (csrc/moe_ep.h); returns notify's outputs: the rank prefix matrix ``[R, R]`` directly followed by ``info``
        ``[2]`` (``[2 + L]`` without top-k; one host read brings both), ``send_pos`` ``[N, R]``, the send list
        ``[R, max(N, 1)]``."""
        in_rank = args.is_token_in_rank.contiguous()
        n, r = in_rank.shape[0], self.num_ranks
        if args.layout_given:  # derived, not trusted: a count contradicting is_token_in_rank would read past the rows
            counts = in_rank.sum(0, dtype=torch.int32)
        else:
            counts = args.num_tokens_per_rank
            if counts.dtype != torch.int32 or counts.device != self.device or not counts.is_contiguous():
                counts = counts.to(device=self.device, dtype=torch.int32).contiguous()
        invalid = (count_invalid(args.topk_idx, args.num_experts) if args.topk_idx is not None
                   else torch.zeros(1, dtype=torch.int32, device=self.device))
        per_expert = None
        if args.topk_idx is None:
            if args.num_experts > MAX_EXPERTS:
                raise ValueError(f"num_tokens_per_expert: a dispatch without top-k on nvlink exchanges at most "
                                 f"{MAX_EXPERTS} experts' counts, got {args.num_experts}")
            per_expert = args.num_tokens_per_expert.to(device=self.device, dtype=torch.int32).contiguous()
        info = 2 + (args.num_experts // r if per_expert is not None else 0)
        out = _Carve(self.device, (r * r + info,), (n, r), (r, max(n, 1)))
        self._rt.notify_dispatch(_ptr(counts), _ptr(invalid), _ptr(in_rank), n, max(n, 1), out.ptr(0), out.ptr(1),
                                 out.ptr(2), out.ptr(0, r * r), _meta_words(args), _ptr(per_expert), args.num_experts)
        return out

    def _prefix_matrix(self, notified: _Carve) -> torch.Tensor:
        """The rank prefix matrix ``[R, R]`` int32 at the start of notify's first output."""
        return notified.view(0, (self.num_ranks, self.num_ranks))

    def _speculate(self, notified: int, info_length: int, num_experts: int, launch: Callable[[], _T]
                   ) -> tuple[_T, list[int], list[int], bool]:
        """The one host read of a fresh dispatch around its speculative kernel: start reading notify's outputs at
        ``notified`` (the rank prefix matrix ``[R, R]``, then ``info[:info_length]``), ``launch()`` the dispatch
        kernel into receive buffers of ``self._recv_guess`` rows (the most any rank received so far) while the read
        runs, then wait. Returns ``(launch's result, host_counts, info, fits)``. Raises (every rank alike) when a
        rank found out-of-range expert ids. When some rank received more rows than the guess, the guess grows to
        that and ``fits`` is False: every rank (each sees the whole count matrix) then dispatches again."""
        r = self.num_ranks
        guess = self._recv_guess
        wait = self._rt.start_read(notified, r * r + info_length)
        launched = launch()
        values = wait()
        self.check_error()
        prefix, info = values[:r * r], values[r * r:]
        if info[1]:
            raise invalid_ids_error([i for i in range(r) if info[1] >> i & 1], num_experts)
        counts = prefix[:r] + [below - above for above, below in zip(prefix, prefix[r:])]  # row minus the one above
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
            raise ValueError(f"x: the nvlink kernels need rows of a multiple of 16 bytes, got hidden={hidden} {x.dtype}")
        slot = dispatch_slot_bytes(hidden, x.element_size(), fp8_rows, k)
        self._check_capacity(n, slot, "x")
        return slot

    def _recv_tensors(self, args: DispatchArgs, rows: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(recv_x [rows, H], recv_scales [rows, H/128] or None)`` in the dtype the mode receives."""
        x = args.x
        hidden = x.shape[1]
        fp8_rows = args.x_scales is not None or args.wire_fp8
        dequant = args.wire_fp8 and not args.fp8_out
        if dequant:  # back to the input's dtype (BF16 for FP8 input)
            dtype = x.dtype if args.wire_fp8 else torch.bfloat16
        else:
            dtype = torch.float8_e4m3fn if fp8_rows else x.dtype
        recv_x = torch.empty(rows, hidden, dtype=dtype, device=self.device)
        recv_scales = (torch.empty(rows, hidden // 128, dtype=torch.float32, device=self.device)
                       if fp8_rows and not dequant else None)
        return recv_x, recv_scales

    def _launch_dispatch(self, args: DispatchArgs, handle: DispatchHandle, topk_idx: Optional[torch.Tensor],
                         recv_x: Optional[torch.Tensor], recv_scales: Optional[torch.Tensor],
                         topk_weights: Optional[torch.Tensor], alignment: int = 1, **outputs: int) -> None:
        """One dispatch kernel; ``outputs``: the mode's remaining ``moe_ep_dispatch_params`` fields, addresses as
        ints (passed to the struct's constructor with the rest: no attribute set per field). ``recv_x`` is None when
        the fused expansion writes the expert-major rows instead."""
        x = args.x
        n, hidden = x.shape
        state: _NVLinkState = handle.transport_state
        tuning = args.config.nvlink
        fused = bool(outputs.get("fused_expansion"))
        num_sms = (min(tuning.fused_dispatch_sms, self._rt.device_sms) if fused and tuning.fused_dispatch_sms
                   else self._num_sms(args.config))
        pull, _, warps, blocks = dispatch_roles(tuning, num_sms, self.num_ranks, args.wire_fp8, args.fp8_out, fused)
        params = DispatchParams(
            x=x.data_ptr(), x_scales=_ptr(args.x_scales), topk_idx=_ptr(topk_idx), topk_weights=_ptr(topk_weights),
            rank_prefix_matrix=handle.rank_prefix_matrix.data_ptr(), send_list=state.send_list,
            recv_x=_ptr(recv_x), recv_scales=_ptr(recv_scales), num_tokens=n, hidden=hidden,
            x_elem_bytes=x.element_size(), num_topk=topk_idx.shape[1] if topk_idx is not None else 0,
            num_local_experts=args.num_experts // self.num_ranks, list_stride=state.list_stride,
            num_recv_rows=handle.num_recv_rows, wire_fp8=int(args.wire_fp8), fp8_in=int(args.x_scales is not None),
            fp8_out=int(args.fp8_out), round_scale=int(args.round_scale), num_sms=num_sms,
            num_send_warps=warps, num_send_blocks=blocks, pull=int(pull),
            send_pos=handle.send_pos.data_ptr(), alignment=alignment, **outputs)
        self._rt.dispatch(params)

    def _replay_barrier(self, handle: DispatchHandle) -> _NVLinkState:
        """Start of a cached dispatch: the runtime's barrier, for a handle of this transport."""
        state = handle.transport_state
        if not isinstance(state, _NVLinkState):
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
        notified = self._notify(args)
        worst = args.num_worst_tokens > 0  # no host read, so out-of-range ids are not reported in this mode
        handle = DispatchHandle(rank_prefix_matrix=self._prefix_matrix(notified),
                                is_token_in_rank=args.is_token_in_rank.contiguous(), send_pos=notified.view(1),
                                recv_src_idx=None,  # set by _dispatch_rows, which makes it
                                num_tokens=n, num_recv_tokens=None, num_experts=args.num_experts, rank=self.rank,
                                num_ranks=self.num_ranks,
                                num_recv_rows=args.num_worst_tokens if worst else self._recv_guess,
                                transport_state=_NVLinkState(notified, notified.ptr(2), max(n, 1)))
        if worst:
            return self._without_topk_counts(args, self._dispatch_rows(args, handle), notified, None)
        num_local = args.num_experts // self.num_ranks
        result, handle.transport_state.host_counts, info, fits = self._speculate(
            notified.ptr(0), 2 + (num_local if args.topk_idx is None else 0), args.num_experts,
            lambda: self._dispatch_rows(args, handle, speculative_rows=1))
        num_recv = handle.num_recv_tokens = handle.num_recv_rows = info[0]
        if not fits:
            self._replay_barrier(handle)
            return self._without_topk_counts(args, self._dispatch_rows(args, handle), notified, info)
        handle.recv_src_idx = handle.recv_src_idx[:num_recv]
        cut = [None if t is None else t[:num_recv]
               for t in (result.recv_x, result.recv_scales, result.recv_topk_idx, result.recv_topk_weights)]
        return self._without_topk_counts(args, DispatchResult(*cut, result.num_recv_tokens_per_expert, handle),
                                         notified, info)

    def _without_topk_counts(self, args: DispatchArgs, result: DispatchResult, notified: _Carve,
                             info: Optional[list[int]]) -> DispatchResult:
        """``result`` with, for a dispatch without top-k, the per-local-expert counts notify summed from every
        rank's ``num_tokens_per_expert`` (``info[2:]``): on the device, and as read (``info``) when read."""
        if args.topk_idx is not None:
            return result
        r, num_local = self.num_ranks, args.num_experts // self.num_ranks
        result.num_recv_tokens_per_expert = notified.view(0, (r * r + 2 + num_local,))[r * r + 2:]
        result.host_counts = None if info is None else info[2:2 + num_local]
        return result

    def _dispatch_rows(self, args: DispatchArgs, handle: DispatchHandle, speculative_rows: int = 0) -> DispatchResult:
        """Outputs of ``handle.num_recv_rows`` rows and the dispatch kernel into them."""
        recv_x, recv_scales = self._recv_tensors(args, handle.num_recv_rows)
        has_topk = args.topk_idx is not None
        k = args.topk_idx.shape[1] if has_topk else 0
        rows = handle.num_recv_rows
        recv_topk_idx = torch.empty(rows, k, dtype=torch.int64, device=self.device) if has_topk else None
        recv_topk_weights = (torch.empty(rows, k, dtype=torch.float32, device=self.device)
                             if has_topk and args.topk_weights is not None else None)
        expert_counts = (torch.zeros(args.num_experts // self.num_ranks, dtype=torch.int32, device=self.device)
                         if has_topk else None)
        recv_src_idx = torch.empty(rows, dtype=torch.int32, device=self.device)
        self._launch_dispatch(args, handle, args.topk_idx, recv_x, recv_scales, args.topk_weights,
                              recv_topk_idx=_ptr(recv_topk_idx), recv_topk_weights=_ptr(recv_topk_weights),
                              recv_src_idx=recv_src_idx.data_ptr(), recv_expert_count=_ptr(expert_counts),
                              speculative_rows=speculative_rows)
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
        more, every rank (each sees the whole count matrix) dispatches once more with buffers that fit.

        With ``config.nvlink.fused_dispatch`` the kernel itself writes every received row into all of its
        expert-major rows (no receive buffer, no ``permute``): its output is then guessed too (the most expert-major
        rows any rank had so far; notify reports the most of this call to every rank, so all agree on a second
        dispatch). At world size 1 neither notify nor the dispatch kernel runs (:meth:`_local_dispatch_experts`)
        unless a token names no expert."""
        self.check_error()
        self._check_rows(args)
        n = args.x.shape[0]
        handle = args.handle
        if handle is None:
            num_experts = args.num_experts
            if num_experts > MAX_EXPERTS:
                raise ValueError(f"num_experts: the nvlink expert-major kernels take at most {MAX_EXPERTS} "
                                 f"experts, got {num_experts}")
            if self._expands_locally(args):
                result = self._local_dispatch_experts(args, alignment)
                if result is not None:
                    return result
            topk_idx = args.topk_idx
            k = topk_idx.shape[1]
            num_local = num_experts // self.num_ranks
            r = self.num_ranks
            fused = args.config.nvlink.fused_dispatch
            rows_guess = self._rows_guess
            # The dispatch kernel starts before the counts are on the host, with receive buffers of `guess` rows
            # (see _speculate).
            guess = self._recv_guess
            # notify's int32 outputs and the guessed receive metadata (recv_src_idx, recv_slot) from one
            # allocation; views only of what the handle exposes, built after the launch
            out = _Carve(self.device, (r * r + 4 + 2 * num_local,), (num_experts,), (n, r), (r, max(n, 1)), (n, k),
                         (guess,), (guess, k))
            in_rank = torch.empty(n, r, dtype=torch.bool, device=self.device)
            # One kernel from top-k to the whole layout (counts, exchange, send order, expert-major positions).
            self._rt.notify_experts(_ptr(topk_idx), n, k, num_experts, alignment, max(n, 1), out.ptr(0), out.ptr(2),
                                    out.ptr(3), _ptr(in_rank), out.ptr(4), out.ptr(1), out.ptr(0, r * r),
                                    _meta_words(args))
            state = _NVLinkState(out, out.ptr(3), max(n, 1), None,
                                 _ExpertState(topk_idx, out.ptr(4), out.ptr(1), out.ptr(0, r * r)))
            # recv_src_idx: set once the row count is known (the kernel writes it by address)
            handle = DispatchHandle(rank_prefix_matrix=self._prefix_matrix(out), is_token_in_rank=in_rank,
                                    send_pos=out.view(2), recv_src_idx=None, num_tokens=n, num_recv_tokens=None,
                                    num_experts=num_experts, rank=self.rank, num_ranks=self.num_ranks,
                                    num_recv_rows=guess, transport_state=state)

            def launch() -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
                # fused: the expert-major rows themselves; else the received rows (permute expands them below)
                recv_x, recv_scales = self._recv_tensors(args, rows_guess if fused else guess)
                probs_rows = rows_guess if fused else guess * k + num_local * alignment  # the most M can be
                probs = (torch.empty(probs_rows, dtype=torch.float32, device=self.device)
                         if args.topk_weights is not None else None)
                self._launch_expert_dispatch(args, handle, recv_x, recv_scales, out.ptr(5), out.ptr(6), probs,
                                             alignment, args.topk_weights, fused, speculative_rows=1)
                return recv_x, recv_scales, probs

            # fused: also the exact counts and then the most expert-major rows of any rank (info[3 + 2L])
            launched, state.host_counts, info, fits = self._speculate(
                out.ptr(0), 4 + 2 * num_local if fused else 3 + num_local, num_experts, launch)
            num_recv, num_rows, tokens_per_expert = info[0], info[2], info[3:3 + num_local]
            if fused and info[3 + 2 * num_local] > rows_guess:
                self._rows_guess, fits = info[3 + 2 * num_local], False
            handle.num_recv_tokens = handle.num_recv_rows = num_recv
            if not fits:
                again = _Carve(self.device, (num_recv,), (num_recv, k))
                handle.recv_src_idx, recv_slot = again.view(0), again.view(1)
                handle.expert_layout = ExpertLayout(recv_slot, tokens_per_expert, num_rows, alignment)
                return self._expert_dispatch(args, handle, args.topk_weights)
            recv_x, recv_scales, probs = launched
            handle.recv_src_idx = out.view(5, (num_recv,))
            handle.expert_layout = ExpertLayout(out.view(6, (num_recv, k)), tokens_per_expert, num_rows, alignment)
            probs = None if probs is None else probs[:num_rows]
            if fused:
                return ExpertDispatchResult(recv_x[:num_rows], None if recv_scales is None else recv_scales[:num_rows],
                                            probs, handle)
            x, _, scales = permute.permute_valid(recv_x, handle.expert_layout.recv_slot, num_recv, num_rows, None,
                                                 recv_scales)
            return ExpertDispatchResult(x, scales, probs, handle)
        return self._expert_dispatch(args, handle, None)

    def _local_dispatch_experts(self, args: DispatchArgs, alignment: int) -> Optional[ExpertDispatchResult]:
        """A fresh expert-major dispatch at world size 1, where no row crosses: one layout call
        (``moe_ep_local_layout``: every slot, and what notify writes at one rank, without notify's barrier) and
        ``permute`` expanding ``x`` itself, launched before the one host read of the counts, which waits for the
        layout only. The expert rows are allocated for the most there can be (N * K at alignment 1, else the most
        seen so far; more means a second permute) and returned as views of the first M; that permute's probs and
        scratch come from the layout's allocation (its rows, and FP8 rows' scales, are the only allocations between
        the two launches: host time the GPU waits through). None when a token
        names no expert: its row is not received, so the received rows are not the tokens and the kernel path
        serves; the next calls then read before they permute, until every token names an expert again.
        Out-of-range ids raise after the read, as notify's do."""
        x, topk_idx, weights, num_experts = args.x, args.topk_idx, args.topk_weights, args.num_experts
        n, k = topk_idx.shape
        blocks = self._rt.device_sms
        read = 1 + 3 + num_experts  # the rank prefix matrix [1], then rows received, bad-id mask, M, aligned counts
        rows = n * k if alignment == 1 or n == 0 else self._rows_guess  # the most M can be, or a guess
        speculate = rows > 0 and not self._local_fallback
        # the speculative permute's probs [rows] float32 (when weighted) and its covered [rows] uint8 scratch
        permute_shapes = ((rows if weights is not None else 0,), ((rows + 3) // 4,)) if speculate else ()
        out = _Carve(self.device, (read + 1 + num_experts,), (num_experts,), (n, k), (n, k),
                     (blocks * (num_experts + 2),), *permute_shapes)
        permute.local_layout(topk_idx, num_experts, alignment, out.ptr(3), out.ptr(2), out.ptr(1), out.ptr(0),
                             out.ptr(4), blocks)
        self._rt.mark_read()  # the read waits for the layout only, though the permute is launched before it
        if speculate:
            expert_x = torch.empty(rows, x.shape[1], dtype=x.dtype, device=self.device)
            scales = (None if args.x_scales is None else
                      torch.empty(rows, args.x_scales.shape[1], dtype=torch.float32, device=self.device))
            permute.permute_into(x, out.ptr(3), n, k, rows, weights, args.x_scales, expert_x.data_ptr(),
                                 0 if weights is None else out.ptr(5), _ptr(scales), out.ptr(6))
        slot = out.view(3)  # after the launches: the host time before them is the GPU's wait
        values = self._rt.start_read(out.ptr(0), read, marked=True)()
        self.check_error()
        if values[2]:
            raise invalid_ids_error([0], num_experts)
        self._local_fallback = values[1] != n
        if self._local_fallback:
            return None
        num_rows, tokens_per_expert = values[3], values[4:read]
        if speculate and num_rows <= rows:
            probs = None if weights is None else out.view(5).view(torch.float32)
            if rows != num_rows:  # rows past M (their slots were fewer) are cut off
                expert_x, probs, scales = (None if t is None else t[:num_rows] for t in (expert_x, probs, scales))
        else:
            self._rows_guess = max(self._rows_guess, num_rows)
            expert_x, probs, scales = permute.permute_valid(x, slot, n, num_rows, weights, args.x_scales)
        recv_src_idx, send_pos, in_rank = self._staying(n)
        state = _NVLinkState(out, self._staying.address, max(n, 1), [n],
                             _ExpertState(topk_idx, out.ptr(2), out.ptr(1), out.ptr(0, 1)))
        handle = DispatchHandle(rank_prefix_matrix=out.view(0, (1, 1)), is_token_in_rank=in_rank, send_pos=send_pos,
                                recv_src_idx=recv_src_idx, num_tokens=n, num_recv_tokens=n, num_experts=num_experts,
                                rank=0, num_ranks=1, num_recv_rows=n, transport_state=state,
                                expert_layout=ExpertLayout(slot, tokens_per_expert, num_rows, alignment))
        return ExpertDispatchResult(expert_x, scales, probs, handle)

    def _expands_locally(self, args: DispatchArgs) -> bool:
        """Whether an expert-major dispatch may skip the dispatch kernel: at world size 1 every row stays here, in
        token order, so when every token names an expert the received rows are ``x`` itself and ``permute`` can
        expand it with the slots the kernel would record (unless the rows are quantized on the way or the kernel
        expands them). Same outputs and handle either way."""
        return self.num_ranks == 1 and not args.wire_fp8 and not args.config.nvlink.fused_dispatch

    def _launch_expert_dispatch(self, args: DispatchArgs, handle: DispatchHandle, rows: torch.Tensor,
                                scales: Optional[torch.Tensor], recv_src_idx: int, recv_slot: int,
                                probs: Optional[torch.Tensor], alignment: int, weights: Optional[torch.Tensor],
                                fused: bool, speculative_rows: int = 0) -> None:
        """The expert-major dispatch kernel; ``recv_src_idx``/``recv_slot``: the addresses it writes them at.
        ``rows`` ``[rows, H]`` and ``scales`` ``[rows, H/128]`` float32 (FP8 rows) or None: the received rows, or
        with ``fused`` the expert-major rows the kernel expands them into."""
        expert: _ExpertState = handle.transport_state.expert
        fused_outputs = (dict(fused_expansion=1, expert_x=rows.data_ptr(), expert_scales=_ptr(scales),
                              num_expert_rows=rows.shape[0]) if fused else {})
        self._launch_dispatch(args, handle, expert.topk_idx, None if fused else rows, None if fused else scales,
                              weights, alignment, recv_src_idx=recv_src_idx, expert_major=1,
                              expert_pos=expert.expert_pos, send_offset=expert.send_offset, expert_info=expert.info,
                              recv_slot=recv_slot, expert_probs=_ptr(probs), speculative_rows=speculative_rows,
                              **fused_outputs)

    def _expert_dispatch(self, args: DispatchArgs, handle: DispatchHandle, weights: Optional[torch.Tensor]
                         ) -> ExpertDispatchResult:
        """Replay ``handle``'s expert-major dispatch (a barrier, the kernel, then permute unless the kernel expands
        the rows itself: ``config.nvlink.fused_dispatch``), with ``weights`` (the forward's, whose probs it returns)
        or without (a cached dispatch: its probs are the caller's)."""
        if weights is None:
            state = handle.transport_state
            if not isinstance(state, _NVLinkState) or state.expert is None:
                raise ValueError("handle: it has no nvlink expert-major state (it did not come from "
                                 "NVLinkTransport.dispatch_experts)")
        layout: ExpertLayout = handle.expert_layout
        if self._expands_locally(args) and handle.num_recv_rows == handle.num_tokens:
            x, probs, scales = permute.permute_valid(args.x, layout.recv_slot, handle.num_tokens, layout.num_rows,
                                                     weights, args.x_scales)
            return ExpertDispatchResult(x, scales, probs, handle)
        self._replay_barrier(handle)
        fused = args.config.nvlink.fused_dispatch
        rows, scales = self._recv_tensors(args, layout.num_rows if fused else handle.num_recv_rows)
        probs = torch.empty(layout.num_rows, dtype=torch.float32, device=self.device) if weights is not None else None
        # A replay rewrites recv_slot and recv_src_idx with the values they already hold.
        self._launch_expert_dispatch(args, handle, rows, scales, handle.recv_src_idx.data_ptr(),
                                     layout.recv_slot.data_ptr(), probs, layout.alignment, weights, fused)
        if fused:
            return ExpertDispatchResult(rows, scales, probs, handle)
        x, _, scales = permute.permute_valid(rows, layout.recv_slot, handle.num_recv_rows, layout.num_rows, None,
                                             scales)
        return ExpertDispatchResult(x, scales, probs, handle)

    # ---- combine ----
    def _combine_launch(self, hidden: int, dtype: torch.dtype, handle: DispatchHandle,
                        topk_weights: Optional[torch.Tensor], bias: tuple[torch.Tensor, ...], config: Config,
                        fused: bool = False) -> _CombineLaunch:
        """Validate a combine of ``handle.num_recv_rows`` rows ``[hidden]`` of ``dtype``, allocate its outputs and
        pick how rows travel (``plan.combine_roles``, or ``plan.fused_combine_roles`` for a fused reduction);
        ``params.x`` is left for the caller."""
        elem_bytes = dtype.itemsize
        k = topk_weights.shape[1] if topk_weights is not None else 0
        if k > MAX_TOPK:
            raise ValueError(f"topk_weights: the nvlink kernels take at most {MAX_TOPK} columns, got {k}")
        if (hidden * elem_bytes) % 16:
            raise ValueError(f"x: the nvlink kernels need rows of a multiple of 16 bytes, got hidden={hidden} {dtype}")
        self._check_capacity(handle.num_tokens, combine_row_bytes(hidden, elem_bytes, k), "x")
        state = handle.transport_state
        own = isinstance(state, _NVLinkState)
        if own:  # this transport's views of notify's int32 output: nothing to convert
            rpm, send_pos = handle.rank_prefix_matrix, handle.send_pos
        else:
            rpm, send_pos = (t if t.dtype == torch.int32 and t.device == self.device and t.is_contiguous()
                             else t.to(device=self.device, dtype=torch.int32).contiguous()
                             for t in (handle.rank_prefix_matrix, handle.send_pos))
        out = torch.empty(handle.num_tokens, hidden, dtype=dtype, device=self.device)
        out_weights = (torch.empty(handle.num_tokens, k, dtype=torch.float32, device=self.device)
                       if topk_weights is not None else None)
        num_sms = self._num_sms(config)
        # the counts of this transport's own handles (none at world size 1: nothing crosses)
        host_counts = state.host_counts if own and self.num_ranks > 1 else None
        row_bytes = hidden * elem_bytes
        if fused:
            pull, copy_engine, warps, blocks = fused_combine_roles(config.nvlink, num_sms, self.num_ranks)
        else:
            pull, copy_engine, warps, blocks = combine_roles(
                config.nvlink, num_sms, None if host_counts is None else most_received(host_counts, self.num_ranks),
                row_bytes, lambda: self._rt.pull_rows(row_bytes, k))
        # copy engine and pull: where each peer's rows sit in x (kept alive in the result until the launch)
        counts = state.copy_counts() if copy_engine or pull else None
        params = CombineParams(
            topk_weights=_ptr(topk_weights), rank_prefix_matrix=rpm.data_ptr(), send_pos=send_pos.data_ptr(),
            bias0=_ptr(bias[0]) if len(bias) > 0 else 0, bias1=_ptr(bias[1]) if len(bias) > 1 else 0,
            out=out.data_ptr(), out_weights=_ptr(out_weights), num_tokens=handle.num_tokens, hidden=hidden,
            elem_bytes=elem_bytes, num_topk=k, num_recv_rows=handle.num_recv_rows, num_sms=num_sms,
            num_send_warps=warps, num_send_blocks=blocks,
            host_counts=0 if counts is None else ctypes.addressof(counts), pull=int(pull))
        if copy_engine:
            params.copy_engine = 1
            params.copy_piece_rows, params.copy_streams = config.nvlink.copy_piece_rows, config.nvlink.copy_streams
        return _CombineLaunch(params, out, out_weights, (counts, rpm, send_pos, topk_weights))

    def _launch_combine(self, params: CombineParams, start_barrier: bool = True) -> None:
        """The start barrier (unless the caller launched it) and the combine kernel, on the current stream."""
        if start_barrier:
            self._rt.barrier()
        self._rt.combine(params)

    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: Optional[torch.Tensor],
                bias: tuple[torch.Tensor, ...], config: Config) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        self.check_error()
        launch = self._combine_launch(x.shape[1], x.dtype, handle, topk_weights, bias, config)
        launch.params.x = _ptr(x)
        self._launch_combine(launch.params)
        return launch.out, launch.out_weights

    def combine_experts(self, y: torch.Tensor, handle: DispatchHandle, expert_weights: Optional[torch.Tensor],
                        config: Config) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The base class's ``unpermute`` + :meth:`combine` (same results, bit for bit), except when the combine
        pulls and the unpermute kernel serves: then, after the start barrier (peers are done reading this rank's own
        region), ``unpermute`` writes the ``[N_recv, H]`` received rows straight into that region, where the pull
        combine's copy would put them, and the combine kernel reads them there (``x_in_region``): no row copies (one
        pass over the rows and R - 1 copy launches fewer; expert weights, if any, are still copied). A pulling
        combine without the unpermute kernel copies the rows into the region inside ``moe_ep_combine``, as
        :meth:`combine` does. With ``config.nvlink.fused_combine`` no unpermute runs: a push combine kernel sums
        each received row from ``y`` itself (``fused_reduction``; the same bits)."""
        self.check_error()
        layout: ExpertLayout = handle.expert_layout
        slot = layout.recv_slot
        weights = slot_weights(expert_weights, layout)  # [N_recv, K] float32, alive until the launch
        # y: [M, H] BF16/FP32 and contiguous, validated by Buffer.combine_experts; slot: this transport's own
        kernel = permute.unpermute_kernel_takes(y, slot)  # what unpermute's loads need, the fused reduction's too
        if self.num_ranks == 1 and slot.shape[0] == handle.num_tokens:
            # Every token was received, in order: the combine would copy unpermute's rows into place (its fp32 sum
            # over one rank rounds each back to itself) and the weights likewise.
            return permute.unpermute_valid(y, slot, kernel), weights
        if config.nvlink.fused_combine and kernel and slot.shape[0] == handle.num_recv_rows:
            launch = self._combine_launch(y.shape[1], y.dtype, handle, weights, (), config, fused=True)
            params = launch.params
            params.x, params.fused_reduction, params.recv_slot = y.data_ptr(), 1, slot.data_ptr()
            params.slot_topk, params.num_expert_rows = slot.shape[1], layout.num_rows
            self._launch_combine(params)
            return launch.out, launch.out_weights
        launch = self._combine_launch(y.shape[1], y.dtype, handle, weights, (), config)
        params = launch.params
        # num_recv_rows fit the region below its weights area: _pull_combine checked the most any rank receives
        if params.pull and kernel and slot.shape[0] == handle.num_recv_rows:
            self._rt.barrier()
            permute.unpermute_into(y, slot, self._rt.own_region)
            params.x, params.x_in_region = self._rt.own_region, 1
            self._launch_combine(params, start_barrier=False)
            return launch.out, launch.out_weights
        recv_y = permute.unpermute_valid(y, slot, kernel)
        params.x = recv_y.data_ptr()
        self._launch_combine(params)
        return launch.out, launch.out_weights
