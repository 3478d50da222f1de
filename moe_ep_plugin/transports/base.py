"""The interface every transport implements; ``Buffer`` validates, keeps streams and calls these.

A transport only moves rows. Inputs reaching it are already validated (dtypes, shapes, devices, ranges),
run on the right stream, and are contiguous.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..config import Config
from ..handle import DispatchHandle


@dataclass
class DispatchArgs:
    """One dispatch. ``x``: ``[N, H]`` BF16/FP32, or FP8 e4m3 with ``x_scales`` ``[N, H/128]`` float32.

    ``wire_fp8``: BF16 ``x`` is quantized to FP8 (1x128 blocks) before it is sent (``round_scale``: UE8M0
    scales); ``recv_bf16``: FP8 rows are dequantized on receive (to the dtype of ``x``). ``topk_idx`` holds *global* expert ids
    (-1 = none); with ``handle`` set it is None (cached layout).
    """

    x: torch.Tensor
    x_scales: Optional[torch.Tensor]
    topk_idx: Optional[torch.Tensor]
    topk_weights: Optional[torch.Tensor]
    num_tokens_per_rank: Optional[torch.Tensor]
    is_token_in_rank: Optional[torch.Tensor]
    num_experts: int
    handle: Optional[DispatchHandle]
    num_worst_tokens: int
    wire_fp8: bool
    recv_bf16: bool
    round_scale: bool
    config: Config


@dataclass
class DispatchResult:
    """``recv_x`` ``[N_recv, H]`` (BF16/FP32 or FP8), ``recv_scales`` ``[N_recv, H/128]`` float32 or None,
    ``recv_topk_idx`` ``[N_recv, K]`` int64 *local* ids (-1 elsewhere), ``recv_topk_weights`` float32 (0 where -1),
    ``num_recv_tokens_per_expert`` ``[L]`` int32 on the device (unaligned) or None without top-k."""

    recv_x: torch.Tensor
    recv_scales: Optional[torch.Tensor]
    recv_topk_idx: Optional[torch.Tensor]
    recv_topk_weights: Optional[torch.Tensor]
    num_recv_tokens_per_expert: Optional[torch.Tensor]
    handle: DispatchHandle


class Transport(abc.ABC):
    """Moves rows between the ranks of ``group``. ``timeout_s`` bounds every wait on a peer."""

    name: str = "abstract"

    def __init__(self, group: dist.ProcessGroup, device: torch.device, timeout_s: float) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.device = device
        self.timeout_s = timeout_s

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``topk_idx`` ``[N, K]`` int64 → ``(num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32,
        is_token_in_rank [N, R] bool)``. Default: plain torch ops on the tensor's device (no communication)."""
        from ..layout import dispatch_layout
        return dispatch_layout(topk_idx, num_experts, self.num_ranks)

    @abc.abstractmethod
    def dispatch(self, args: DispatchArgs) -> DispatchResult:
        """Send row ``t`` of ``x`` once to every rank with ``is_token_in_rank[t, r]``; see ``DispatchResult``."""

    @abc.abstractmethod
    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: Optional[torch.Tensor],
                bias: tuple[torch.Tensor, ...], config: Config) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Reverse of dispatch: ``x`` ``[N_recv, H]`` → ``[N, H]`` summed in fp32 over the ranks that got each token,
        plus each ``bias`` ``[N, H]``, cast to ``x.dtype``; ``topk_weights`` ``[N_recv, K]`` summed the same way."""
