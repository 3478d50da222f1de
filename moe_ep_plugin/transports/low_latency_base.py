"""What the buffer layer and the low-latency transports share: the handle, a validated dispatch request, the
dispatch's outputs, and the interface every low-latency transport implements (docs/low_latency.md).

R = EP ranks, M = ``num_max_dispatch_tokens_per_rank``, H = hidden, E = experts, L = E / R local experts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class LowLatencyHandle:
    """What a low-latency combine needs from its dispatch; reads as DeepEP's tuple
    ``(src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts)`` by index.

    ``src_info`` ``[L, R*M]`` int32: source token index of each received row (valid for the first
    ``recv_count[l]`` rows). ``layout_range`` ``[L, R]`` int64: ``begin << 32 | count`` of each source rank's rows
    in local expert ``l``'s block. Both are complete once the dispatch's data arrived (after its hook)."""

    src_info: torch.Tensor
    layout_range: torch.Tensor
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
    num_tokens: int
    num_topk: int
    rank: int
    num_ranks: int
    transport_state: Any = None
    received: bool = False  # the dispatch's data has arrived (its hook ran, or there was none)

    def __getitem__(self, i: int) -> Any:
        return (self.src_info, self.layout_range, self.num_max_dispatch_tokens_per_rank, self.hidden, self.num_experts)[
            i
        ]

    def __len__(self) -> int:
        return 5

    def __iter__(self):
        return iter(self[i] for i in range(5))

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks


@dataclass
class DispatchRequest:
    """A validated low-latency dispatch for a transport: ``x`` ``[N, H]`` BF16 contiguous, ``topk_idx`` ``[N, K]``
    int64 (global ids, -1 = none), output form ``use_fp8`` / ``round_scale`` / ``use_ue8m0``."""

    x: torch.Tensor
    topk_idx: torch.Tensor
    num_max_dispatch_tokens_per_rank: int
    num_experts: int
    use_fp8: bool
    round_scale: bool
    use_ue8m0: bool
    buffer_set: int


@dataclass
class DispatchOutput:
    """Outputs of a dispatch, allocated at the call and complete after ``finish()``: ``recv_x`` ``[L, R*M, H]``
    (BF16 or FP8), ``recv_scales`` (float32 ``[L, R*M, H/128]`` or packed UE8M0 int32 ``[L, R*M, H/512]``, both
    column-major in the last two dims) or None, ``recv_count`` ``[L]`` int32, and the handle. ``finish`` waits for
    the data (at most the timeout), unpacks it and returns the nanoseconds it waited: an int (host wait, added to
    every source's entry), or an ``[R]`` int64 tensor per source rank (the kernels' device wait)."""

    recv_x: torch.Tensor
    recv_scales: torch.Tensor | None
    recv_count: torch.Tensor
    handle: LowLatencyHandle
    finish: Callable[[], int | torch.Tensor]


class LowLatencyTransport(Protocol):
    """What a low-latency transport provides (every one passes tests/test_low_latency.py)."""

    name: str
    hidden_sizes: tuple[int, ...] | None  # None: any multiple of 128

    def dispatch(self, req: DispatchRequest) -> DispatchOutput: ...

    def combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: LowLatencyHandle,
        zero_copy: bool,
        out: torch.Tensor,
        buffer_set: int,
    ) -> Callable[[], int | torch.Tensor]: ...

    def combine_buffer(self, handle: LowLatencyHandle, buffer_set: int) -> torch.Tensor: ...

    def lay_out(self, call: str, m: int, hidden: int, num_experts: int) -> None:
        """``call`` (the buffer's first dispatch, or a clean) lays the buffer out for ``(M, hidden, num_experts)``:
        agree on it with the peers where the calls themselves carry no shapes (collective, before anything is
        sent; raises on every rank when ranks disagree or one refused the call)."""

    def refuse(self, call: str, exc: Exception, layout: tuple[int, int, int] | None, buffer_set: int) -> None:
        """This rank refuses ``call`` (``exc``: its bad input): let the peers, which are in the same call (or in its
        :meth:`lay_out` when ``layout`` is None), raise the cause too where the transport can tell them; the caller
        then raises ``exc``. ``layout``: the buffer's ``(M, hidden, num_experts)``, ``buffer_set``: the set the
        peers' call takes."""

    def clean(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None: ...


def elapsed_ns(start: float) -> int:
    """Nanoseconds since ``time.perf_counter()`` returned ``start`` (the wait statistics' unit)."""
    return int((time.perf_counter() - start) * 1e9)
