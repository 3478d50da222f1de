"""Received rows ↔ expert-major layout for a grouped GEMM (the "prepare"/"finalize" steps around the experts).

After dispatch each received row carries up to K local expert ids. ``permute`` makes one row per (row, local
expert) pair, grouped by expert (stable: row order within an expert), each expert's block padded with zero rows
to ``alignment``; ``unpermute`` sums the expert outputs of every received row back (fp32 accumulation by default).
The only host data used is the count list dispatch already returned: no extra syncs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class RowMap:
    """``rows`` ``[M]`` int64: received row feeding each permuted row (``num_rows`` for padding rows)."""

    rows: torch.Tensor
    num_rows: int
    has_padding: bool


def permute(recv_x: torch.Tensor, recv_topk_idx: torch.Tensor, recv_topk_weights: Optional[torch.Tensor],
            num_local_experts: int, num_tokens_per_expert: list[int], alignment: int = 1
            ) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, RowMap]:
    """``recv_x`` ``[N_recv, H]``, ``recv_topk_idx`` ``[N_recv, K]`` local ids (-1 = none), weights float32 →
    ``(permuted_x [M, H], permuted_probs [M] float32 or None, tokens_per_expert [L] int64 (CPU), row_map)``.

    ``num_tokens_per_expert``: the list from dispatch, already rounded up to ``alignment`` (M = its sum).
    """
    if not isinstance(recv_x, torch.Tensor) or recv_x.dim() != 2:
        raise ValueError("recv_x: expected a 2-D [rows, hidden] tensor")
    if not isinstance(recv_topk_idx, torch.Tensor) or recv_topk_idx.dim() != 2 or recv_topk_idx.shape[0] != recv_x.shape[0]:
        raise ValueError(f"recv_topk_idx: expected [{recv_x.shape[0]}, K], got "
                         f"{list(recv_topk_idx.shape) if isinstance(recv_topk_idx, torch.Tensor) else recv_topk_idx}")
    if recv_topk_weights is not None and recv_topk_weights.shape != recv_topk_idx.shape:
        raise ValueError(f"recv_topk_weights: expected shape {list(recv_topk_idx.shape)}, got {list(recv_topk_weights.shape)}")
    if len(num_tokens_per_expert) != num_local_experts:
        raise ValueError(f"num_tokens_per_expert: expected {num_local_experts} counts, got {len(num_tokens_per_expert)}")
    if not isinstance(alignment, int) or alignment < 1:
        raise ValueError(f"alignment: expected a positive int, got {alignment!r}")
    if any(c % alignment for c in num_tokens_per_expert):
        raise ValueError(f"num_tokens_per_expert: counts must be multiples of alignment={alignment}")
    n, k = recv_topk_idx.shape
    num_out = sum(num_tokens_per_expert)
    flat = recv_topk_idx.reshape(-1)
    key = torch.where(flat >= 0, flat, num_local_experts)
    order = torch.sort(key, stable=True).indices  # slot = row * K + k, grouped by expert, rows ascending
    if alignment == 1:
        # Without padding the first M sorted slots are exactly the permuted rows, in order.
        slot_of = order[:num_out]
    else:
        slot_of = _padded_slots(key, order, num_local_experts, alignment, num_out, n * k)
    is_pad = slot_of == n * k  # padding rows hold the past-the-end slot n * k
    rows = torch.where(is_pad, n, slot_of // k)
    has_padding = alignment > 1
    # Padding rows point at row n (past the end): clamp them to a real row for the gather, then zero them.
    permuted_x = recv_x.index_select(0, rows.clamp_max(max(n - 1, 0)))
    if has_padding:
        permuted_x = permuted_x.masked_fill(is_pad.unsqueeze(1), 0)
    probs = None
    if recv_topk_weights is not None:
        flat_w = torch.cat([recv_topk_weights.reshape(-1).float(), recv_topk_weights.new_zeros(1, dtype=torch.float32)])
        probs = flat_w.index_select(0, slot_of)
    tokens_per_expert = torch.tensor(num_tokens_per_expert, dtype=torch.int64)
    return permuted_x, probs, tokens_per_expert, RowMap(rows, n, has_padding)


def unpermute(expert_out: torch.Tensor, row_map: RowMap, fp32_accumulation: bool = True) -> torch.Tensor:
    """``expert_out`` ``[M, H]`` → ``[N_recv, H]``: each received row's local-expert outputs summed.

    ``fp32_accumulation=False`` sums in ``expert_out.dtype`` instead (what Megatron-Core's own unpermute does):
    for BF16 it skips an fp32 copy of all M rows, which dominates this step at large shapes.
    """
    if not isinstance(row_map, RowMap):
        raise TypeError(f"row_map: expected the RowMap from permute, got {type(row_map).__name__}")
    if expert_out.dim() != 2 or expert_out.shape[0] != row_map.rows.shape[0]:
        raise ValueError(f"expert_out: expected [{row_map.rows.shape[0]}, H], got {list(expert_out.shape)}")
    acc_dtype = torch.float32 if fp32_accumulation else expert_out.dtype
    acc = torch.zeros(row_map.num_rows + 1, expert_out.shape[1], dtype=acc_dtype, device=expert_out.device)
    acc = acc.index_add(0, row_map.rows, expert_out.to(acc_dtype))
    return acc[:row_map.num_rows].to(expert_out.dtype)


def _padded_slots(key: torch.Tensor, order: torch.Tensor, num_local_experts: int, alignment: int, num_out: int,
                  pad_slot: int) -> torch.Tensor:
    """``[M]`` source slot of each permuted row when every expert's block is padded to ``alignment``
    (``pad_slot`` for padding rows); each sorted slot moves down by the padding of the experts before it."""
    device = key.device
    exact = torch.zeros(num_local_experts + 1, dtype=torch.int64, device=device)
    exact.scatter_add_(0, key, torch.ones_like(key))
    exact = exact[:num_local_experts]
    aligned = (exact + alignment - 1) // alignment * alignment
    shift = torch.cumsum(aligned - exact, 0) - (aligned - exact)  # padding rows before each expert's block
    sorted_key = key[order]
    expert = sorted_key.clamp_max(num_local_experts - 1)
    # Slots without a local expert land on an extra dump position M that is sliced off.
    dest = torch.where(sorted_key < num_local_experts, torch.arange(key.numel(), device=device) + shift[expert],
                       num_out)
    slot_of = torch.full((num_out + 1,), pad_slot, dtype=torch.int64, device=device)
    slot_of.scatter_(0, dest, order)
    return slot_of[:num_out]
