"""DeepEP 2.5's ``EPBuffer`` with DeepEP 2.6's additions, on :class:`ElasticBuffer` (elastic.py).

DeepEP 2.6 (README "News", 2026-12-02; its source and signatures are not published) adds ``EPBuffer.resize``, an
optional FP32 combine output, 128-element combine alignment and ``EPBuffer.lb_get_redundancy_mapping``. Served here:

- ``resize(num_bytes=None, num_max_tokens_per_rank=None, hidden=None, num_topk=None)``: the buffer made again for
  other sizes (collective); handles of earlier dispatches are refused after it.
- ``combine(..., out_dtype=torch.float32)``: the fp32 sum of the rows returned unrounded (combine_dtype.py).
- 128-element alignment: any hidden size that is a multiple of 128 (and, on the ``nvlink`` kernels, of 16 bytes),
  and expanded layouts whose expert blocks are aligned to 128 rows, combine as every other size does.
- ``lb_get_redundancy_mapping``: refused by name. DeepEP publishes only its purpose (redundant-expert planning across
  scale-out EP groups), not its arguments or result, and the load-balancing calls whose mapping it plans
  (``lb_prefetch_weights``/``lb_reduce_grads``) are not served here.

The argument names ``out_dtype`` and ``resize``'s are this library's (DeepEP's are not published): docs/compat.md.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..buffer_cache import lease_buffer
from ..config import positive_int
from .arguments import check_bool
from .elastic import Bias, ElasticBuffer
from .handle import EPHandle
from .layout import XInput
from .utils import DeferredEpilogue


class EPBuffer(ElasticBuffer):
    """DeepEP 2.5's ``EPBuffer``: ``ElasticBuffer`` with 2.5's signatures, and 2.6's additions (module docstring).

    - No ``num_cpu_bytes``; ``lb_allocation_plan_or_num_bytes`` (the load-balancing region) must be 0:
      ``lb_prefetch_weights``/``lb_reduce_grads`` are not served.
    - ``dispatch`` keeps ``topk_idx`` by reference (``do_handle_copy`` must be False) and a later use of the
      handle raises when it was modified; no ``previous_event_before_epilogue``.
    - ``defer_epilogue=True`` (dispatch and combine) returns only a ``DeferredEpilogue`` event whose
      ``current_stream_wait()`` returns the results (dispatch: ``(recv_x, recv_topk_idx, recv_topk_weights,
      handle)``; combine: ``(combined_x, combined_topk_weights)``).
    """

    _reference_topk_idx = True

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_bytes: int | None = None,
        num_max_tokens_per_rank: int = 0,
        hidden: int = 0,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        lb_allocation_plan_or_num_bytes: Any = 0,
        deterministic: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
        prefer_overlap_with_compute: bool = True,
        sl_idx: int | None = None,
        num_allocated_qps: int = 0,
        num_cpu_timeout_secs: int = 300,
        num_gpu_timeout_secs: int = 100,
        explicitly_destroy: bool = False,
        *,
        transport: str = "auto",
        device: torch.device | str | None = None,
        ranks_per_node: int | None = None,
    ) -> None:
        """Arguments as :class:`ElasticBuffer` (``lb_allocation_plan_or_num_bytes`` must be 0 or None)."""
        if lb_allocation_plan_or_num_bytes not in (0, None):
            raise ValueError(
                "lb_allocation_plan_or_num_bytes: DeepEP 2.5's expert load-balancing region "
                "(lb_prefetch_weights/lb_reduce_grads) is not served by moe_ep_plugin; pass 0"
            )
        self._setup(
            group,
            num_bytes,
            0,
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

    def dispatch(
        self,
        x: XInput,
        topk_idx: torch.Tensor | None = None,  # type: ignore[override]
        topk_weights: torch.Tensor | None = None,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        num_experts: int | None = None,
        num_max_tokens_per_rank: int | None = None,
        expert_alignment: int | None = None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event: object | None = None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
        handle: EPHandle | None = None,
        do_handle_copy: bool = False,
        do_cpu_sync: bool | None = None,
        do_expand: bool = False,
        do_zero_padding: bool = False,
        use_tma_aligned_col_major_sf: bool = False,
        defer_epilogue: bool = False,
    ):
        """:meth:`ElasticBuffer.dispatch` in DeepEP 2.5's form (``defer_epilogue``: class docstring)."""
        result = self._dispatch(
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
            None,
            async_with_compute_stream,
            allocate_on_comm_stream,
            handle,
            do_handle_copy,
            do_cpu_sync,
            do_expand,
            do_zero_padding,
            use_tma_aligned_col_major_sf,
        )
        return _deferred(result, defer_epilogue)

    def combine(
        self,
        x: torch.Tensor,
        handle: EPHandle,  # type: ignore[override]
        topk_weights: torch.Tensor | None = None,
        bias: Bias = None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event: object | None = None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
        defer_epilogue: bool = False,
        out_dtype: torch.dtype | None = None,
    ):
        """:meth:`ElasticBuffer.combine` in DeepEP 2.5's form (``defer_epilogue``: class docstring).

        ``out_dtype`` (DeepEP 2.6's FP32 combine output): None returns ``x.dtype``; ``torch.float32`` returns the
        fp32 sum unrounded (``combined_x`` ``[T, H]`` float32; ``bias`` in ``x.dtype`` as always)."""
        result = self._combine(
            x,
            handle,
            topk_weights,
            bias,
            num_sms,
            num_qps,
            previous_event,
            None,
            async_with_compute_stream,
            allocate_on_comm_stream,
            out_dtype,
        )
        return _deferred(result, defer_epilogue)

    def resize(
        self,
        num_bytes: int | None = None,
        num_max_tokens_per_rank: int | None = None,
        hidden: int | None = None,
        num_topk: int | None = None,
    ) -> None:
        """DeepEP 2.6's ``resize``: the buffer made again for other sizes (collective over the group), with the same
        group, transport, device and timeouts. Handles of earlier dispatches are refused afterwards. The buffer
        leases the shared Buffer again (see :class:`ElasticBuffer`): one at least ``num_bytes`` large, made when the
        shared one is smaller; the old lease is released after (a Buffer no other buffer holds is destroyed).

        Arguments:
            num_bytes: bytes of peer memory, the same on every rank (None: :meth:`get_buffer_size_hint` of the new
                sizes).
            num_max_tokens_per_rank, hidden, num_topk: the new sizes (None: kept).

        Every rank checks its arguments, then the ranks compare them before anything is released: a refusal on one
        rank, or ranks asking for different ``num_bytes``, raise on every rank and leave the buffer as it was.
        """
        try:
            request = self._resize_request(num_bytes, num_max_tokens_per_rank, hidden, num_topk)
            refusal = None
        except (TypeError, ValueError) as exc:
            request, refusal = None, exc
        everyone: list[Any] = [None] * self.num_ranks
        dist.all_gather_object(
            everyone, (request, None if refusal is None else f"{type(refusal).__name__}: {refusal}"), group=self.group
        )
        refused = [rank for rank, (_, reason) in enumerate(everyone) if reason is not None]
        if refusal is not None:
            raise refusal
        if refused:
            raise ValueError(
                f"resize: rank(s) {refused} refused the call (rank {refused[0]}: "
                f"{everyone[refused[0]][1]}); every rank raises, nothing was resized"
            )
        sizes = [req[0] for req, _ in everyone]
        if len(set(sizes)) > 1:
            raise ValueError(
                f"num_bytes: the ranks ask for different sizes {sizes} (rank order); pass the same on "
                "every rank; nothing was resized"
            )
        old = self._lease
        self._lease = lease_buffer(self.group, request[0], **self._buffer_kw)
        old.release()
        self.num_bytes, self.num_max_tokens_per_rank, self.hidden, self.num_topk = request
        self.buffer = self._lease.buffer

    def _resize_request(
        self, num_bytes: int | None, num_max_tokens_per_rank: int | None, hidden: int | None, num_topk: int | None
    ) -> tuple[int, int, int, int]:
        """``resize``'s arguments checked on this rank → ``(num_bytes, num_max_tokens_per_rank, hidden, num_topk)``."""
        if self._lease.released:
            raise ValueError("resize: the buffer was destroyed; make a new one")
        tokens = (
            self.num_max_tokens_per_rank
            if num_max_tokens_per_rank is None
            else positive_int(num_max_tokens_per_rank, "num_max_tokens_per_rank", 0)
        )
        hidden = self.hidden if hidden is None else positive_int(hidden, "hidden", 0)
        num_topk = self.num_topk if num_topk is None else positive_int(num_topk, "num_topk", 0)
        if num_bytes is None:
            num_bytes = self.get_buffer_size_hint(
                self.group,
                tokens,
                max(hidden, 1),
                num_topk,
                self.use_fp8_dispatch,
                self.allow_hybrid_mode,
                self.allow_multiple_reduction,
            )
        return positive_int(num_bytes, "num_bytes", 0), tokens, hidden, num_topk

    def lb_get_redundancy_mapping(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """DeepEP 2.6's redundant-expert planning across scale-out EP groups: not served (module docstring)."""
        raise NotImplementedError(
            "EPBuffer.lb_get_redundancy_mapping: not served by moe_ep_plugin. DeepEP 2.6 publishes its purpose "
            "(redundant-expert planning across scale-out EP groups) but not its arguments or result, and the "
            "load-balancing calls it plans for (lb_prefetch_weights, lb_reduce_grads) are not served here"
        )


def _deferred(result: tuple, defer_epilogue: bool):
    """``result`` as it is, or with ``defer_epilogue`` only its event, whose ``current_stream_wait()`` returns the rest
    (DeepEP 2.5's deferred epilogue)."""
    if check_bool("defer_epilogue", defer_epilogue):
        return DeferredEpilogue(result[-1], result[:-1])
    return result


__all__ = ["EPBuffer", "EPHandle"]
