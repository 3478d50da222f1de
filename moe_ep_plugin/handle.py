"""The layout of one dispatch, kept so combine (and the backward passes) can replay it without top-k."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .config import positive_int, round_up


def rounded_counts(counts: list[int], alignment: int) -> list[int]:
    """Each count rounded up to a multiple of ``alignment`` (a grouped GEMM's per-expert row granularity)."""
    return [round_up(c, alignment) for c in counts]


@dataclass
class ExpertLayout:
    """Where each received (row, top-k column) pair sits in the expert-major layout of this rank.

    Local expert ``l`` owns rows ``[base[l], base[l] + tokens_per_expert[l])``, ``base`` the exclusive cumsum;
    inside a block rows follow received-row order (source rank, then source token), padding rows at the end.

    - ``recv_slot`` ``[N_recv, K]`` int32: expert-major row of each pair; -1 where the column's expert is
      not local (or was -1).
    - ``tokens_per_expert``: rows per local expert, rounded up to ``alignment`` (length L); ``num_rows`` = M =
      their sum.
    """

    recv_slot: torch.Tensor
    tokens_per_expert: list[int]
    num_rows: int
    alignment: int


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
    - ``topk_idx`` ``[N, K]`` int64: the dispatch's top-k ids (None for a dispatch by layout alone), which set the
      order combine sums a token's copies in (``ops.layout.summing_order``).
    - ``expert_layout``: the expert-major layout when the handle comes from ``dispatch_experts`` (else None);
      cached ``dispatch_experts`` and ``combine_experts`` replay it.
    - ``transport_state``: private data a transport caches for its own replay (never read by others).
    """

    rank_prefix_matrix: torch.Tensor
    is_token_in_rank: torch.Tensor
    send_pos: torch.Tensor
    recv_src_idx: torch.Tensor
    num_tokens: int
    num_recv_tokens: int | None
    num_experts: int
    rank: int
    num_ranks: int
    num_recv_rows: int  # rows of recv_x as allocated (== num_recv_tokens unless num_worst_tokens)
    topk_idx: torch.Tensor | None = field(default=None, repr=False)
    expert_layout: ExpertLayout | None = field(default=None, repr=False)
    transport_state: Any = field(default=None, repr=False)

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    # DeepEP's intranode handle is the tuple (rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix,
    # recv_src_idx, is_token_in_rank, send_head); code written for it indexes and unpacks it.
    def __len__(self) -> int:
        return len(DEEPEP_HANDLE_FIELDS)

    def __getitem__(self, position: int) -> Any:
        """DeepEP's tuple position ``position``: the same tensor where this library has it, else a
        :class:`NoEquivalent` that raises naming the position when used."""
        try:  # out of range is the sequence protocol's IndexError, not a ValueError
            positive_int(position, "handle[position]", -len(self), len(self) - 1)
        except ValueError:
            raise IndexError(f"handle[{position}]: DeepEP's intranode handle has 6 positions") from None
        position %= len(self)
        name = DEEPEP_HANDLE_FIELDS[position]
        if name in ("rank_prefix_matrix", "recv_src_idx", "is_token_in_rank"):
            return getattr(self, name)
        return NoEquivalent(position, name)

    def __iter__(self):
        return (self[i] for i in range(len(self)))


DEEPEP_HANDLE_FIELDS = (
    "rank_prefix_matrix",
    "channel_prefix_matrix",
    "recv_channel_prefix_matrix",
    "recv_src_idx",
    "is_token_in_rank",
    "send_head",
)


class NoEquivalent:
    """A DeepEP handle position this library has no value for (its kernels have no channels and no ring-buffer
    heads): unpacking works, any use raises naming the position."""

    def __init__(self, position: int, name: str) -> None:
        self._what = (
            f"handle[{position}] ({name}): DeepEP's per-channel kernel state has no equivalent in "
            "moe_ep_plugin (docs/buffer.md, 'The handle'); pass the handle itself to combine or a cached "
            "dispatch"
        )

    def __getattr__(self, attr: str) -> Any:
        raise NotImplementedError(self._what)

    def __repr__(self) -> str:
        return f"<NoEquivalent: {self._what}>"

    def __bool__(self) -> bool:
        raise NotImplementedError(self._what)
