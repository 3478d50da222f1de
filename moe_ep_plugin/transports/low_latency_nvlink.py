"""Low-latency dispatch/combine with the kernels of ``csrc/kernels/low_latency.cuh`` on CUDA-IPC peer memory (one host).

A second kernel context (its own peer-visible buffer of ``num_rdma_bytes`` plus signal pages, shared by CUDA IPC
like the normal kernels' one) holds the two buffer sets. A call launches its send half at once; its receive half
runs then too, or later from the hook. Nothing reads the host, so every call can be captured in a CUDA graph, except
the calls that lay the buffer out (the first, and ``clean_low_latency_buffer``): the kernels carry no header, so the
ranks first agree on the shapes, and on any refusal, over the group's host exchange (``low_latency_torch.agree``). A
receive that times out inside a kernel leaves its outputs incomplete and the error in the context's record: the
next low-latency call (or ``clean_low_latency_buffer``) raises ``TimeoutError`` naming the stalled rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ..ops import fp8, library
from ..ops.library import ptr as _ptr
from .base import REFUSED_CALLS, refusal_code
from .low_latency_base import DispatchOutput, DispatchRequest, LowLatencyHandle
from .low_latency_torch import agree
from .nvlink.runtime import DeviceArray, NVLinkRuntime
from .torch_transport import TorchTransport

_SIGNAL_BYTES = 16384  # csrc/kernels/low_latency.cuh kLLSignalBytes, per buffer set


class NVLinkLowLatency:
    """The low-latency calls of ``group``'s ranks on one host (see the module docstring)."""

    name = "nvlink"
    # The hidden sizes DeepEP's low-latency kernels are instantiated for (ours take any multiple of 128; these are
    # the ones the GPU tests and benchmarks cover).
    hidden_sizes = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)

    def __init__(
        self,
        group: dist.ProcessGroup,
        device: torch.device,
        timeout_s: float,
        num_rdma_bytes: int,
        runtime: NVLinkRuntime | None = None,
    ) -> None:
        """``runtime``: the context to use (default: a new one over ``group``, collective)."""
        if runtime is None:
            # The context: header pages, then both sets; DeepEP's size hint covers the sets' slots, the signal
            # pages (and the per-rank page rounding of the allocation) come on top (csrc/moe_ep.h: low-latency mode).
            runtime = NVLinkRuntime(
                group,
                device,
                timeout_s,
                NVLinkRuntime.staging_offset() + num_rdma_bytes + 2 * _SIGNAL_BYTES + 4096 * dist.get_world_size(group),
            )
        self.runtime = runtime
        self.rank, self.num_ranks, self.device = self.runtime.rank, self.runtime.num_ranks, self.runtime.device
        # The host exchange of lay_out: device tensors on NCCL, host ones on gloo (ranks sharing a GPU).
        group = runtime.group
        self.exchange = TorchTransport(
            group, self.device if dist.get_backend(group) == "nccl" else torch.device("cpu"), runtime.timeout_s
        )

    def lay_out(self, call: str, m: int, hidden: int, num_experts: int) -> None:
        """``call`` lays the buffer out for ``(m, hidden, num_experts)``: the kernels place slots and signals by
        these shapes and carry no header, so the ranks agree on them over the host first; a rank that refused the
        call joins that agreement (:meth:`refuse`) and every rank raises its cause. Not inside a CUDA-graph
        capture, where no host exchange can run."""
        self.runtime.check_error()
        if self._capturing():
            raise ValueError(
                f"{call}: it lays the low-latency buffer out, which the ranks agree on over the host, "
                "and cannot be captured in a CUDA graph; make one low-latency call (or "
                "clean_low_latency_buffer) before capturing"
            )
        agree(self.exchange, call, m, hidden, num_experts)

    def _capturing(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def dispatch(self, req: DispatchRequest) -> DispatchOutput:
        self.runtime.check_error()
        n, hidden = req.x.shape
        m, num_experts, dev = req.num_max_dispatch_tokens_per_rank, req.num_experts, self.device
        num_local, rows = num_experts // self.num_ranks, self.num_ranks * m
        recv_x = torch.empty(
            num_local, rows, hidden, dtype=fp8.FP8_DTYPE if req.use_fp8 else torch.bfloat16, device=dev
        )
        recv_scales = None
        if req.use_fp8:
            cols = hidden // (4 * fp8.BLOCK) if req.use_ue8m0 else hidden // fp8.BLOCK
            recv_scales = torch.empty(
                num_local, cols, rows, dtype=torch.int32 if req.use_ue8m0 else torch.float32, device=dev
            ).transpose(1, 2)
        recv_count = torch.empty(num_local, dtype=torch.int32, device=dev)
        src_info = torch.empty(num_local, rows, dtype=torch.int32, device=dev)
        layout_range = torch.empty(num_local, self.num_ranks, dtype=torch.int64, device=dev)
        waited = torch.zeros(self.num_ranks, dtype=torch.int64, device=dev)
        params = library.LLDispatchParams(
            x=_ptr(req.x),
            topk_idx=_ptr(req.topk_idx),
            recv_x=_ptr(recv_x),
            recv_scales=_ptr(recv_scales),
            recv_count=_ptr(recv_count),
            src_info=_ptr(src_info),
            layout_range=_ptr(layout_range),
            wait_stats=_ptr(waited),
            num_tokens=n,
            hidden=hidden,
            num_topk=req.topk_idx.shape[1],
            num_experts=num_experts,
            max_tokens=m,
            use_fp8=int(req.use_fp8),
            round_scale=int(req.round_scale),
            use_ue8m0=int(req.use_ue8m0),
            buffer_set=req.buffer_set,
        )
        self.runtime.low_latency("dispatch_send", params)
        handle = LowLatencyHandle(
            src_info, layout_range, m, hidden, num_experts, n, req.topk_idx.shape[1], self.rank, self.num_ranks
        )

        def finish(_inputs: tuple = (req.x, req.topk_idx)) -> torch.Tensor:  # keeps the inputs alive until then
            self.runtime.low_latency("dispatch_recv", params)
            return waited

        return DispatchOutput(recv_x, recv_scales, recv_count, handle, finish)

    def _combine_buffer_ptr(self, handle: LowLatencyHandle, buffer_set: int) -> int:
        return self.runtime.low_latency_combine_buffer(
            handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts, buffer_set
        )

    def refuse(self, call: str, exc: Exception, layout: tuple[int, int, int] | None, buffer_set: int) -> None:
        """This rank refuses ``call`` (``exc``: its bad input). Without ``layout`` the call lays the buffer out: join
        the peers' agreement (:meth:`lay_out`) with the refusal, and every rank raises it, naming this rank. With
        it (a dispatch or combine on the buffer's layout) take part in the peers' call without data, marked refused
        (csrc/moe_ep.h ``refusal``), so that every rank's receive half records ``MOE_EP_ERR_REFUSED`` and its next
        call raises it naming this rank; no host read, so this works inside a capture too. Skipped when this rank
        already recorded an error (its kernels would not run), and inside a capture without ``layout``: the caller
        raises ``exc``."""
        if self.runtime.error[0] != 0:
            return
        if layout is None:
            if not self._capturing():
                agree(self.exchange, call, 0, 0, 0, refusal=exc)
            return
        m, hidden, num_experts = layout
        word = refusal_code(exc) | REFUSED_CALLS.index(call) << 8
        shape = dict(
            num_tokens=0,
            hidden=hidden,
            num_topk=1,
            num_experts=num_experts,
            max_tokens=m,
            buffer_set=buffer_set,
            refusal=word,
        )
        if call == "low_latency_dispatch":
            params = library.LLDispatchParams(**shape)
            self.runtime.low_latency("dispatch_send", params)
            self.runtime.low_latency("dispatch_recv", params)
        else:
            params = library.LLCombineParams(**shape)
            self.runtime.low_latency("combine_send", params)
            self.runtime.low_latency("combine_recv", params)

    def combine_buffer(self, handle: LowLatencyHandle, buffer_set: int) -> torch.Tensor:
        shape = (handle.num_local_experts, self.num_ranks * handle.num_max_dispatch_tokens_per_rank, handle.hidden)
        # int16 reinterpreted as BF16: the array interface has no BF16 type string
        raw = DeviceArray(self._combine_buffer_ptr(handle, buffer_set), shape, "<i2", self)
        return torch.as_tensor(raw, device=self.device).view(torch.bfloat16)

    def combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: LowLatencyHandle,
        zero_copy: bool,
        out: torch.Tensor,
        buffer_set: int,
    ) -> Callable[[], torch.Tensor]:
        self.runtime.check_error()
        waited = torch.zeros(self.num_ranks, dtype=torch.int64, device=self.device)
        params = library.LLCombineParams(
            x=self._combine_buffer_ptr(handle, buffer_set) if zero_copy else _ptr(x),
            topk_idx=_ptr(topk_idx),
            topk_weights=_ptr(topk_weights),
            src_info=_ptr(handle.src_info),
            layout_range=_ptr(handle.layout_range),
            out=_ptr(out),
            wait_stats=_ptr(waited),
            num_tokens=handle.num_tokens,
            hidden=handle.hidden,
            num_topk=topk_idx.shape[1],
            num_experts=handle.num_experts,
            max_tokens=handle.num_max_dispatch_tokens_per_rank,
            buffer_set=buffer_set,
        )
        self.runtime.low_latency("combine_send", params)

        def finish(_inputs: tuple = (x, topk_idx, topk_weights)) -> torch.Tensor:  # keeps the inputs alive
            self.runtime.low_latency("combine_recv", params)
            return waited

        return finish

    def clean(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        self.runtime.check_error()
        self.runtime.low_latency_clean()

    def destroy(self) -> None:
        self.runtime.destroy()
