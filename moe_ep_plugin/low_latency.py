"""Low-latency mode at the buffer layer: DeepEP V1's ``low_latency_dispatch``/``low_latency_combine`` validation,
the handle, and the bookkeeping of the two alternating buffer sets. Transports move the rows
(``transports/low_latency_torch.py`` on any device). Docs: docs/low_latency.md.

R = EP ranks, M = ``num_max_dispatch_tokens_per_rank``, H = hidden, E = experts, L = E / R local experts,
N = this rank's tokens (N <= M), K = top-k.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

import torch

from .config import positive_int, round_up
from .event import EventOverlap
from .ops import fp8
from .ops.library import MAX_TOPK
from .transports.base import REFUSABLE
from .transports.low_latency_base import DispatchRequest, LowLatencyHandle, LowLatencyTransport

UE8M0_PACK = 4 * fp8.BLOCK  # channels per packed int32 of UE8M0 scales
_ALIGN = 128


def rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int) -> int:
    """Bytes of low-latency buffer for these shapes (DeepEP V1's ``get_low_latency_rdma_size_hint`` formula, so
    buffers sized for DeepEP fit): two sets of (send, receive, signals), each sized for the worst case in which
    every token of every rank picks every expert. Independent of ``num_ranks`` (kept for DeepEP's signature)."""
    for name, value in (
        ("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
        ("hidden", hidden),
        ("num_ranks", num_ranks),
        ("num_experts", num_experts),
    ):
        positive_int(value, name)
    m, scales = num_max_dispatch_tokens_per_rank, hidden // fp8.BLOCK
    dispatch_msg = 16 + max(hidden * 2, hidden + scales * 4)  # header + BF16 row, or FP8 row + float32 scales
    combine_msg = scales * 4 + hidden * 2
    send = max(m * dispatch_msg, num_experts * m * combine_msg)
    recv = num_experts * m * max(dispatch_msg, combine_msg)
    signals = round_up(num_experts * 4, _ALIGN)
    return round_up(2 * (send + recv + signals) + _ALIGN, _ALIGN)

    return value


class BufferSets:
    """DeepEP's two alternating low-latency buffer sets: every dispatch or combine takes the next set. A set may
    still hold a live result (the data of a call whose hook has not run, or a zero-copy combine buffer handed
    out); taking such a set is refused (it would overwrite that result), so at most two results are live."""

    def __init__(self) -> None:
        self.next = 0
        self._live: list[str | None] = [None, None]  # what still needs the set, for the error
        self._zero_copy: list[LowLatencyHandle | None] = [None, None]
        self._generation = [0, 0]  # bumped by clean(): holders from before see it changed

    def check(self, what: str, zero_copy_of: LowLatencyHandle | None = None) -> None:
        """Raise as :meth:`take` would, taking nothing."""
        s = self.next
        if self._zero_copy[s] is not None:
            if zero_copy_of is None or self._zero_copy[s] is not zero_copy_of:
                raise RuntimeError(
                    f"{what}: low-latency buffer set {s} holds the zero-copy combine buffer handed out "
                    "by get_next_low_latency_combine_buffer; run that zero-copy combine first (a "
                    "third live result would overwrite it)"
                )
        elif zero_copy_of is not None:
            raise ValueError(
                "zero_copy: call get_next_low_latency_combine_buffer(handle) and write the expert "
                "outputs there before a zero-copy combine"
            )
        if self._live[s] is not None:
            raise RuntimeError(
                f"{what}: low-latency buffer set {s} still holds the result of {self._live[s]}, whose "
                "receive hook has not run; at most two low-latency results can be live (run the hook "
                "first)"
            )

    def take(self, what: str, zero_copy_of: LowLatencyHandle | None = None) -> int:
        """The set for a new call ``what``; ``zero_copy_of``: the handle of a zero-copy combine, which consumes
        the zero-copy buffer handed out for it. Raises RuntimeError if the set holds a live result."""
        self.check(what, zero_copy_of)
        s = self.next
        if zero_copy_of is not None:
            self._zero_copy[s] = None
        self.next = s ^ 1
        return s

    def hold(self, s: int, what: str) -> Callable[[], None]:
        """Mark set ``s`` live for ``what`` until the returned release runs; it raises if the set was cleaned."""
        self._live[s] = what
        generation = self._generation[s]

        def release() -> None:
            if self._generation[s] != generation:
                raise RuntimeError(f"{what}: clean_low_latency_buffer ran before its receive hook; the data is gone")
            self._live[s] = None

        return release

    def hand_out_zero_copy(self, handle: LowLatencyHandle) -> int:
        """Reserve the next set's combine buffer for a zero-copy combine of ``handle``; returns the set."""
        s = self.next
        if self._live[s] is not None:
            raise RuntimeError(
                f"get_next_low_latency_combine_buffer: buffer set {s} still holds the result of "
                f"{self._live[s]}, whose receive hook has not run"
            )
        self._zero_copy[s] = handle
        return s

    def clean(self) -> None:
        self._live = [None, None]
        self._zero_copy = [None, None]
        self._generation = [g + 1 for g in self._generation]


Check = Callable[[str, object, tuple, tuple], torch.Tensor]


class LowLatencyMode:
    """The low-latency calls of one ``Buffer``: validates every input before anything is sent, takes a buffer
    set, runs the transport and wraps the receive half in DeepEP's hook. ``check(name, t, dtypes, shape)`` is the
    Buffer's tensor check (type, dtype, shape with None = any, device)."""

    def __init__(
        self,
        transport: LowLatencyTransport,
        rank: int,
        num_ranks: int,
        num_rdma_bytes: int,
        device: torch.device,
        check: Check,
    ) -> None:
        self.transport = transport
        self.rank, self.num_ranks = rank, num_ranks
        self.num_rdma_bytes = num_rdma_bytes
        self.device = device
        self._check = check
        self.sets = BufferSets()
        self._calls = 0
        # (M, hidden, experts) the buffer's slots and signals are laid out for: set by the first dispatch or by
        # clean_low_latency_buffer, agreed with the peers (transport.lay_out); the kernels place signals by these
        # shapes, so another shape needs a clean
        self._layout: tuple[int, int, int] | None = None

    # ---- validation ----
    def _check_shapes(self, m: int, hidden: int, num_experts: int) -> None:
        positive_int(m, "num_max_dispatch_tokens_per_rank")
        positive_int(num_experts, "num_experts")
        if num_experts % self.num_ranks:
            raise ValueError(f"num_experts: {num_experts} experts do not divide evenly over {self.num_ranks} EP ranks")
        sizes = self.transport.hidden_sizes
        if sizes is not None and hidden not in sizes:
            raise ValueError(
                f"x: hidden size {hidden} is not served by the {self.transport.name} low-latency kernels "
                f"(supported: {list(sizes)})"
            )
        if hidden % fp8.BLOCK:
            raise ValueError(f"x: low-latency mode needs the hidden size to be a multiple of {fp8.BLOCK}, got {hidden}")
        need = rdma_size_hint(m, hidden, self.num_ranks, num_experts)
        if self.num_rdma_bytes < need:
            raise ValueError(
                f"num_rdma_bytes: the buffer has {self.num_rdma_bytes} bytes, these shapes need {need} "
                f"(Buffer.get_low_latency_rdma_size_hint({m}, {hidden}, {self.num_ranks}, {num_experts}))"
            )

    def _check_layout(self, name: str, m: int, hidden: int, num_experts: int) -> None:
        """A call must keep the layout the buffer has (or clean first); the first dispatch lays it out."""
        if self._layout is not None and self._layout != (m, hidden, num_experts):
            lm, lh, le = self._layout
            raise ValueError(
                f"{name}: the low-latency buffer is laid out for num_max_dispatch_tokens_per_rank={lm}, "
                f"hidden={lh}, num_experts={le}, this call has {m}, {hidden}, {num_experts}; call "
                f"clean_low_latency_buffer({m}, {hidden}, {num_experts}) on every rank first"
            )

    def _check_topk(self, topk_idx: object, n: int | None) -> torch.Tensor:
        topk_idx = self._check("topk_idx", topk_idx, (torch.int64, torch.int32), (n, None))
        if not 1 <= topk_idx.shape[1] <= MAX_TOPK:
            raise ValueError(f"topk_idx: top-k must lie in [1, {MAX_TOPK}], got {topk_idx.shape[1]}")
        return (topk_idx if topk_idx.dtype == torch.int64 else topk_idx.to(torch.int64)).contiguous()

    def _check_stats(self, name: str, t: torch.Tensor | None, dtype: torch.dtype, size: int) -> torch.Tensor | None:
        if t is None:
            return None
        t = self._check(name, t, (dtype,), (size,))
        if not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor (it is accumulated in place)")
        return t

    @staticmethod
    def _check_hook_mode(async_finish: bool, return_recv_hook: bool) -> None:
        if async_finish and return_recv_hook:
            raise ValueError(
                "async_finish/return_recv_hook: they cannot be combined (the hook already defers the "
                "receive; DeepEP refuses the pair too)"
            )

    # ---- calls ----
    def dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: torch.Tensor | None,
        dispatch_wait_recv_cost_stats: torch.Tensor | None,
        use_fp8: bool,
        round_scale: bool,
        use_ue8m0: bool,
        async_finish: bool,
        return_recv_hook: bool,
    ) -> tuple:
        try:
            x, topk_idx, m, recv_stats, wait_stats = self._check_dispatch(
                x,
                topk_idx,
                num_max_dispatch_tokens_per_rank,
                num_experts,
                cumulative_local_expert_recv_stats,
                dispatch_wait_recv_cost_stats,
                use_fp8,
                round_scale,
                use_ue8m0,
                async_finish,
                return_recv_hook,
            )
        except REFUSABLE as exc:
            self._refuse("low_latency_dispatch", exc)
        if self._layout is None:  # the first dispatch lays the buffer out, before it takes a set
            self.transport.lay_out("low_latency_dispatch", m, x.shape[1], num_experts)
            self._layout = (m, x.shape[1], num_experts)
        s = self.sets.take("low_latency_dispatch")
        self._calls += 1
        out = self.transport.dispatch(DispatchRequest(x, topk_idx, m, num_experts, use_fp8, round_scale, use_ue8m0, s))

        def receive() -> None:
            waited = out.finish()
            out.handle.received = True
            if recv_stats is not None:
                recv_stats.add_(out.recv_count)
            if wait_stats is not None:
                wait_stats.add_(waited)

        hook = self._deferred(receive, s, f"low_latency_dispatch call #{self._calls}", return_recv_hook)
        recv_x = out.recv_x if out.recv_scales is None else (out.recv_x, out.recv_scales)
        return recv_x, out.recv_count, out.handle, self._event(async_finish), hook

    def _check_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        m: int,
        num_experts: int,
        recv_stats: torch.Tensor | None,
        wait_stats: torch.Tensor | None,
        use_fp8: bool,
        round_scale: bool,
        use_ue8m0: bool,
        async_finish: bool,
        return_recv_hook: bool,
    ) -> tuple:
        """A dispatch's arguments validated, and that the next buffer set is free to take: ``(x, topk_idx, m,
        recv_stats, wait_stats)``."""
        x = self._check("x", x, (torch.bfloat16,), (None, None)).contiguous()
        n, hidden = x.shape
        self._check_shapes(m, hidden, num_experts)
        self._check_layout("x", m, hidden, num_experts)
        if n > m:
            raise ValueError(f"x: {n} tokens exceed num_max_dispatch_tokens_per_rank={m}")
        topk_idx = self._check_topk(topk_idx, n)
        for name, flag in (
            ("use_fp8", use_fp8),
            ("round_scale", round_scale),
            ("use_ue8m0", use_ue8m0),
            ("async_finish", async_finish),
            ("return_recv_hook", return_recv_hook),
        ):
            if not isinstance(flag, bool):
                raise TypeError(f"{name}: expected a bool, got {type(flag).__name__}")
        if (round_scale or use_ue8m0) and not use_fp8:
            raise ValueError("round_scale/use_ue8m0: only meaningful with use_fp8=True")
        if use_ue8m0 and not round_scale:
            raise ValueError("use_ue8m0: packed UE8M0 scales need power-of-two scales (pass round_scale=True)")
        if use_ue8m0 and hidden % UE8M0_PACK:
            raise ValueError(
                f"x: packed UE8M0 scales need the hidden size to be a multiple of {UE8M0_PACK}, got {hidden}"
            )
        num_local = num_experts // self.num_ranks
        recv_stats = self._check_stats("cumulative_local_expert_recv_stats", recv_stats, torch.int32, num_local)
        wait_stats = self._check_stats("dispatch_wait_recv_cost_stats", wait_stats, torch.int64, self.num_ranks)
        self._check_hook_mode(async_finish, return_recv_hook)
        self.sets.check("low_latency_dispatch")
        return x, topk_idx, m, recv_stats, wait_stats

    def combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: object,
        use_logfmt: bool,
        zero_copy: bool,
        async_finish: bool,
        return_recv_hook: bool,
        out: torch.Tensor | None,
        combine_wait_recv_cost_stats: torch.Tensor | None,
    ) -> tuple:
        try:
            x, topk_idx, topk_weights, handle, out, wait_stats, s = self._check_combine(
                x,
                topk_idx,
                topk_weights,
                handle,
                use_logfmt,
                zero_copy,
                async_finish,
                return_recv_hook,
                out,
                combine_wait_recv_cost_stats,
            )
        except REFUSABLE as exc:
            self._refuse("low_latency_combine", exc)
        self._calls += 1
        finish = self.transport.combine(
            x if zero_copy else x.contiguous(), topk_idx, topk_weights, handle, zero_copy, out, s
        )

        def receive() -> None:
            waited = finish()
            if wait_stats is not None:
                wait_stats.add_(waited)

        hook = self._deferred(receive, s, f"low_latency_combine call #{self._calls}", return_recv_hook)
        return out, self._event(async_finish), hook

    def _check_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: object,
        use_logfmt: bool,
        zero_copy: bool,
        async_finish: bool,
        return_recv_hook: bool,
        out: torch.Tensor | None,
        wait_stats: torch.Tensor | None,
    ) -> tuple:
        """A combine's arguments validated, ``out`` allocated, and the buffer set it takes: ``(x, topk_idx,
        topk_weights, handle, out, wait_stats, set)``."""
        handle = self._check_handle(handle)
        if self._layout is None:
            raise ValueError(
                "handle: this buffer has made no low-latency dispatch (the handle comes from another buffer)"
            )
        self._check_layout("handle", handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts)
        if use_logfmt:
            raise ValueError(
                "use_logfmt: LogFMT-10 combine is not built in this library; combine in BF16 (use_logfmt=False)"
            )
        num_local, rows, hidden = (
            handle.num_local_experts,
            self.num_ranks * handle.num_max_dispatch_tokens_per_rank,
            handle.hidden,
        )
        x = self._check("x", x, (torch.bfloat16,), (num_local, rows, hidden))
        topk_idx = self._check_topk(topk_idx, handle.num_tokens)
        topk_weights = self._check("topk_weights", topk_weights, (torch.float32,), tuple(topk_idx.shape)).contiguous()
        if out is not None:
            out = self._check("out", out, (torch.bfloat16,), (handle.num_tokens, hidden))
            if not out.is_contiguous():
                raise ValueError("out: expected a contiguous tensor (the result is written in place)")
        wait_stats = self._check_stats("combine_wait_recv_cost_stats", wait_stats, torch.int64, self.num_ranks)
        self._check_hook_mode(async_finish, return_recv_hook)
        if not handle.received:
            raise RuntimeError("handle: its dispatch's data has not arrived (run the dispatch's receive hook first)")
        if out is None:
            out = torch.empty(handle.num_tokens, hidden, dtype=torch.bfloat16, device=self.device)
        s = self.sets.take("low_latency_combine", zero_copy_of=handle if zero_copy else None)
        return x, topk_idx, topk_weights, handle, out, wait_stats, s

    def combine_buffer(self, handle: object) -> torch.Tensor:
        """``[L, R*M, H]`` BF16: where a zero-copy combine of ``handle`` reads the expert outputs from."""
        handle = self._check_handle(handle)
        return self.transport.combine_buffer(handle, self.sets.hand_out_zero_copy(handle))

    def clean(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        try:
            positive_int(hidden, "hidden")
            self._check_shapes(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        except REFUSABLE as exc:
            self._refuse("clean_low_latency_buffer", exc)
        self.transport.lay_out("clean_low_latency_buffer", num_max_dispatch_tokens_per_rank, hidden, num_experts)
        self.transport.clean(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        self.sets.clean()
        self._layout = (num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def _refuse(self, call: str, exc: Exception) -> NoReturn:
        """Raise ``exc``, this rank's bad input to ``call``, on every rank alike (the peers are in the same call and
        would otherwise wait for this rank until they time out): the transport tells the peers, in the call itself
        on the buffer's layout, or in the agreement of a call that lays the buffer out (the first dispatch, a
        clean). A combine on a buffer without a layout has no dispatch behind it on any rank: only this rank
        raises."""
        layout = None if call == "clean_low_latency_buffer" else self._layout
        if layout is not None or call != "low_latency_combine":
            self.transport.refuse(call, exc, layout, self.sets.next)
        raise exc

    def _check_handle(self, handle: object) -> LowLatencyHandle:
        if not isinstance(handle, LowLatencyHandle):
            raise TypeError(
                f"handle: expected the handle returned by low_latency_dispatch, got {type(handle).__name__}"
            )
        if handle.rank != self.rank or handle.num_ranks != self.num_ranks:
            raise ValueError("handle: it was made by a buffer on a different group")
        return handle

    def _deferred(
        self, receive: Callable[[], None], s: int, what: str, return_recv_hook: bool
    ) -> Callable[[], None] | None:
        """Run ``receive`` now (no hook: the call returns with the data arrived), or return DeepEP's hook that
        runs it once, keeping set ``s`` live until then."""
        if not return_recv_hook:
            receive()
            return None
        release = self.sets.hold(s, what)
        ran = [False]

        def hook() -> None:
            if ran[0]:
                raise RuntimeError(f"{what}: its receive hook already ran")
            release()
            ran[0] = True
            receive()

        return hook

    def _event(self, async_finish: bool) -> EventOverlap:
        """The calls run on the current stream: an event there is the point their outputs are complete."""
        if not async_finish or self.device.type != "cuda":
            return EventOverlap()
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return EventOverlap(event)
