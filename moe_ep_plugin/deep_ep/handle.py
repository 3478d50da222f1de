"""DeepEP V2's ``EPHandle``: the layout of one ``ElasticBuffer.dispatch``, and the check that a handle may be
reused by a buffer."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..handle import DispatchHandle

if TYPE_CHECKING:
    from .arguments import DispatchArgs
    from .elastic import ElasticBuffer


class EPHandle:
    """The layout of one ``ElasticBuffer.dispatch``: reused by a cached dispatch and by ``combine``.

    Fields frameworks read (same meaning as DeepEP's; L = local experts, R = ranks):

    - ``do_expand``, ``num_experts``, ``expert_alignment``, ``num_max_tokens_per_rank``, ``num_sms``: the dispatch's.
    - ``topk_idx`` ``[T, K]``: the dispatch's top-k (a clone with ``do_handle_copy``, else the caller's tensor).
    - ``num_recv_tokens``: received tokens (one per (token, rank)); without a CPU sync, ``R * num_max_tokens_per_rank``
      (the capacity, on every transport: the count is not read on the host; the valid prefix is
      ``psum_num_recv_tokens_per_scaleup_rank[-1]``); ``num_expanded_tokens``: rows of the expanded layout,
      alignment padding included (0 when not expanded; without a CPU sync the capacity-sized outputs' rows, the valid
      ones given by ``psum_num_recv_tokens_per_expert``).
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

    def __init__(
        self,
        *,
        do_expand: bool,
        num_experts: int,
        expert_alignment: int,
        num_max_tokens_per_rank: int,
        num_sms: int,
        topk_idx: torch.Tensor,
        num_recv_tokens: int,
        num_expanded_tokens: int,
        num_recv_tokens_per_expert_list: list[int],
        psum_num_recv_tokens_per_scaleup_rank: torch.Tensor,
        psum_num_recv_tokens_per_expert: torch.Tensor,
        num_unaligned_recv_tokens_per_expert: torch.Tensor | None,
        recv_src_metadata: torch.Tensor,
        inner: DispatchHandle,
        recv_topk_idx: torch.Tensor | None,
        out_rows: int,
        owner: ElasticBuffer,
        topk_idx_version: int | None,
        expert_slot: torch.Tensor | None = None,
    ) -> None:
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
        self._dst_slots: torch.Tensor | None = None
        self.token_metadata_at_forward = None
        self.channel_linked_list = None
        self.inner = inner  # moe_ep_plugin's DispatchHandle: what combine and the cached dispatch replay
        self._recv_topk_idx = recv_topk_idx  # the non-expanded dispatch's, masking weights of a cached one
        self._out_rows = out_rows  # rows of the dispatch's outputs (capacity without a CPU sync)
        self._owner = owner
        self._owner_lease = owner._lease  # EPBuffer.resize leases again: handles made before are refused after
        self._topk_idx_version = topk_idx_version
        # expanded without a CPU sync: each received row's expanded-layout row per top-k column [W, K] int32 (-1:
        # none); the layout is then replayed from it on the device (``inner`` is the non-expanded dispatch's)
        self._expert_slot = expert_slot

    @property
    def dst_buffer_slot_idx(self) -> torch.Tensor:
        """``[T, K]`` int32: the row each (token, k) pair's token lands in on the pair's destination rank, in the
        non-expanded receive order (source rank, then token); -1 where ``topk_idx`` names no expert. DeepEP's field
        with one scale-out rank. Made at the first read, on the current stream, from the dispatch's layout."""
        if self._dst_slots is None:
            inner = self.inner
            idx = self.topk_idx.long()
            named = (idx >= 0) & (idx < self.num_experts)
            dest = torch.where(named, idx // inner.num_local_experts, 0)
            rpm = inner.rank_prefix_matrix.long()
            # rows from this rank start, on each destination, after those of the ranks before it
            start = rpm[inner.rank - 1] if inner.rank > 0 else torch.zeros_like(rpm[0])
            rows = start[dest] + inner.send_pos.long().gather(1, dest)
            self._dst_slots = torch.where(named, rows, -1).to(torch.int32)
        return self._dst_slots


def make_handle(
    owner: ElasticBuffer,
    args: DispatchArgs,
    sms: int,
    topk_idx: torch.Tensor,
    num_recv_tokens: int,
    num_expanded: int,
    counts: list[int],
    psum_rank: torch.Tensor,
    psum_expert: torch.Tensor,
    real: torch.Tensor | None,
    meta: torch.Tensor,
    inner: DispatchHandle,
    recv_idx: torch.Tensor | None,
    out_rows: int,
    expert_slot: torch.Tensor | None = None,
) -> EPHandle:
    """The :class:`EPHandle` of a fresh dispatch by ``owner`` with the resolved ``args``; it keeps a clone of
    ``topk_idx`` with ``args.do_handle_copy``, else the tensor and its version (checked by :func:`check_handle`;
    an inference-mode tensor has no version: DeepEP's test loop runs under ``torch.inference_mode()``)."""
    kept = topk_idx.clone() if args.do_handle_copy else topk_idx
    return EPHandle(
        do_expand=args.do_expand,
        num_experts=args.num_experts,
        expert_alignment=args.alignment,
        num_max_tokens_per_rank=args.t_max,
        num_sms=sms,
        topk_idx=kept,
        num_recv_tokens=num_recv_tokens,
        num_expanded_tokens=num_expanded,
        num_recv_tokens_per_expert_list=list(counts),
        psum_num_recv_tokens_per_scaleup_rank=psum_rank,
        psum_num_recv_tokens_per_expert=psum_expert,
        num_unaligned_recv_tokens_per_expert=real,
        recv_src_metadata=meta,
        inner=inner,
        recv_topk_idx=recv_idx,
        out_rows=out_rows,
        owner=owner,
        topk_idx_version=None if args.do_handle_copy or topk_idx.is_inference() else topk_idx._version,
        expert_slot=expert_slot,
    )


def check_handle(handle: object, owner: ElasticBuffer) -> EPHandle:
    """``handle`` as an :class:`EPHandle` made by ``owner`` whose by-reference ``topk_idx`` is unmodified."""
    if not isinstance(handle, EPHandle):
        raise TypeError(f"handle: expected the EPHandle returned by dispatch, got {type(handle).__name__}")
    if handle._owner is not owner:
        raise ValueError("handle: it was made by another buffer")
    if handle._owner_lease is not owner._lease:
        raise ValueError("handle: it was made before the buffer's resize(); dispatch again")
    if handle._topk_idx_version is not None and handle.topk_idx._version != handle._topk_idx_version:
        raise ValueError(
            "handle: its topk_idx (kept by reference, do_handle_copy=False) was modified after the dispatch"
        )
    return handle


__all__ = ["EPHandle", "check_handle", "make_handle"]
