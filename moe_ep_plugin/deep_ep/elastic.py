"""DeepEP V2's ``ElasticBuffer`` on ``moe_ep_plugin.Buffer`` (``EPHandle``: handle.py; DeepEP 2.5/2.6's ``EPBuffer``:
ep_buffer.py).

Every transport of the Buffer serves them (``torch`` on gloo or NCCL, ``nvlink``, ``hierarchical``): the
non-expanded dispatch is :meth:`moe_ep_plugin.Buffer.dispatch`, the expanded one (``do_expand=True``, rows grouped
by local expert) is :meth:`moe_ep_plugin.Buffer.dispatch_experts`, and combine is ``Buffer.combine`` or
``Buffer.combine_experts``. What differs from DeepEP is listed in docs/compat.md; in short:

- Rows arrive in a fixed order (source rank, then source token; inside an expert's block of the expanded layout
  the same order), so ``deterministic=True`` costs nothing and changes nothing.
- ``do_cpu_sync=False`` reads nothing on the host and gives DeepEP V2's capacity-sized outputs: not expanded,
  ``num_ranks * num_max_tokens_per_rank`` rows, the valid prefix ``handle.psum_num_recv_tokens_per_scaleup_rank[-1]``;
  expanded, that times ``min(num_topk, num_local_experts)`` plus ``num_local_experts * (expert_alignment - 1)``,
  rounded up to ``expert_alignment`` (``handle.num_expanded_tokens``), expert ``i``'s real rows starting at the
  aligned end of expert ``i - 1``'s and ending at ``handle.psum_num_recv_tokens_per_expert[i]``. The expanded form is
  the non-expanded dispatch into capacity rows, each (row, local expert) pair then placed by device-side offsets
  (``ops.permute.expert_slots``); its cached dispatch and combine replay those offsets. The rows, their order and
  every sum equal the CPU-sync path's bit for bit. As in DeepEP, a token counts at most ``min(num_topk,
  num_local_experts)`` times in the capacity: a top-k row naming one expert twice may overflow it.
- Queue pairs, service levels, hybrid/direct RDMA modes, NVLink connection checks and Engram/PP/AGRS regions are
  DeepEP's NCCL-GIN machinery: the arguments are validated and recorded, and mean nothing here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..buffer_cache import lease_buffer
from ..config import combine_config, dispatch_config, positive_int
from ..event import EventOverlap
from ..ops import permute
from . import layout
from .arguments import (
    DispatchArgs,
    check_bool,
    check_expanded,
    check_num_sms,
    check_seconds,
    dispatch_args,
    group_size,
)
from .combine_dtype import check_out_dtype, widened
from .handle import EPHandle, check_handle, make_handle
from .layout import XInput
from .sizing import BUFFER_ALIGNMENT, DEFAULT_NVLINK_GBS, buffer_size_hint, theoretical_num_sms
from .streams import run_epilogue, run_prologue, stream_args
from .utils import EventHandle

Bias = torch.Tensor | tuple[torch.Tensor, ...] | None


class ElasticBuffer:
    """DeepEP V2's ``ElasticBuffer`` (high-throughput dispatch/combine) on this library's transports.

    Beyond DeepEP's arguments, keyword-only: ``transport`` (``moe_ep_plugin.Buffer``'s: ``auto``, ``torch``,
    ``nvlink``, ``hierarchical``, ...), ``device`` and ``ranks_per_node`` (emulated nodes), passed to the Buffer.

    Buffers of one group, transport, device, emulated nodes and ``num_cpu_timeout_secs`` share one Buffer (one
    peer-memory pool; ``buffer_cache.lease_buffer``), as large as the largest ``num_bytes`` asked for: a model may
    make one per layer. Their calls run one after another, in the order issued (docs/compat.md says what it costs).
    """

    # DeepEP 2.5 (EPBuffer) keeps topk_idx by reference and checks it was not modified.
    _reference_topk_idx = False

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_bytes: int | None = None,
        num_cpu_bytes: int = 0,
        num_max_tokens_per_rank: int = 0,
        hidden: int = 0,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        deterministic: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
        prefer_overlap_with_compute: bool = True,
        sl_idx: int = 3,
        num_allocated_qps: int = 0,
        num_cpu_timeout_secs: int = 300,
        num_gpu_timeout_secs: int = 100,
        explicitly_destroy: bool = False,
        *,
        transport: str = "auto",
        device: torch.device | str | None = None,
        ranks_per_node: int | None = None,
    ) -> None:
        """Make the buffer (collective over ``group``).

        Arguments:
            group: the expert-parallel process group.
            num_bytes: bytes of peer memory (the ``nvlink``/``hierarchical`` transports' receive buffers); None:
                :meth:`get_buffer_size_hint` of ``hidden``.
            num_cpu_bytes: DeepEP's Engram CPU region: must be 0 (Engram is not served).
            num_max_tokens_per_rank: the most tokens any rank dispatches (the same on every rank): sizes the
                capacity outputs of ``do_cpu_sync=False`` and the global source index of ``recv_src_metadata``.
            hidden: the hidden size the buffer is sized for (with ``num_bytes=None``).
            num_topk: recorded (the hint does not depend on it here).
            use_fp8_dispatch: recorded; FP8 ``(data, scales)`` input is accepted whatever it says.
            deterministic: accepted: every dispatch and combine of this library is deterministic already.
            allow_hybrid_mode, prefer_overlap_with_compute, sl_idx, num_allocated_qps, num_gpu_timeout_secs:
                DeepEP's RDMA/QP settings: validated and recorded, mean nothing here.
            allow_multiple_reduction: False (DeepEP: one reduction of a token's rows, at its source) refuses an
                expanded combine, which here reduces each rank's rows first.
            num_cpu_timeout_secs: seconds a rank waits for its peers (the Buffer's ``timeout_s``).
            explicitly_destroy: :meth:`destroy` must be called (it is refused otherwise, as in DeepEP).
        """
        self._setup(
            group,
            num_bytes,
            num_cpu_bytes,
            num_max_tokens_per_rank,
            hidden,
            num_topk,
            use_fp8_dispatch,
            deterministic,
            allow_hybrid_mode,
            allow_multiple_reduction,
            prefer_overlap_with_compute,
            sl_idx,
            num_allocated_qps,
            num_cpu_timeout_secs,
            num_gpu_timeout_secs,
            explicitly_destroy,
            transport,
            device,
            ranks_per_node,
        )

    def _setup(
        self,
        group: dist.ProcessGroup,
        num_bytes: int | None,
        num_cpu_bytes: int,
        num_max_tokens_per_rank: int,
        hidden: int,
        num_topk: int,
        use_fp8_dispatch: bool,
        deterministic: bool,
        allow_hybrid_mode: bool,
        allow_multiple_reduction: bool,
        prefer_overlap_with_compute: bool,
        sl_idx: int | None,
        num_allocated_qps: int,
        num_cpu_timeout_secs: float,
        num_gpu_timeout_secs: float,
        explicitly_destroy: bool,
        transport: str,
        device: torch.device | str | None,
        ranks_per_node: int | None,
    ) -> None:
        num_ranks = group_size(group)
        if num_bytes is not None:
            positive_int(num_bytes, "num_bytes", 0)
        if positive_int(num_cpu_bytes, "num_cpu_bytes", 0):
            raise ValueError("num_cpu_bytes: DeepEP's Engram CPU storage is not served by moe_ep_plugin; pass 0")
        self.num_max_tokens_per_rank = positive_int(num_max_tokens_per_rank, "num_max_tokens_per_rank", 0)
        self.hidden = positive_int(hidden, "hidden", 0)
        self.num_topk = positive_int(num_topk, "num_topk", 0)
        self.use_fp8_dispatch = check_bool("use_fp8_dispatch", use_fp8_dispatch)
        self.deterministic = check_bool("deterministic", deterministic)
        self.allow_hybrid_mode = check_bool("allow_hybrid_mode", allow_hybrid_mode)
        self.allow_multiple_reduction = check_bool("allow_multiple_reduction", allow_multiple_reduction)
        self.prefer_overlap_with_compute = check_bool("prefer_overlap_with_compute", prefer_overlap_with_compute)
        self.explicitly_destroy = check_bool("explicitly_destroy", explicitly_destroy)
        if sl_idx is not None:
            positive_int(sl_idx, "sl_idx", 0)
        self.num_allocated_qps = positive_int(num_allocated_qps, "num_allocated_qps", 0)
        check_seconds("num_cpu_timeout_secs", num_cpu_timeout_secs)
        check_seconds("num_gpu_timeout_secs", num_gpu_timeout_secs)
        if num_bytes is None:
            num_bytes = self.get_buffer_size_hint(
                group,
                num_max_tokens_per_rank,
                max(hidden, 1),
                num_topk,
                use_fp8_dispatch,
                allow_hybrid_mode,
                allow_multiple_reduction,
            )
        self.num_bytes = num_bytes
        # what the shared Buffer is leased with besides its size (EPBuffer.resize leases again)
        self._buffer_kw = dict(
            transport=transport,
            timeout_s=float(num_cpu_timeout_secs),
            device=device,
            ranks_per_node=ranks_per_node,
        )
        self._lease = lease_buffer(group, num_bytes, **self._buffer_kw)
        self.buffer = self._lease.buffer
        self.group = group
        self.rank_idx = self.buffer.rank
        self.num_ranks = num_ranks
        # the hierarchical transport's nodes are the scale-out domain, its ranks per node the scale-up one
        self.num_scaleup_ranks = getattr(self.buffer.transport, "ranks_per_node", num_ranks)
        self.num_scaleout_ranks = num_ranks // self.num_scaleup_ranks
        self.scaleout_rank_idx = self.rank_idx // self.num_scaleup_ranks
        self.scaleup_rank_idx = self.rank_idx % self.num_scaleup_ranks
        self.num_rdma_ranks, self.num_nvlink_ranks = self.num_scaleout_ranks, self.num_scaleup_ranks

    # ---- sizing and tuning ----
    @staticmethod
    def get_buffer_size_hint(
        group: dist.ProcessGroup,
        num_max_tokens_per_rank: int,
        hidden: int,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
    ) -> int:
        """Peer-memory bytes for rows of ``hidden`` BF16 values (FP8 rows fit in the same), 2 MB aligned.

        Arguments:
            group: the process group the buffer will serve.
            num_max_tokens_per_rank: the most tokens a rank dispatches (validated; this library's peer buffers
                are chunked rings, so the size does not grow with it).
            hidden: the hidden size.
            num_topk, use_fp8_dispatch, allow_hybrid_mode, allow_multiple_reduction: as DeepEP (do not change the
                size here).

        Returns:
            The byte count to pass as ``num_bytes``.
        """
        return buffer_size_hint(group_size(group), num_max_tokens_per_rank, hidden, num_topk)

    def get_theoretical_num_sms(
        self,
        num_experts: int,
        num_topk: int,
        num_scaleout_topk: int = 0,
        rdma_gbs: float = 0,
        nvlink_gbs: float = 0,
        sm_read_gbs: float = 200,
        sm_write_gbs: float = 50,
    ) -> int:
        """SMs that keep the NVLink busy under this library's kernels, for uniformly routed tokens.

        The model: each send block copies a token's row into every receiving peer's ring at ``sm_write_gbs``
        (stores to remote memory), each receive block drains its ring into the output at ``sm_read_gbs`` (local
        reads); blocks come in send/receive pairs. Of the rows a send block writes, ``(n - 1) / n`` go to peers
        over NVLink (``n`` ranks per node; experts spread uniformly over the ranks, so the share does not depend
        on ``num_topk``). Filling ``nvlink_gbs`` of peer traffic needs ``nvlink_gbs / ((n-1)/n)`` of ring writes
        in all, hence ``ceil(that / sm_write_gbs)`` send blocks and ``ceil(that / sm_read_gbs)`` receive blocks; the
        pair count is the larger. Across nodes the hierarchical transport's NVLink stage is the same model over
        the ranks of one node; the network stage is NCCL's and uses none of these blocks.

        Arguments:
            num_experts, num_topk: the routing.
            num_scaleout_topk: must be 0 (DeepEP's group-limited variant is not modelled).
            rdma_gbs: accepted (the network stage takes no SMs here).
            nvlink_gbs: per-direction NVLink bandwidth (0: ``DEFAULT_NVLINK_GBS``).
            sm_read_gbs, sm_write_gbs: one SM's local-read and remote-write bandwidth.

        Returns:
            An even SM count, at least ``MIN_NUM_SMS``, at most the device's SMs (on CUDA).
        """
        return theoretical_num_sms(
            self.num_ranks,
            self.num_scaleup_ranks,
            self.buffer.device,
            num_experts,
            num_topk,
            num_scaleout_topk,
            rdma_gbs,
            nvlink_gbs,
            sm_read_gbs,
            sm_write_gbs,
        )

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """0: this library opens no RDMA queue pairs (the network stage is NCCL's)."""
        positive_int(num_sms, "num_sms", 0)
        return 0

    # ---- streams, domains, lifetime ----
    @staticmethod
    def capture() -> EventHandle:
        """An ``EventHandle`` at the current point of the current stream (pass it as ``previous_event``)."""
        return EventHandle()

    def get_comm_stream(self) -> torch.cuda.Stream | None:
        """The communication stream (None on the CPU)."""
        return self.buffer.get_comm_stream()

    def get_physical_domain_size(self) -> tuple[int, int]:
        """``(nodes, ranks per node)`` of the group (emulated nodes count as nodes)."""
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_logical_domain_size(self) -> tuple[int, int]:
        """``(scale-out ranks, scale-up ranks)``: the same as the physical sizes here."""
        return self.num_scaleout_ranks, self.num_scaleup_ranks

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        """A barrier over the group (``use_comm_stream``/``sequential`` mean nothing here; ``with_cpu_sync``
        synchronizes the device before and after)."""
        if with_cpu_sync and self.buffer.device.type == "cuda":
            torch.cuda.synchronize(self.buffer.device)
        dist.barrier(group=self.group)
        if with_cpu_sync and self.buffer.device.type == "cuda":
            torch.cuda.synchronize(self.buffer.device)

    def destroy(self) -> None:
        """Release this buffer's share of the shared Buffer, which the last holder's release destroys (collective
        then: every rank destroys the same buffers in the same order); only with ``explicitly_destroy=True``, as in
        DeepEP. Later calls on this buffer raise; again: nothing."""
        if not self.explicitly_destroy:
            raise ValueError(
                "explicitly_destroy: this buffer was made with explicitly_destroy=False; its share of the shared "
                "buffer is kept until the process ends"
            )
        self._lease.release()

    # ---- dispatch ----
    def dispatch(
        self,
        x: XInput,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        num_experts: int | None = None,
        num_max_tokens_per_rank: int | None = None,
        expert_alignment: int | None = None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event: object | None = None,
        previous_event_before_epilogue: object | None = None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
        handle: EPHandle | None = None,
        do_handle_copy: bool = True,
        do_cpu_sync: bool | None = None,
        do_expand: bool = False,
        do_zero_padding: bool = False,
        use_tma_aligned_col_major_sf: bool = False,
    ):
        """Send each token to the ranks of its experts.

        Arguments:
            x: ``[T, H]`` BF16 (FP16 and FP32 accepted), or the FP8 pair ``(float8_e4m3fn [T, H], float32 scales
                [T, H/128])``; the rows arrive in the same form.
            topk_idx: ``[T, K]`` ``topk_idx_t`` (int64; int32 accepted) global expert ids, -1 = none; None with
                ``handle``.
            topk_weights: ``[T, K]`` float32, carried with the rows; with ``handle`` (optional) they are carried in
                the handle's layout (the backward of an expanded combine with weights).
            cumulative_local_expert_recv_stats: ``[L]`` int32, the received (token, expert) pairs of each local
                expert are added to it (not for a cached dispatch).
            num_experts: the total expert count (the handle's with ``handle``).
            num_max_tokens_per_rank: the most tokens any rank dispatches (default: the constructor's); ``T`` must
                not exceed it.
            expert_alignment: each local expert's count (and, expanded, its block of rows) is rounded up to a
                multiple of this (default 1; the handle's with ``handle``).
            num_sms: SMs of the kernels (0: :meth:`get_theoretical_num_sms`); an even count (odd: a ValueError).
            num_qps: accepted (no queue pairs here).
            previous_event: an ``EventHandle`` (from :meth:`capture`) the communication waits for; needs
                ``allocate_on_comm_stream``.
            previous_event_before_epilogue: the call also waits for it (this library has no separate epilogue).
            async_with_compute_stream: return without making the current stream wait; the returned event does.
            allocate_on_comm_stream: outputs are owned by the communication stream (needs ``previous_event``).
            handle: an ``EPHandle`` from an earlier dispatch on this buffer: its layout is reused (no top-k, no
                host read of counts).
            do_handle_copy: the handle keeps a clone of ``topk_idx`` (else the caller's tensor).
            do_cpu_sync: True (default without ``handle``): exact-size outputs. False: capacity-sized outputs
                (module docstring), valid prefix in the handle. Must not be True with ``handle``.
            do_expand: rows grouped by local expert, one row per (token, local expert), each expert's block padded
                with zero rows to ``expert_alignment``; ``recv_topk_idx`` is None and ``recv_topk_weights`` 1-D.
                With ``handle`` it must equal ``handle.do_expand``.
            do_zero_padding: (expanded only) padding rows are zero: always so here.
            use_tma_aligned_col_major_sf: FP8 scales returned column-major with rows padded to 4 in storage.

        Returns:
            ``(recv_x, recv_topk_idx, recv_topk_weights, handle, event)``: ``recv_x`` ``[rows, H]`` (a pair for FP8),
            ``recv_topk_idx`` ``[rows, K]`` int64 local ids / -1 (None expanded; a cached dispatch returns the fresh
            one's again), ``recv_topk_weights``
            ``[rows, K]`` float32 (expanded: ``[rows]``; None without weights), the :class:`EPHandle`, and an
            ``EventOverlap`` (waitable; it holds an event only with ``async_with_compute_stream`` on CUDA).
        """
        return self._dispatch(
            x,
            topk_idx,
            topk_weights,
            cumulative_local_expert_recv_stats,
            num_experts,
            num_max_tokens_per_rank,
            expert_alignment,
            num_sms,
            num_qps,
            previous_event,
            previous_event_before_epilogue,
            async_with_compute_stream,
            allocate_on_comm_stream,
            handle,
            do_handle_copy,
            do_cpu_sync,
            do_expand,
            do_zero_padding,
            use_tma_aligned_col_major_sf,
        )

    def _dispatch(
        self,
        x: XInput,
        topk_idx: torch.Tensor | None,
        topk_weights: torch.Tensor | None,
        stats: torch.Tensor | None,
        num_experts: int | None,
        num_max_tokens_per_rank: int | None,
        expert_alignment: int | None,
        num_sms: int,
        num_qps: int,
        previous_event: object,
        before_epilogue: object,
        async_with_compute_stream: bool,
        allocate_on_comm_stream: bool,
        handle: EPHandle | None,
        do_handle_copy: bool,
        do_cpu_sync: bool | None,
        do_expand: bool,
        do_zero_padding: bool,
        use_tma_aligned_col_major_sf: bool,
    ):
        def check() -> tuple[DispatchArgs, int]:
            return (
                dispatch_args(
                    self,
                    x,
                    topk_idx,
                    stats,
                    num_experts,
                    num_max_tokens_per_rank,
                    expert_alignment,
                    num_qps,
                    handle,
                    do_handle_copy,
                    do_cpu_sync,
                    do_expand,
                    do_zero_padding,
                    use_tma_aligned_col_major_sf,
                ),
                check_num_sms(num_sms),
            )

        self._lease.check_live()
        # a fresh dispatch's refusal travels in the count exchange: every rank raises it (Buffer.refusing)
        args, sms = self.buffer.refusing("dispatch", handle, check)
        sms = sms or self.get_theoretical_num_sms(args.num_experts, max(args.num_topk, 1))
        kw = stream_args(
            self.buffer,
            dispatch_config(sms, self.num_ranks),
            previous_event,
            before_epilogue,
            async_with_compute_stream,
            allocate_on_comm_stream,
        )
        if args.handle is not None:
            return self._cached_dispatch(x, topk_weights, args.handle, kw, args.sf_col_major)
        local = args.num_experts // self.num_ranks if args.num_experts % max(self.num_ranks, 1) == 0 else 0
        if args.do_expand:
            return self._expand_dispatch(x, topk_idx, topk_weights, stats, args, sms, local, kw)
        return self._plain_dispatch(x, topk_idx, topk_weights, stats, args, sms, local, kw)

    def _plain_dispatch(
        self,
        x: XInput,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor | None,
        stats: torch.Tensor | None,
        args: DispatchArgs,
        sms: int,
        local: int,
        kw: dict,
        expand: bool = False,
    ):
        """The non-expanded dispatch: one row per (token, rank). With ``expand`` (no CPU sync), the expanded one built
        on it: each (row, local expert) pair moved to its expert-major row (``permute.expert_slots``: per-expert pairs
        counted, aligned and prefix-summed on the device) of DeepEP's worst-case rows, no count read."""
        alignment, t_max = args.alignment, args.t_max
        capacity = 0 if args.cpu_sync else self.num_ranks * t_max
        recv_x, recv_idx, recv_w, counts, inner, event = self.buffer.dispatch(
            x,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
            num_experts=args.num_experts,
            expert_alignment=alignment,
            num_worst_tokens=capacity,
            **kw,
        )
        out_rows = (
            layout.expanded_capacity(self.num_ranks, t_max, args.num_topk, local, alignment)
            if expand
            else recv_idx.shape[0]
        )

        def epilogue() -> tuple:
            per_expert = layout.count_local(recv_idx, local)
            if stats is not None:
                stats.add_(per_expert.to(torch.int32))
            slot, words = permute.expert_slots(recv_idx, local, alignment) if expand else (None, None)
            meta, psum_rank = layout.source_metadata(
                inner,
                self.rank_idx,
                self.num_scaleout_ranks,
                self.num_scaleup_ranks,
                recv_idx.shape[0],
                args.num_topk,
                t_max,
                slot,
            )
            if not expand:
                aligned = (per_expert + alignment - 1) // alignment * alignment
                psum = aligned.cumsum(0).to(torch.int32)
                return meta, psum_rank, psum, None, layout.sf_layout(recv_x, args.sf_col_major), recv_w, None
            blocks = words[2:]  # each local expert's aligned rows
            out_x, out_probs = layout.expand_rows(recv_x, recv_w, slot, out_rows)
            psum = (blocks.cumsum(0) - blocks + per_expert).to(torch.int32)  # aligned start + real count
            out_x = layout.sf_layout(out_x, args.sf_col_major)
            return meta, psum_rank, psum, per_expert.to(torch.int32), out_x, out_probs, slot

        (meta, psum_rank, psum_expert, real, out_x, out_w, slot), event = run_epilogue(self.buffer, event, epilogue)
        # without a CPU sync the count stays on the device (some transports know it, nvlink and local do not)
        num_recv = inner.num_recv_tokens if args.cpu_sync else recv_idx.shape[0]
        ep_handle = make_handle(
            self,
            args,
            sms,
            topk_idx,
            num_recv,
            out_rows if expand else 0,
            counts,
            psum_rank,
            psum_expert,
            real,
            meta,
            inner,
            recv_idx,
            out_rows,
            slot,
        )
        return out_x, None if expand else recv_idx, out_w, ep_handle, event

    def _expand_dispatch(
        self,
        x: XInput,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor | None,
        stats: torch.Tensor | None,
        args: DispatchArgs,
        sms: int,
        local: int,
        kw: dict,
    ):
        """The expanded dispatch: rows grouped by local expert, one per (token, local expert)."""
        if not args.cpu_sync:
            return self._plain_dispatch(x, topk_idx, topk_weights, stats, args, sms, local, kw, expand=True)
        expert_x, expert_sf, probs, tokens_per_expert, inner, event = self.buffer.dispatch_experts(
            x, topk_idx, topk_weights, args.num_experts, expert_alignment=args.alignment, **kw
        )
        expert_layout = inner.expert_layout
        rows = expert_layout.num_rows

        def epilogue() -> tuple:
            slots = expert_layout.recv_slot
            starts, real = layout.expanded_blocks(tokens_per_expert, slots, local)
            if stats is not None:
                stats.add_(real.to(torch.int32))
            meta, psum_rank = layout.source_metadata(
                inner,
                self.rank_idx,
                self.num_scaleout_ranks,
                self.num_scaleup_ranks,
                slots.shape[0],
                args.num_topk,
                args.t_max,
                slots,
            )
            recv_x = expert_x if expert_sf is None else (expert_x, expert_sf)
            return (
                meta,
                psum_rank,
                (starts + real).to(torch.int32),
                real.to(torch.int32),
                layout.sf_layout(recv_x, args.sf_col_major),
                probs,
            )

        (meta, psum_rank, psum_expert, real, out_x, out_probs), event = run_epilogue(self.buffer, event, epilogue)
        ep_handle = make_handle(
            self,
            args,
            sms,
            topk_idx,
            inner.num_recv_tokens,
            rows,
            tokens_per_expert,
            psum_rank,
            psum_expert,
            real,
            meta,
            inner,
            None,
            rows,
        )
        return out_x, None, out_probs, ep_handle, event

    def _cached_dispatch(
        self, x: XInput, topk_weights: torch.Tensor | None, handle: EPHandle, kw: dict, sf_col_major: bool
    ):
        slot = handle._expert_slot
        if handle.do_expand and slot is None:
            expert_x, expert_sf, _, _, _, event = self.buffer.dispatch_experts(x, handle=handle.inner, **kw)
            recv_x = expert_x if expert_sf is None else (expert_x, expert_sf)
        else:
            recv_x, _, _, _, _, event = self.buffer.dispatch(x, handle=handle.inner, **kw)
        recv_w = None
        if topk_weights is not None:
            recv_w, event = self._cached_weights(topk_weights, handle, kw, event)

        def epilogue() -> tuple:
            if slot is not None:  # expanded without a CPU sync: the fresh dispatch's offsets, on the device
                return (
                    layout.sf_layout(layout.expand_rows(recv_x, None, slot, handle._out_rows)[0], sf_col_major),
                    None,
                    recv_w,
                )
            # the non-expanded form returns the fresh dispatch's local ids again, as DeepEP does
            recv_idx = None if handle.do_expand else layout.pad_rows(handle._recv_topk_idx, handle._out_rows).clone()
            return (
                layout.sf_layout(layout.pad_rows(recv_x, handle._out_rows), sf_col_major),
                recv_idx,
                layout.pad_rows(recv_w, handle._out_rows),
            )

        (out_x, recv_idx, out_w), event = run_epilogue(self.buffer, event, epilogue)
        return out_x, recv_idx, out_w, handle, event

    def _cached_weights(
        self, topk_weights: torch.Tensor, handle: EPHandle, kw: dict, event: EventOverlap
    ) -> tuple[torch.Tensor, EventOverlap]:
        """``topk_weights`` ``[T, K]`` float32 carried bit for bit in a cached handle's layout (as BF16 pairs)."""
        num_tokens, num_topk = handle.topk_idx.shape
        if not (
            isinstance(topk_weights, torch.Tensor)
            and topk_weights.dtype == torch.float32
            and topk_weights.shape == (num_tokens, num_topk)
        ):
            raise ValueError(
                f"topk_weights: expected a float32 tensor [{num_tokens}, {num_topk}] (the handle's top-k shape)"
            )
        packed = run_prologue(self.buffer, kw, lambda: layout.pack_weights(topk_weights), (topk_weights,))
        on_device = handle._expert_slot
        if handle.do_expand and on_device is None:
            rows, _, _, _, _, weights_event = self.buffer.dispatch_experts(packed, handle=handle.inner, **kw)
        else:
            rows, _, _, _, _, weights_event = self.buffer.dispatch(packed, handle=handle.inner, **kw)
        event = weights_event if weights_event.event is not None else event
        if on_device is not None:  # expanded without a CPU sync: the rows' weights placed by the fresh offsets
            return run_epilogue(
                self.buffer,
                event,
                lambda: layout.expand_weights(
                    layout.unpack_weights(rows, num_topk, handle._recv_topk_idx, None), on_device, handle._out_rows
                ),
            )
        slots = handle.inner.expert_layout.recv_slot if handle.do_expand else None
        return run_epilogue(
            self.buffer, event, lambda: layout.unpack_weights(rows, num_topk, handle._recv_topk_idx, slots)
        )

    # ---- combine ----
    def combine(
        self,
        x: torch.Tensor,
        handle: EPHandle,
        topk_weights: torch.Tensor | None = None,
        bias: Bias = None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event: object | None = None,
        previous_event_before_epilogue: object | None = None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """Sum the rows back to their tokens (the rows are not multiplied by any weight).

        Arguments:
            x: BF16 (FP32 accepted) rows in the handle's layout: not expanded ``[rows, H]``, one row per received
                token (the caller has reduced over its local experts); expanded ``[rows, H]``, one row per (token,
                local expert) (padding rows ignored). ``rows`` may be the capacity of a ``do_cpu_sync=False``
                dispatch: only the valid prefix is read.
            handle: the dispatch's :class:`EPHandle`.
            topk_weights: float32 ``[rows, K]`` (expanded: ``[rows]``), summed over ranks alongside (what a
                dispatch's backward needs for its weights' gradient). An expanded combine is refused on a buffer
                made with ``allow_multiple_reduction=False`` (see the constructor).
            bias: one ``[T, H]`` tensor or a pair, ``x.dtype``, added once per token in the fp32 sum over ranks,
                before the final rounding (expanded: each rank's sum of its rows is rounded to ``x.dtype`` first).
            num_sms: SMs (0: the handle's); num_qps: accepted.
            previous_event, previous_event_before_epilogue, async_with_compute_stream, allocate_on_comm_stream:
                as in :meth:`dispatch`.

        Returns:
            ``(combined_x [T, H] x.dtype, combined_topk_weights [T, K] float32 or None, event)``.
        """
        return self._combine(
            x,
            handle,
            topk_weights,
            bias,
            num_sms,
            num_qps,
            previous_event,
            previous_event_before_epilogue,
            async_with_compute_stream,
            allocate_on_comm_stream,
        )

    def _combine(
        self,
        x: torch.Tensor,
        handle: EPHandle,
        topk_weights: torch.Tensor | None,
        bias: Bias,
        num_sms: int,
        num_qps: int,
        previous_event: object,
        before_epilogue: object,
        async_with_compute_stream: bool,
        allocate_on_comm_stream: bool,
        out_dtype: torch.dtype | None = None,
    ):
        self._lease.check_live()
        handle = check_handle(handle, self)
        positive_int(num_qps, "num_qps", 0)
        sms = check_num_sms(num_sms) or handle.num_sms
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise TypeError(f"x: expected a [rows, hidden] tensor, got {type(x).__name__}")
        widen = check_out_dtype(out_dtype, x)
        kw = stream_args(
            self.buffer,
            combine_config(sms, self.num_ranks),
            previous_event,
            before_epilogue,
            async_with_compute_stream,
            allocate_on_comm_stream,
        )
        if x.shape[0] != handle._out_rows:
            raise ValueError(f"x: expected {handle._out_rows} rows (the dispatch's output), got {x.shape[0]}")
        if widen:
            x, bias = widened(self.buffer, kw, x, bias)
        if not handle.do_expand:
            return self.buffer.combine(x, handle.inner, topk_weights=topk_weights, bias=bias, **kw)
        check_expanded(handle, topk_weights, self.allow_multiple_reduction)
        slot = handle._expert_slot
        if slot is not None:
            # expanded without a CPU sync: each received row's pairs summed (top-k order, fp32, one rounding: what
            # combine_experts does per rank), then the rows over ranks, all from the device-side offsets
            def rows_of() -> tuple[torch.Tensor, torch.Tensor | None]:
                weights = None if topk_weights is None else layout.gather_weights(topk_weights, slot)
                return permute.unpermute(x.contiguous(), slot), weights

            reads = (x,) if topk_weights is None else (x, topk_weights)
            rows_x, rows_w = run_prologue(self.buffer, kw, rows_of, reads)
            return self.buffer.combine(rows_x, handle.inner, topk_weights=rows_w, bias=bias, **kw)
        rows = handle.num_expanded_tokens
        if topk_weights is not None:
            topk_weights = topk_weights[:rows]
        return self.buffer.combine_experts(x[:rows], handle.inner, expert_weights=topk_weights, bias=bias, **kw)


__all__ = ["BUFFER_ALIGNMENT", "DEFAULT_NVLINK_GBS", "EPHandle", "ElasticBuffer"]
