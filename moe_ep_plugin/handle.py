"""The layout of one dispatch, kept so combine (and the backward passes) can replay it without top-k."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch


@dataclass
class DispatchHandle:
    """Everything combine and cached dispatch need; the same fields for every transport.

    R = EP ranks, N = local tokens, N_recv = rows this rank received.

    - ``rank_prefix_matrix`` ``[R, R]`` int32: ``rpm[i, j]`` = tokens ranks ``0..i`` send to rank ``j``
      (inclusive prefix over source ranks; every rank holds the whole matrix). Rows from source ``i`` sit at
      ``[rpm[i-1, me], rpm[i, me])`` of this rank's ``recv_x``.
    - ``is_token_in_rank`` ``[N, R]`` bool: token ``t`` was sent to rank ``r``.
    - ``send_pos`` ``[N, R]`` int32: index of token ``t`` among the tokens this rank sends to ``r`` (-1 if not
      sent); token order is preserved, so its row on ``r`` is ``rpm[me-1, r] + send_pos[t, r]``.
    - ``recv_src_idx`` ``[N_recv]`` int32: index of each received row's token on its source rank.
    - ``num_recv_tokens``: rows actually received (``recv_x`` may be longer with ``num_worst_tokens``);
      ``None`` when a transport keeps it on the GPU only (CUDA-graph mode).
    - ``transport_state``: private data a transport caches for its own replay (never read by others).
    """

    rank_prefix_matrix: torch.Tensor
    is_token_in_rank: torch.Tensor
    send_pos: torch.Tensor
    recv_src_idx: torch.Tensor
    num_tokens: int
    num_recv_tokens: Optional[int]
    num_experts: int
    rank: int
    num_ranks: int
    num_recv_rows: int  # rows of recv_x as allocated (== num_recv_tokens unless num_worst_tokens)
    transport_state: Any = field(default=None, repr=False)

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks
