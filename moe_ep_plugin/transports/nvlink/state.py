"""What an nvlink dispatch keeps for the calls that replay it (``DispatchHandle.transport_state``), and the host
words its notify exchanges."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...ops.library import META_WORDS, HostInts
from ..base import DispatchArgs, dispatch_meta


def info_address(prefix: torch.Tensor, num_ranks: int) -> int:
    """Address of notify's ``info`` words, right after the rank prefix matrix ``[R, R]`` in ``prefix``: one host
    read brings both."""
    return prefix.data_ptr() + 4 * num_ranks * num_ranks


def meta_words(args: DispatchArgs) -> HostInts:
    """``dispatch_meta(args)`` as the ``MOE_EP_META_WORDS`` int32 words notify exchanges (zero-padded)."""
    words = dispatch_meta(args)
    return HostInts(words + [0] * (META_WORDS - len(words)))


@dataclass
class ExpertState:
    """What a cached expert-major dispatch replays: the forward's top-k ``[N, K]`` int64, each entry's position
    among this rank's entries for its expert ``expert_pos`` ``[N, K]`` int32 and ``send_offset`` ``[E]`` int32
    (notify's outputs; notify's ``info`` ``[3 + 2L]`` int32 follows the rank prefix matrix, csrc/moe_ep.h)."""

    topk_idx: torch.Tensor
    expert_pos: torch.Tensor
    send_offset: torch.Tensor


@dataclass
class NVLinkState:
    """Notify's ``prefix`` (the rank prefix matrix ``[R * R]`` then ``info``, int32), the tokens sent to each rank,
    in order (``send_list`` ``[R, max(N, 1)]`` int32), the count matrix on the host (``host_counts[i * R + j]``:
    rows rank i sends to rank j; None after a ``num_worst_tokens`` dispatch, which reads nothing back) and, for an
    expert-major handle, its layout state."""

    prefix: torch.Tensor
    send_list: torch.Tensor
    host_counts: list[int] | None = None
    expert: ExpertState | None = None
    _counts: HostInts | None = field(default=None, repr=False)

    def copy_counts(self) -> HostInts | None:
        """``host_counts`` as the host array the copy-engine and pull combines read (built once), or None."""
        if self.host_counts is None:
            return None
        if self._counts is None:
            self._counts = HostInts(self.host_counts)
        return self._counts
