"""DeepEP V2's layouts built from this library's dispatch: per-expert counts, the expanded (expert-major) layout's
blocks and capacity, rows and weights moved into it and back by device-side offsets, ``recv_src_metadata``, rows
padded to capacity, FP8 scales in TMA-aligned column-major form, and float32 weights carried bit for bit in a cached
layout. All on the device, without a host read."""

from __future__ import annotations

import torch

from ..config import round_up
from ..handle import DispatchHandle
from ..ops import permute

XInput = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def count_local(local_ids: torch.Tensor, num_local: int) -> torch.Tensor:
    """int64 ``[num_local]``: how often each id in ``[0, num_local)`` occurs in ``local_ids`` (-1 ignored)."""
    flat = local_ids.reshape(-1).long()
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, torch.where(flat >= 0, flat, num_local), torch.ones_like(flat))
    return counts[:num_local]


def expanded_blocks(
    tokens_per_expert: list[int], recv_slot: torch.Tensor, num_local: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ``([L] aligned start of each local expert's block, [L] its real (token, expert) pairs)`` of an
    expanded layout whose ``recv_slot`` ``[rows, K]`` holds each top-k column's row (-1: not local)."""
    starts = torch.tensor([0] + tokens_per_expert[:-1], dtype=torch.int64, device=recv_slot.device).cumsum(0)
    slots = recv_slot.long()
    block = torch.bucketize(slots, starts, right=True) - 1
    return starts, count_local(torch.where(slots >= 0, block, -1), num_local)


def expanded_capacity(num_ranks: int, t_max: int, num_topk: int, num_local: int, alignment: int) -> int:
    """Output rows of an expanded dispatch without a CPU sync, DeepEP V2's worst case: every rank's most tokens times
    ``min(K, L)``, plus each local expert's alignment padding, rounded up to the alignment."""
    return round_up(num_ranks * t_max * min(num_topk, max(num_local, 1)) + num_local * (alignment - 1), alignment)


def expand_rows(
    recv_x: XInput, recv_weights: torch.Tensor | None, slot: torch.Tensor, rows: int
) -> tuple[XInput, torch.Tensor | None]:
    """Non-expanded rows ``[W, H]`` (a tensor or FP8 pair) and weights ``[W, K]`` float32 → the expanded layout's
    ``rows`` rows (pair ``(r, k)`` at row ``slot[r, k]``; rows no slot names are zero) and ``[rows]`` float32 probs
    (None without weights), on the device (``permute.permute``)."""
    data, scales = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
    out_x, probs, out_scales = permute.permute(data, slot, rows, recv_weights, scales)
    return (out_x if scales is None else (out_x, out_scales)), probs


def expand_weights(weights: torch.Tensor, slot: torch.Tensor, rows: int) -> torch.Tensor:
    """float32 ``[W, K]`` weights → ``[rows]`` in the expanded layout of ``slot`` ``[W, K]`` (0 where no pair lands)."""
    out = weights.new_zeros(rows + 1)
    target = torch.where(slot >= 0, slot.long(), rows)  # pairs of no local expert land in the dropped last entry
    out.scatter_(0, target.flatten(), weights.flatten())
    return out[:rows]


def gather_weights(weights: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """float32 ``[rows]`` expanded-layout weights → ``[W, K]``: each pair's row value (0 where ``slot`` is -1)."""
    padded = torch.cat([weights, weights.new_zeros(1)])  # index -1 reads the appended zero
    return padded[slot.long()]


def source_metadata(
    inner: DispatchHandle,
    rank_idx: int,
    num_scaleout_ranks: int,
    num_scaleup_ranks: int,
    rows: int,
    num_topk: int,
    t_max: int,
    slots: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``recv_src_metadata`` ``[rows, 2 + K]`` int32 and ``psum_num_recv_tokens_per_scaleup_rank`` int32 of rank
    ``rank_idx``, from the handle's rank prefix matrix; ``slots`` ``[rows, K]``: the expanded rows (None: -1)."""
    column = inner.rank_prefix_matrix[:, rank_idx].long()  # inclusive prefix over source ranks
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
    per_scaleup = per_source.view(num_scaleout_ranks, num_scaleup_ranks).sum(0)
    return meta, per_scaleup.cumsum(0).to(torch.int32)


def pad_rows(t: XInput | None, rows: int) -> XInput | None:
    """``t`` (a tensor, an FP8 pair or None) extended with zero rows to ``rows`` rows."""
    if t is None:
        return None
    if isinstance(t, tuple):
        return tuple(pad_rows(part, rows) for part in t)
    if t.shape[0] >= rows:
        return t
    out = t.new_zeros((rows,) + tuple(t.shape[1:]))
    out[: t.shape[0]] = t
    return out


def sf_layout(recv_x: XInput, col_major: bool) -> XInput:
    """FP8 scales as DeepEP's TMA-aligned column-major tensor (rows padded to 4 in storage) when asked."""
    if not col_major or not isinstance(recv_x, tuple):
        return recv_x
    data, scales = recv_x
    rows = scales.shape[0]
    storage = scales.new_zeros(scales.shape[1], round_up(max(rows, 1), 4))
    storage[:, :rows] = scales.t()
    return data, storage[:, :rows].t()


def pack_weights(topk_weights: torch.Tensor) -> torch.Tensor:
    """float32 ``[T, K]`` → BF16 ``[T, round_up(2K, 8)]`` holding each float32 word as two BF16 values (dispatch
    copies rows, it never computes on them; rows of 16-byte multiples for every transport)."""
    num_tokens, num_topk = topk_weights.shape
    packed = torch.zeros(num_tokens, round_up(2 * num_topk, 8), dtype=torch.bfloat16, device=topk_weights.device)
    # flat first: a [0, 1] tensor's last stride may be 0, which a view to a smaller dtype refuses
    packed[:, : 2 * num_topk] = topk_weights.reshape(-1).view(torch.bfloat16).view(num_tokens, 2 * num_topk)
    return packed


def unpack_weights(
    rows: torch.Tensor, num_topk: int, recv_topk_idx: torch.Tensor | None, recv_slot: torch.Tensor | None
) -> torch.Tensor:
    """Dispatched :func:`pack_weights` rows back to float32: ``[rows, K]`` masked where ``recv_topk_idx`` is -1
    (not expanded), or ``[rows]`` each expanded row's own column picked through ``recv_slot`` ``[T', K]``."""
    values = rows[:, : 2 * num_topk].contiguous().view(torch.float32)  # [rows, K]
    if recv_slot is None:
        return values.masked_fill(recv_topk_idx < 0, 0.0)
    slots = recv_slot.long()
    num_rows = values.shape[0]
    column = torch.zeros(num_rows + 1, dtype=torch.int64, device=values.device)
    target = torch.where(slots >= 0, slots, num_rows).flatten()
    column.scatter_(0, target, torch.arange(num_topk, device=values.device).repeat(slots.shape[0]))
    filled = torch.zeros(num_rows + 1, dtype=torch.bool, device=values.device)
    filled.scatter_(0, target, True)
    picked = values.gather(1, column[:num_rows, None]).squeeze(1)
    return picked.masked_fill(~filled[:num_rows], 0.0)


__all__ = [
    "count_local",
    "expand_rows",
    "expand_weights",
    "expanded_blocks",
    "expanded_capacity",
    "gather_weights",
    "pack_weights",
    "pad_rows",
    "sf_layout",
    "source_metadata",
    "unpack_weights",
]
