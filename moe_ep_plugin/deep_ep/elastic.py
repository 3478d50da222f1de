"""DeepEP V2's ``ElasticBuffer`` and ``EPHandle``, and DeepEP 2.5's ``EPBuffer``, on ``moe_ep_plugin.Buffer``.

Every transport of the Buffer serves them (``torch`` on gloo or NCCL, ``nvlink``, ``hierarchical``): the
non-expanded dispatch is :meth:`moe_ep_plugin.Buffer.dispatch`, the expanded one (``do_expand=True``, rows grouped
by local expert) is :meth:`moe_ep_plugin.Buffer.dispatch_experts`, and combine is ``Buffer.combine`` or
``Buffer.combine_experts``. What differs from DeepEP is listed in docs/compat.md; in short:

- Rows arrive in a fixed order (source rank, then source token; inside an expert's block of the expanded layout
  the same order), so ``deterministic=True`` costs nothing and changes nothing.
- ``do_cpu_sync=False`` gives capacity-sized outputs (``num_ranks * num_max_tokens_per_rank`` rows; expanded:
  that times ``min(num_topk, num_local_experts)`` plus ``num_local_experts * (expert_alignment - 1)``) whose valid
  prefix is ``handle.psum_num_recv_tokens_per_scaleup_rank[-1]`` (expanded: ``handle.num_expanded_tokens``). The
  non-expanded form reads no count on the host; the expanded one still does (its layout is sized from them).
- Queue pairs, service levels, hybrid/direct RDMA modes, NVLink connection checks and Engram/PP/AGRS regions are
  DeepEP's NCCL-GIN machinery: the arguments are validated and recorded, and mean nothing here.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from ..buffer import Buffer
from ..buffer_cache import nvl_bytes_hint
from ..config import combine_config, dispatch_config
from ..event import EventOverlap
from ..handle import DispatchHandle
from .utils import DeferredEpilogue, EventHandle, as_event_overlap

XInput = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
Bias = torch.Tensor | tuple[torch.Tensor, ...] | None

BUFFER_ALIGNMENT = 2 << 20  # DeepEP sizes its buffers in 2 MB units; the hint keeps that granularity
DEFAULT_NVLINK_GBS = 450.0  # one direction of an H100/H200's NVLink 4: the link the SM model fills
MIN_NUM_SMS = 2  # one send and one receive block: the smallest grid of this library's kernels


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def _check_int(name: str, value: object, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
    return value


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, (bool, int)) or value not in (0, 1):
        raise TypeError(f"{name}: expected a bool, got {value!r}")
    return bool(value)


def _group_size(group: object) -> int:
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group: expected a torch.distributed.ProcessGroup, got {type(group).__name__}")
    return dist.get_world_size(group)


class EPHandle:
    """The layout of one ``ElasticBuffer.dispatch``: reused by a cached dispatch and by ``combine``.

    Fields frameworks read (same meaning as DeepEP's; L = local experts, R = ranks):

    - ``do_expand``, ``num_experts``, ``expert_alignment``, ``num_max_tokens_per_rank``, ``num_sms``: the dispatch's.
    - ``topk_idx`` ``[T, K]``: the dispatch's top-k (a clone with ``do_handle_copy``, else the caller's tensor).
    - ``num_recv_tokens``: received tokens (one per (token, rank)); ``num_expanded_tokens``: rows of the expanded
      layout, alignment padding included (0 when not expanded).
    - ``num_recv_tokens_per_expert_list``: per local expert, received (token, expert) pairs rounded up to
      ``expert_alignment`` (a host list; empty without a CPU sync).
    - ``psum_num_recv_tokens_per_scaleup_rank`` ``[scaleup ranks]`` int32: inclusive prefix sum of received tokens
      by the source's rank inside its node (a flat group: by source rank); the last entry is the total.
    - ``psum_num_recv_tokens_per_expert`` ``[L]`` int32: not expanded, the inclusive prefix sum of the aligned
      counts; expanded, the aligned start of expert ``i`` plus its real count.
    - ``num_unaligned_recv_tokens_per_expert`` ``[L]`` int32: real counts (expanded only, else None).
    - ``recv_src_metadata`` ``[rows, 2 + K]`` int32: column 0 the source token's global index
      (``src_rank * num_max_tokens_per_rank + t``), column 1 the source rank, columns ``2:`` the expanded-layout
      row of each top-k column (-1 where that expert is not local, and everywhere when not expanded); rows past
      the received ones are -1.
    - ``dst_buffer_slot_idx``, ``token_metadata_at_forward``, ``channel_linked_list``: None (DeepEP's kernel
      bookkeeping; this library's handle keeps its own in ``inner``).
    """

    def __init__(self, *, do_expand: bool, num_experts: int, expert_alignment: int, num_max_tokens_per_rank: int,
                 num_sms: int, topk_idx: torch.Tensor, num_recv_tokens: int, num_expanded_tokens: int,
                 num_recv_tokens_per_expert_list: list[int], psum_num_recv_tokens_per_scaleup_rank: torch.Tensor,
                 psum_num_recv_tokens_per_expert: torch.Tensor,
                 num_unaligned_recv_tokens_per_expert: torch.Tensor | None, recv_src_metadata: torch.Tensor,
                 inner: DispatchHandle, recv_topk_idx: torch.Tensor | None, out_rows: int,
                 owner: ElasticBuffer, topk_idx_version: int | None) -> None:
        self.do_expand = do_expand
        self.num_experts = num_experts
        self.expert_alignment = expert_alignment
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_sms = num_sms
        self.topk_idx = topk_idx
        self.num_recv_tokens = num_recv_tokens
        self.num_expanded_tokens = num_expanded_tokens
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list
        self.psum_num_recv_tokens_per_scaleup_rank = psum_num_recv_tokens_per_scaleup_rank
        self.psum_num_recv_tokens_per_expert = psum_num_recv_tokens_per_expert
        self.num_unaligned_recv_tokens_per_expert = num_unaligned_recv_tokens_per_expert
        self.recv_src_metadata = recv_src_metadata
        self.dst_buffer_slot_idx = None
        self.token_metadata_at_forward = None
        self.channel_linked_list = None
        self.inner = inner  # moe_ep_plugin's DispatchHandle: what combine and the cached dispatch replay
        self._recv_topk_idx = recv_topk_idx  # the non-expanded dispatch's, masking weights of a cached one
        self._out_rows = out_rows  # rows of the dispatch's outputs (capacity without a CPU sync)
        self._owner = owner
        self._topk_idx_version = topk_idx_version


class ElasticBuffer:
    """DeepEP V2's ``ElasticBuffer`` (high-throughput dispatch/combine) on this library's transports.

    Beyond DeepEP's arguments, keyword-only: ``transport`` (``moe_ep_plugin.Buffer``'s: ``auto``, ``torch``,
    ``nvlink``, ``hierarchical``, ...), ``device`` and ``ranks_per_node`` (emulated nodes), passed to the Buffer.
    """

    # DeepEP 2.5 (EPBuffer) keeps topk_idx by reference and checks it was not modified.
    _reference_topk_idx = False

    def __init__(self, group: dist.ProcessGroup, num_bytes: int | None = None, num_cpu_bytes: int = 0,
                 num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0,
                 use_fp8_dispatch: bool = False, deterministic: bool = False, allow_hybrid_mode: bool = True,
                 allow_multiple_reduction: bool = True, prefer_overlap_with_compute: bool = True, sl_idx: int = 3,
                 num_allocated_qps: int = 0, num_cpu_timeout_secs: int = 300, num_gpu_timeout_secs: int = 100,
                 explicitly_destroy: bool = False, *, transport: str = "auto",
                 device: torch.device | str | None = None, ranks_per_node: int | None = None) -> None:
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
            allow_multiple_reduction: as DeepEP: False refuses ``topk_weights`` in an expanded combine.
            num_cpu_timeout_secs: seconds a rank waits for its peers (the Buffer's ``timeout_s``).
            explicitly_destroy: :meth:`destroy` must be called (it is refused otherwise, as in DeepEP).
        """
        self._setup(group, num_bytes, num_cpu_bytes, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch,
                    deterministic, allow_hybrid_mode, allow_multiple_reduction, prefer_overlap_with_compute, sl_idx,
                    num_allocated_qps, num_cpu_timeout_secs, num_gpu_timeout_secs, explicitly_destroy, transport,
                    device, ranks_per_node)

    def _setup(self, group: dist.ProcessGroup, num_bytes: int | None, num_cpu_bytes: int,
               num_max_tokens_per_rank: int, hidden: int, num_topk: int, use_fp8_dispatch: bool,
               deterministic: bool, allow_hybrid_mode: bool, allow_multiple_reduction: bool,
               prefer_overlap_with_compute: bool, sl_idx: int | None, num_allocated_qps: int,
               num_cpu_timeout_secs: float, num_gpu_timeout_secs: float, explicitly_destroy: bool, transport: str,
               device: torch.device | str | None, ranks_per_node: int | None) -> None:
        num_ranks = _group_size(group)
        if num_bytes is not None:
            _check_int("num_bytes", num_bytes, 0)
        if _check_int("num_cpu_bytes", num_cpu_bytes, 0):
            raise ValueError("num_cpu_bytes: DeepEP's Engram CPU storage is not served by moe_ep_plugin; pass 0")
        self.num_max_tokens_per_rank = _check_int("num_max_tokens_per_rank", num_max_tokens_per_rank, 0)
        self.hidden = _check_int("hidden", hidden, 0)
        self.num_topk = _check_int("num_topk", num_topk, 0)
        self.use_fp8_dispatch = _check_bool("use_fp8_dispatch", use_fp8_dispatch)
        self.deterministic = _check_bool("deterministic", deterministic)
        self.allow_hybrid_mode = _check_bool("allow_hybrid_mode", allow_hybrid_mode)
        self.allow_multiple_reduction = _check_bool("allow_multiple_reduction", allow_multiple_reduction)
        self.prefer_overlap_with_compute = _check_bool("prefer_overlap_with_compute", prefer_overlap_with_compute)
        self.explicitly_destroy = _check_bool("explicitly_destroy", explicitly_destroy)
        if sl_idx is not None:
            _check_int("sl_idx", sl_idx, 0)
        self.num_allocated_qps = _check_int("num_allocated_qps", num_allocated_qps, 0)
        for name, value in (("num_cpu_timeout_secs", num_cpu_timeout_secs),
                            ("num_gpu_timeout_secs", num_gpu_timeout_secs)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"{name}: expected a positive number of seconds, got {value!r}")
        if num_bytes is None:
            num_bytes = self.get_buffer_size_hint(group, num_max_tokens_per_rank, max(hidden, 1), num_topk,
                                                  use_fp8_dispatch, allow_hybrid_mode, allow_multiple_reduction)
        self.num_bytes = num_bytes
        self.buffer = Buffer(group, num_nvl_bytes=num_bytes, explicitly_destroy=self.explicitly_destroy,
                             transport=transport, timeout_s=float(num_cpu_timeout_secs), device=device,
                             ranks_per_node=ranks_per_node)
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
    def get_buffer_size_hint(group: dist.ProcessGroup, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0,
                             use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
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
        num_ranks = _group_size(group)
        _check_int("num_max_tokens_per_rank", num_max_tokens_per_rank, 0)
        _check_int("hidden", hidden, 1)
        _check_int("num_topk", num_topk, 0)
        return _align(nvl_bytes_hint(num_ranks, hidden * 2), BUFFER_ALIGNMENT)

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, num_scaleout_topk: int = 0,
                                rdma_gbs: float = 0, nvlink_gbs: float = 0, sm_read_gbs: float = 200,
                                sm_write_gbs: float = 50) -> int:
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
        _check_int("num_experts", num_experts, 1)
        _check_int("num_topk", num_topk, 1)
        if num_scaleout_topk != 0:
            raise ValueError("num_scaleout_topk: only 0 is modelled (uniform routing)")
        for name, value in (("rdma_gbs", rdma_gbs), ("nvlink_gbs", nvlink_gbs)):
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name}: expected a bandwidth >= 0 (0: default), got {value!r}")
        for name, value in (("sm_read_gbs", sm_read_gbs), ("sm_write_gbs", sm_write_gbs)):
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name}: expected a positive bandwidth, got {value!r}")
        if num_experts % self.num_ranks:
            raise ValueError(f"num_experts: {num_experts} is not a multiple of the {self.num_ranks} ranks")
        peers = self.num_scaleup_ranks
        if peers <= 1:
            return MIN_NUM_SMS  # no NVLink traffic to keep busy
        remote_share = (peers - 1) / peers
        ring_gbs = (nvlink_gbs or DEFAULT_NVLINK_GBS) / remote_share
        pairs = max(math.ceil(ring_gbs / sm_write_gbs), math.ceil(ring_gbs / sm_read_gbs))
        num_sms = max(MIN_NUM_SMS, 2 * pairs)
        if self.buffer.device.type == "cuda":
            device_sms = torch.cuda.get_device_properties(self.buffer.device).multi_processor_count
            num_sms = min(num_sms, device_sms // 2 * 2)
        return num_sms

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """0: this library opens no RDMA queue pairs (the network stage is NCCL's)."""
        _check_int("num_sms", num_sms, 0)
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
        """Release the buffer (collective); only with ``explicitly_destroy=True``, as in DeepEP."""
        if not self.explicitly_destroy:
            raise ValueError("explicitly_destroy: this buffer was made with explicitly_destroy=False; it is "
                             "released when dropped")
        if not self.buffer.destroyed:
            self.buffer.destroy()

    # ---- dispatch ----
    def dispatch(self, x: XInput, topk_idx: torch.Tensor | None = None,
                 topk_weights: torch.Tensor | None = None,
                 cumulative_local_expert_recv_stats: torch.Tensor | None = None, num_experts: int | None = None,
                 num_max_tokens_per_rank: int | None = None, expert_alignment: int | None = None,
                 num_sms: int = 0, num_qps: int = 0, previous_event: object | None = None,
                 previous_event_before_epilogue: object | None = None, async_with_compute_stream: bool = False,
                 allocate_on_comm_stream: bool = False, handle: EPHandle | None = None,
                 do_handle_copy: bool = True, do_cpu_sync: bool | None = None, do_expand: bool = False,
                 do_zero_padding: bool = False, use_tma_aligned_col_major_sf: bool = False):
        """Send each token to the ranks of its experts.

        Arguments:
            x: ``[T, H]`` BF16 (FP32 accepted), or the FP8 pair ``(float8_e4m3fn [T, H], float32 scales
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
            num_sms: SMs of the kernels (0: :meth:`get_theoretical_num_sms`); rounded up to even.
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
            ``recv_topk_idx`` ``[rows, K]`` int64 local ids / -1 (None expanded or cached), ``recv_topk_weights``
            ``[rows, K]`` float32 (expanded: ``[rows]``; None without weights), the :class:`EPHandle`, and an
            ``EventOverlap`` (waitable; it holds an event only with ``async_with_compute_stream`` on CUDA).
        """
        return self._dispatch(x, topk_idx, topk_weights, cumulative_local_expert_recv_stats, num_experts,
                              num_max_tokens_per_rank, expert_alignment, num_sms, num_qps, previous_event,
                              previous_event_before_epilogue, async_with_compute_stream, allocate_on_comm_stream,
                              handle, do_handle_copy, do_cpu_sync, do_expand, do_zero_padding,
                              use_tma_aligned_col_major_sf)

    def _num_sms(self, num_sms: object, num_experts: int, num_topk: int) -> int:
        _check_int("num_sms", num_sms, 0)
        if num_sms == 0:
            return self.get_theoretical_num_sms(num_experts, max(num_topk, 1))
        return _align(num_sms, 2)

    def _events(self, previous_event: object, before_epilogue: object, on_comm: bool) -> EventOverlap | None:
        """The one event the Buffer waits for: ``previous_event``, ``previous_event_before_epilogue``, or a point
        after both; with ``on_comm`` (``allocate_on_comm_stream``) and neither, the current stream's point (DeepEP
        allows that pair; the Buffer asks for the event explicitly)."""
        if on_comm and previous_event is None and before_epilogue is None:
            previous_event = EventHandle()
        first = as_event_overlap(previous_event, "previous_event")
        second = as_event_overlap(before_epilogue, "previous_event_before_epilogue")
        if second is None:
            return first
        if first is None or first.event is None or second.event is None:
            return first if first is not None and first.event is not None else second
        joiner = torch.cuda.Stream(self.buffer.device)
        joiner.wait_event(first.event)
        joiner.wait_event(second.event)
        joined = torch.cuda.Event()
        joined.record(joiner)
        return EventOverlap(joined)

    def _stream_args(self, config: Any, previous_event: object, before_epilogue: object, async_: object,
                     on_comm: object) -> dict:
        """The Buffer's ``config``/stream keywords of a call."""
        on_comm = _check_bool("allocate_on_comm_stream", on_comm)
        return dict(config=config, previous_event=self._events(previous_event, before_epilogue, on_comm),
                    async_finish=_check_bool("async_with_compute_stream", async_), allocate_on_comm_stream=on_comm)

    def _epilogue(self, event: EventOverlap, fn: Any) -> tuple[Any, EventOverlap]:
        """``fn()`` after the Buffer's call: on the communication stream when the call ran there asynchronously
        (the returned event then marks ``fn``'s end too), else on the current stream."""
        comm = self.buffer.get_comm_stream()
        if comm is None or event.event is None:
            return fn(), event
        with torch.cuda.stream(comm):
            out = fn()
            done = torch.cuda.Event()
            done.record(comm)
        return out, EventOverlap(done, event.extra_tensors)

    def _check_handle(self, handle: object) -> EPHandle:
        if not isinstance(handle, EPHandle):
            raise TypeError(f"handle: expected the EPHandle returned by dispatch, got {type(handle).__name__}")
        if handle._owner is not self:
            raise ValueError("handle: it was made by another buffer")
        if handle._topk_idx_version is not None and handle.topk_idx._version != handle._topk_idx_version:
            raise ValueError("handle: its topk_idx (kept by reference, do_handle_copy=False) was modified after the "
                             "dispatch")
        return handle

    def _dispatch(self, x: XInput, topk_idx: torch.Tensor | None, topk_weights: torch.Tensor | None,
                  stats: torch.Tensor | None, num_experts: int | None, num_max_tokens_per_rank: int | None,
                  expert_alignment: int | None, num_sms: int, num_qps: int, previous_event: object,
                  before_epilogue: object, async_with_compute_stream: bool, allocate_on_comm_stream: bool,
                  handle: EPHandle | None, do_handle_copy: bool, do_cpu_sync: bool | None, do_expand: bool,
                  do_zero_padding: bool, use_tma_aligned_col_major_sf: bool):
        _check_int("num_qps", num_qps, 0)
        do_expand = _check_bool("do_expand", do_expand)
        if _check_bool("do_zero_padding", do_zero_padding) and not do_expand:
            raise ValueError("do_zero_padding: only meaningful with do_expand=True")
        sf_col_major = _check_bool("use_tma_aligned_col_major_sf", use_tma_aligned_col_major_sf)
        do_handle_copy = _check_bool("do_handle_copy", do_handle_copy)
        if do_handle_copy and self._reference_topk_idx:
            raise ValueError("do_handle_copy: EPBuffer keeps topk_idx by reference (DeepEP 2.5); pass False")
        data = x[0] if isinstance(x, tuple) and x else x
        num_tokens = data.shape[0] if isinstance(data, torch.Tensor) and data.dim() else 0  # the Buffer checks x
        if handle is not None:
            handle = self._check_handle(handle)
            if topk_idx is not None:
                raise ValueError("topk_idx: must be None with a cached handle (the handle's layout is reused)")
            if do_cpu_sync:
                raise ValueError("do_cpu_sync: a cached dispatch reads no counts; pass None or False")
            for name, given, kept in (("num_experts", num_experts, handle.num_experts),
                                      ("expert_alignment", expert_alignment, handle.expert_alignment),
                                      ("num_max_tokens_per_rank", num_max_tokens_per_rank,
                                       handle.num_max_tokens_per_rank)):
                if given is not None and given != kept:
                    raise ValueError(f"{name}: the cached handle was made with {kept}, got {given!r}")
            if do_expand != handle.do_expand:
                raise ValueError(f"do_expand: the cached handle was made with do_expand={handle.do_expand}; a cached "
                                 f"dispatch must ask for the same layout")
            if stats is not None:
                raise ValueError("cumulative_local_expert_recv_stats: not counted again by a cached dispatch")
            num_experts, alignment, t_max = handle.num_experts, handle.expert_alignment, handle.num_max_tokens_per_rank
        else:
            if topk_idx is None:
                raise ValueError("topk_idx: required without a cached handle")
            if num_experts is None:
                raise ValueError("num_experts: required without a cached handle")
            cpu_sync = True if do_cpu_sync is None else _check_bool("do_cpu_sync", do_cpu_sync)
            alignment = _check_int("expert_alignment", 1 if expert_alignment is None else expert_alignment, 1)
            t_max = self.num_max_tokens_per_rank if num_max_tokens_per_rank is None else num_max_tokens_per_rank
            if _check_int("num_max_tokens_per_rank", t_max, 0) == 0:
                raise ValueError("num_max_tokens_per_rank: give it to the constructor or the call (the most tokens "
                                 "any rank dispatches, the same on every rank)")
            if num_tokens > t_max:
                raise ValueError(f"x: {num_tokens} tokens, more than num_max_tokens_per_rank={t_max}")
            if stats is not None and not (isinstance(stats, torch.Tensor) and stats.dtype == torch.int32
                                          and stats.shape == (num_experts // self.num_ranks,)):
                raise ValueError(f"cumulative_local_expert_recv_stats: expected an int32 tensor "
                                 f"[{num_experts // self.num_ranks}]")
        num_topk = (handle.topk_idx if topk_idx is None else topk_idx).shape[-1]
        sms = self._num_sms(num_sms, num_experts, num_topk)
        kw = self._stream_args(dispatch_config(sms, self.num_ranks), previous_event, before_epilogue,
                               async_with_compute_stream, allocate_on_comm_stream)
        if handle is not None:
            return self._cached_dispatch(x, topk_weights, handle, kw, sf_col_major)
        local = num_experts // self.num_ranks if num_experts % max(self.num_ranks, 1) == 0 else 0
        if do_expand:
            return self._expand_dispatch(x, topk_idx, topk_weights, stats, num_experts, alignment, t_max, sms,
                                         do_handle_copy, cpu_sync, local, kw, sf_col_major)
        capacity = 0 if cpu_sync else self.num_ranks * t_max
        recv_x, recv_idx, recv_w, counts, inner, event = self.buffer.dispatch(
            x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=num_experts, expert_alignment=alignment,
            num_worst_tokens=capacity, **kw)

        def epilogue() -> tuple:
            rows = recv_idx.shape[0]
            meta, psum_rank = self._source_metadata(inner, rows, num_topk, t_max, None)
            per_expert = _count_local(recv_idx, local)
            if stats is not None:
                stats.add_(per_expert.to(torch.int32))
            aligned = (per_expert + alignment - 1) // alignment * alignment
            return meta, psum_rank, aligned.cumsum(0).to(torch.int32)
        (meta, psum_rank, psum_expert), event = self._epilogue(event, epilogue)
        ep_handle = self._handle(False, num_experts, alignment, t_max, sms, topk_idx, do_handle_copy,
                                 inner.num_recv_tokens if inner.num_recv_tokens is not None else recv_idx.shape[0],
                                 0, counts, psum_rank, psum_expert, None, meta, inner, recv_idx, recv_idx.shape[0])
        return self._finish_dispatch(_sf_layout(recv_x, sf_col_major), recv_idx, recv_w, ep_handle, event)

    def _expand_dispatch(self, x: XInput, topk_idx: torch.Tensor, topk_weights: torch.Tensor | None,
                         stats: torch.Tensor | None, num_experts: int, alignment: int, t_max: int, sms: int,
                         do_handle_copy: bool, cpu_sync: bool, local: int, kw: dict, sf_col_major: bool):
        expert_x, expert_sf, probs, tokens_per_expert, inner, event = self.buffer.dispatch_experts(
            x, topk_idx, topk_weights, num_experts, expert_alignment=alignment, **kw)
        layout = inner.expert_layout
        num_topk = topk_idx.shape[1]

        def epilogue() -> tuple:
            starts = torch.tensor([0] + tokens_per_expert[:-1], dtype=torch.int64, device=layout.recv_slot.device)
            starts = starts.cumsum(0)
            slots = layout.recv_slot.long()
            block = torch.bucketize(slots, starts, right=True) - 1
            real = _count_local(torch.where(slots >= 0, block, -1), local)
            if stats is not None:
                stats.add_(real.to(torch.int32))
            meta, psum_rank = self._source_metadata(inner, layout.recv_slot.shape[0], num_topk, t_max,
                                                    layout.recv_slot)
            return meta, psum_rank, (starts + real).to(torch.int32), real.to(torch.int32)
        (meta, psum_rank, psum_expert, real), event = self._epilogue(event, epilogue)
        rows = layout.num_rows
        out_rows = rows if cpu_sync else max(
            rows, self.num_ranks * t_max * min(num_topk, max(local, 1)) + local * (alignment - 1))
        recv_x = _pad_rows(expert_x if expert_sf is None else (expert_x, expert_sf), out_rows)
        ep_handle = self._handle(True, num_experts, alignment, t_max, sms, topk_idx, do_handle_copy,
                                 inner.num_recv_tokens, rows, tokens_per_expert, psum_rank, psum_expert, real, meta,
                                 inner, None, out_rows)
        return self._finish_dispatch(_sf_layout(recv_x, sf_col_major), None, _pad_rows(probs, out_rows), ep_handle,
                                     event)


    def _cached_dispatch(self, x: XInput, topk_weights: torch.Tensor | None, handle: EPHandle, kw: dict,
                         sf_col_major: bool):
        if handle.do_expand:
            expert_x, expert_sf, _, _, _, event = self.buffer.dispatch_experts(x, handle=handle.inner, **kw)
            recv_x = expert_x if expert_sf is None else (expert_x, expert_sf)
        else:
            recv_x, _, _, _, _, event = self.buffer.dispatch(x, handle=handle.inner, **kw)
        recv_w = None
        if topk_weights is not None:
            recv_w, event = self._cached_weights(topk_weights, handle, kw, event)
        return self._finish_dispatch(_sf_layout(_pad_rows(recv_x, handle._out_rows), sf_col_major), None,
                                     _pad_rows(recv_w, handle._out_rows), handle, event)

    def _cached_weights(self, topk_weights: torch.Tensor, handle: EPHandle, kw: dict,
                        event: EventOverlap) -> tuple[torch.Tensor, EventOverlap]:
        """``topk_weights`` ``[T, K]`` float32 carried in a cached handle's layout, bit for bit: the float32 words
        travel as pairs of BF16 values (dispatch copies rows, it never computes on them)."""
        num_tokens, num_topk = handle.topk_idx.shape
        if not (isinstance(topk_weights, torch.Tensor) and topk_weights.dtype == torch.float32
                and topk_weights.shape == (num_tokens, num_topk)):
            raise ValueError(f"topk_weights: expected a float32 tensor [{num_tokens}, {num_topk}] (the handle's "
                             f"top-k shape)")
        words = _align(2 * num_topk, 8)  # rows of 16-byte multiples for every transport
        packed = torch.zeros(num_tokens, words, dtype=torch.bfloat16, device=topk_weights.device)
        packed[:, :2 * num_topk] = topk_weights.contiguous().view(torch.bfloat16)
        if handle.do_expand:
            rows, _, _, _, _, weights_event = self.buffer.dispatch_experts(packed, handle=handle.inner, **kw)
        else:
            rows, _, _, _, _, weights_event = self.buffer.dispatch(packed, handle=handle.inner, **kw)
        event = weights_event if weights_event.event is not None else event

        def unpack() -> torch.Tensor:
            values = rows[:, :2 * num_topk].contiguous().view(torch.float32)  # [rows, K]
            if not handle.do_expand:
                return values.masked_fill(handle._recv_topk_idx < 0, 0.0)
            slots = handle.inner.expert_layout.recv_slot.long()
            num_rows = values.shape[0]
            column = torch.zeros(num_rows + 1, dtype=torch.int64, device=values.device)
            target = torch.where(slots >= 0, slots, num_rows).flatten()
            column.scatter_(0, target, torch.arange(num_topk, device=values.device).repeat(slots.shape[0]))
            filled = torch.zeros(num_rows + 1, dtype=torch.bool, device=values.device)
            filled.scatter_(0, target, True)
            picked = values.gather(1, column[:num_rows, None]).squeeze(1)
            return picked.masked_fill(~filled[:num_rows], 0.0)
        return self._epilogue(event, unpack)

    def _source_metadata(self, inner: DispatchHandle, rows: int, num_topk: int, t_max: int,
                         slots: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``recv_src_metadata`` ``[rows, 2 + K]`` and ``psum_num_recv_tokens_per_scaleup_rank``, on the device
        from the rank prefix matrix (no host read)."""
        column = inner.rank_prefix_matrix[:, self.rank_idx].long()  # inclusive prefix over source ranks
        device = column.device
        position = torch.arange(rows, device=device)
        source = torch.bucketize(position, column, right=True)
        valid = position < column[-1]
        src_idx = inner.recv_src_idx.long()
        if src_idx.shape[0] < rows:
            src_idx = torch.cat([src_idx, src_idx.new_zeros(rows - src_idx.shape[0])])
        meta = torch.full((rows, 2 + num_topk), -1, dtype=torch.int32, device=device)
        meta[:, 0] = torch.where(valid, source * t_max + src_idx[:rows], -1).to(torch.int32)
        meta[:, 1] = torch.where(valid, source, -1).to(torch.int32)
        if slots is not None:
            meta[:, 2:] = slots
        per_source = torch.diff(column, prepend=column.new_zeros(1))
        per_scaleup = per_source.view(self.num_scaleout_ranks, self.num_scaleup_ranks).sum(0)
        return meta, per_scaleup.cumsum(0).to(torch.int32)

    def _handle(self, do_expand: bool, num_experts: int, alignment: int, t_max: int, sms: int,
                topk_idx: torch.Tensor, do_handle_copy: bool, num_recv_tokens: int, num_expanded: int,
                counts: list[int], psum_rank: torch.Tensor, psum_expert: torch.Tensor, real: torch.Tensor | None,
                meta: torch.Tensor, inner: DispatchHandle, recv_idx: torch.Tensor | None,
                out_rows: int) -> EPHandle:
        kept = topk_idx.clone() if do_handle_copy else topk_idx
        return EPHandle(do_expand=do_expand, num_experts=num_experts, expert_alignment=alignment,
                        num_max_tokens_per_rank=t_max, num_sms=sms, topk_idx=kept, num_recv_tokens=num_recv_tokens,
                        num_expanded_tokens=num_expanded, num_recv_tokens_per_expert_list=list(counts),
                        psum_num_recv_tokens_per_scaleup_rank=psum_rank, psum_num_recv_tokens_per_expert=psum_expert,
                        num_unaligned_recv_tokens_per_expert=real, recv_src_metadata=meta, inner=inner,
                        recv_topk_idx=recv_idx, out_rows=out_rows, owner=self,
                        topk_idx_version=None if do_handle_copy else topk_idx._version)

    def _finish_dispatch(self, recv_x: XInput, recv_idx: torch.Tensor | None, recv_w: torch.Tensor | None,
                         handle: EPHandle, event: EventOverlap) -> tuple:
        return recv_x, recv_idx, recv_w, handle, event

    # ---- combine ----
    def combine(self, x: torch.Tensor, handle: EPHandle, topk_weights: torch.Tensor | None = None,
                bias: Bias = None, num_sms: int = 0, num_qps: int = 0, previous_event: object | None = None,
                previous_event_before_epilogue: object | None = None, async_with_compute_stream: bool = False,
                allocate_on_comm_stream: bool = False):
        """Sum the rows back to their tokens (the rows are not multiplied by any weight).

        Arguments:
            x: BF16 (FP32 accepted) rows in the handle's layout: not expanded ``[rows, H]``, one row per received
                token (the caller has reduced over its local experts); expanded ``[rows, H]``, one row per (token,
                local expert) (padding rows ignored). ``rows`` may be the capacity of a ``do_cpu_sync=False``
                dispatch: only the valid prefix is read.
            handle: the dispatch's :class:`EPHandle`.
            topk_weights: float32 ``[rows, K]`` (expanded: ``[rows]``), summed over ranks alongside (what a
                dispatch's backward needs for its weights' gradient); refused expanded when the buffer was made
                with ``allow_multiple_reduction=False`` (as DeepEP).
            bias: one ``[T, H]`` tensor or a pair, ``x.dtype``, added once per token (not expanded: before the
                final rounding; expanded: after the rows' sum is rounded to ``x.dtype``).
            num_sms: SMs (0: the handle's); num_qps: accepted.
            previous_event, previous_event_before_epilogue, async_with_compute_stream, allocate_on_comm_stream:
                as in :meth:`dispatch`.

        Returns:
            ``(combined_x [T, H] x.dtype, combined_topk_weights [T, K] float32 or None, event)``.
        """
        return self._combine(x, handle, topk_weights, bias, num_sms, num_qps, previous_event,
                             previous_event_before_epilogue, async_with_compute_stream, allocate_on_comm_stream)

    def _combine(self, x: torch.Tensor, handle: EPHandle, topk_weights: torch.Tensor | None, bias: Bias,
                 num_sms: int, num_qps: int, previous_event: object, before_epilogue: object,
                 async_with_compute_stream: bool, allocate_on_comm_stream: bool):
        handle = self._check_handle(handle)
        _check_int("num_qps", num_qps, 0)
        sms = handle.num_sms if _check_int("num_sms", num_sms, 0) == 0 else _align(num_sms, 2)
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise TypeError(f"x: expected a [rows, hidden] tensor, got {type(x).__name__}")
        biases = () if bias is None else (bias,) if isinstance(bias, torch.Tensor) else tuple(bias)
        if len(biases) > 2:
            raise ValueError(f"bias: at most two tensors, got {len(biases)}")
        kw = self._stream_args(combine_config(sms, self.num_ranks), previous_event, before_epilogue,
                               async_with_compute_stream, allocate_on_comm_stream)
        if x.shape[0] != handle._out_rows:
            raise ValueError(f"x: expected {handle._out_rows} rows (the dispatch's output), got {x.shape[0]}")
        if not handle.do_expand:
            return self.buffer.combine(x, handle.inner, topk_weights=topk_weights, bias=bias, **kw)
        if topk_weights is not None and not self.allow_multiple_reduction:
            raise ValueError("topk_weights: an expanded combine reduces weights only with "
                             "allow_multiple_reduction=True (as DeepEP)")
        num_tokens = handle.inner.num_tokens
        for i, b in enumerate(biases):
            if not (isinstance(b, torch.Tensor) and b.dtype == x.dtype and b.shape == (num_tokens, x.shape[1])
                    and b.device == x.device):
                raise ValueError(f"bias[{i}]: expected a {x.dtype} tensor [{num_tokens}, {x.shape[1]}] on {x.device}")
        rows = handle.num_expanded_tokens
        if topk_weights is not None:
            if not (isinstance(topk_weights, torch.Tensor) and topk_weights.dtype == torch.float32
                    and topk_weights.shape == (handle._out_rows,)):
                raise ValueError(f"topk_weights: expected float32 [{handle._out_rows}] (expanded rows)")
            topk_weights = topk_weights[:rows]
        combined, weights, event = self.buffer.combine_experts(x[:rows], handle.inner, expert_weights=topk_weights,
                                                               **kw)
        if not biases:
            return combined, weights, event

        def add_bias() -> torch.Tensor:
            total = combined.float()
            for b in biases:
                total = total + b.float()
            return total.to(combined.dtype)
        combined, event = self._epilogue(event, add_bias)
        return combined, weights, event


class EPBuffer(ElasticBuffer):
    """DeepEP 2.5's ``EPBuffer``: ``ElasticBuffer`` with 2.5's signatures.

    - No ``num_cpu_bytes``; ``lb_allocation_plan_or_num_bytes`` (the load-balancing region) must be 0:
      ``lb_prefetch_weights``/``lb_reduce_grads`` are not served.
    - ``dispatch`` keeps ``topk_idx`` by reference (``do_handle_copy`` must be False) and a later use of the
      handle raises when it was modified; no ``previous_event_before_epilogue``.
    - ``defer_epilogue=True`` (dispatch and combine) returns only a ``DeferredEpilogue`` event whose
      ``current_stream_wait()`` returns the results (dispatch: ``(recv_x, recv_topk_idx, recv_topk_weights,
      handle)``; combine: ``(combined_x, combined_topk_weights)``).
    """

    _reference_topk_idx = True

    def __init__(self, group: dist.ProcessGroup, num_bytes: int | None = None, num_max_tokens_per_rank: int = 0,
                 hidden: int = 0, num_topk: int = 0, use_fp8_dispatch: bool = False,
                 lb_allocation_plan_or_num_bytes: Any = 0, deterministic: bool = False,
                 allow_hybrid_mode: bool = True, allow_multiple_reduction: bool = True,
                 prefer_overlap_with_compute: bool = True, sl_idx: int | None = None, num_allocated_qps: int = 0,
                 num_cpu_timeout_secs: int = 300, num_gpu_timeout_secs: int = 100, explicitly_destroy: bool = False,
                 *, transport: str = "auto", device: torch.device | str | None = None,
                 ranks_per_node: int | None = None) -> None:
        """Arguments as :class:`ElasticBuffer` (``lb_allocation_plan_or_num_bytes`` must be 0 or None)."""
        if lb_allocation_plan_or_num_bytes not in (0, None):
            raise ValueError("lb_allocation_plan_or_num_bytes: DeepEP 2.5's expert load-balancing region "
                             "(lb_prefetch_weights/lb_reduce_grads) is not served by moe_ep_plugin; pass 0")
        self._setup(group, num_bytes, 0, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch, deterministic,
                    allow_hybrid_mode, allow_multiple_reduction, prefer_overlap_with_compute, sl_idx,
                    num_allocated_qps, num_cpu_timeout_secs, num_gpu_timeout_secs, explicitly_destroy, transport,
                    device, ranks_per_node)

    def dispatch(self, x: XInput, topk_idx: torch.Tensor | None = None,  # type: ignore[override]
                 topk_weights: torch.Tensor | None = None,
                 cumulative_local_expert_recv_stats: torch.Tensor | None = None, num_experts: int | None = None,
                 num_max_tokens_per_rank: int | None = None, expert_alignment: int | None = None,
                 num_sms: int = 0, num_qps: int = 0, previous_event: object | None = None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                 handle: EPHandle | None = None, do_handle_copy: bool = False, do_cpu_sync: bool | None = None,
                 do_expand: bool = False, do_zero_padding: bool = False, use_tma_aligned_col_major_sf: bool = False,
                 defer_epilogue: bool = False):
        """:meth:`ElasticBuffer.dispatch` in DeepEP 2.5's form (``defer_epilogue``: class docstring)."""
        result = self._dispatch(x, topk_idx, topk_weights, cumulative_local_expert_recv_stats, num_experts,
                                num_max_tokens_per_rank, expert_alignment, num_sms, num_qps, previous_event, None,
                                async_with_compute_stream, allocate_on_comm_stream, handle, do_handle_copy,
                                do_cpu_sync, do_expand, do_zero_padding, use_tma_aligned_col_major_sf)
        if _check_bool("defer_epilogue", defer_epilogue):
            return DeferredEpilogue(result[-1], result[:-1])
        return result

    def combine(self, x: torch.Tensor, handle: EPHandle,  # type: ignore[override]
                topk_weights: torch.Tensor | None = None, bias: Bias = None, num_sms: int = 0, num_qps: int = 0,
                previous_event: object | None = None, async_with_compute_stream: bool = False,
                allocate_on_comm_stream: bool = False, defer_epilogue: bool = False):
        """:meth:`ElasticBuffer.combine` in DeepEP 2.5's form (``defer_epilogue``: class docstring)."""
        result = self._combine(x, handle, topk_weights, bias, num_sms, num_qps, previous_event, None,
                               async_with_compute_stream, allocate_on_comm_stream)
        if _check_bool("defer_epilogue", defer_epilogue):
            return DeferredEpilogue(result[-1], result[:-1])
        return result


def _count_local(local_ids: torch.Tensor, num_local: int) -> torch.Tensor:
    """int64 ``[num_local]``: how often each id in ``[0, num_local)`` occurs in ``local_ids`` (-1 ignored), on
    the device without a host read."""
    flat = local_ids.reshape(-1).long()
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, torch.where(flat >= 0, flat, num_local), torch.ones_like(flat))
    return counts[:num_local]


def _pad_rows(t: XInput | None, rows: int) -> XInput | None:
    """``t`` (a tensor, an FP8 pair or None) extended with zero rows to ``rows`` rows."""
    if t is None:
        return None
    if isinstance(t, tuple):
        return tuple(_pad_rows(part, rows) for part in t)
    if t.shape[0] >= rows:
        return t
    out = t.new_zeros((rows,) + tuple(t.shape[1:]))
    out[:t.shape[0]] = t
    return out


def _sf_layout(recv_x: XInput, col_major: bool) -> XInput:
    """FP8 scales as DeepEP's TMA-aligned column-major tensor (rows padded to 4 in storage) when asked."""
    if not col_major or not isinstance(recv_x, tuple):
        return recv_x
    data, scales = recv_x
    rows = scales.shape[0]
    storage = scales.new_zeros(scales.shape[1], _align(max(rows, 1), 4))
    storage[:, :rows] = scales.t()
    return data, storage[:, :rows].t()


__all__ = ["BUFFER_ALIGNMENT", "DEFAULT_NVLINK_GBS", "EPBuffer", "EPHandle", "ElasticBuffer"]
