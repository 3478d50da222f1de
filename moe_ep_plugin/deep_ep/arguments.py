"""Argument checks of the ``deep_ep`` module's calls: DeepEP's types and ranges, and the resolution of one
``ElasticBuffer.dispatch``'s arguments (fresh or cached), all before any communication."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist

from .. import config
from ..config import positive_int
from .handle import EPHandle, check_handle

if TYPE_CHECKING:
    from .elastic import ElasticBuffer


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, (bool, int)) or value not in (0, 1):
        raise TypeError(f"{name}: expected a bool, got {value!r}")
    return bool(value)


def check_num_sms(num_sms: object) -> int:
    """config.check_num_sms (a positive even int), with DeepEP V2's 0 for "choose" (get_theoretical_num_sms)."""
    return 0 if positive_int(num_sms, "num_sms", 0) == 0 else config.check_num_sms(num_sms, "num_sms")


def check_seconds(name: str, value: object) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{name}: expected a positive number of seconds, got {value!r}")
    return value


def group_size(group: object) -> int:
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group: expected a torch.distributed.ProcessGroup, got {type(group).__name__}")
    return dist.get_world_size(group)


class DispatchArgs(NamedTuple):
    """One dispatch's resolved arguments (a cached one takes the handle's)."""

    handle: EPHandle | None
    do_expand: bool
    do_handle_copy: bool
    sf_col_major: bool
    cpu_sync: bool  # False for a cached dispatch (it reads no counts)
    num_experts: int
    alignment: int
    t_max: int
    num_topk: int


def dispatch_args(
    buf: ElasticBuffer,
    x: object,
    topk_idx: torch.Tensor | None,
    stats: torch.Tensor | None,
    num_experts: int | None,
    num_max_tokens_per_rank: int | None,
    expert_alignment: int | None,
    num_qps: int,
    handle: EPHandle | None,
    do_handle_copy: bool,
    do_cpu_sync: bool | None,
    do_expand: bool,
    do_zero_padding: bool,
    use_tma_aligned_col_major_sf: bool,
) -> DispatchArgs:
    """The checked arguments of ``buf.dispatch`` (``ElasticBuffer.dispatch`` documents each)."""
    positive_int(num_qps, "num_qps", 0)
    do_expand = check_bool("do_expand", do_expand)
    if check_bool("do_zero_padding", do_zero_padding) and not do_expand:
        raise ValueError("do_zero_padding: only meaningful with do_expand=True")
    sf_col_major = check_bool("use_tma_aligned_col_major_sf", use_tma_aligned_col_major_sf)
    do_handle_copy = check_bool("do_handle_copy", do_handle_copy)
    if do_handle_copy and buf._reference_topk_idx:
        raise ValueError("do_handle_copy: EPBuffer keeps topk_idx by reference (DeepEP 2.5); pass False")
    if handle is not None:
        handle = check_handle(handle, buf)
        _check_cached(
            handle, topk_idx, do_cpu_sync, num_experts, expert_alignment, num_max_tokens_per_rank, do_expand, stats
        )
        return DispatchArgs(
            handle,
            do_expand,
            do_handle_copy,
            sf_col_major,
            False,
            handle.num_experts,
            handle.expert_alignment,
            handle.num_max_tokens_per_rank,
            handle.topk_idx.shape[-1],
        )
    data = x[0] if isinstance(x, tuple) and x else x
    num_tokens = data.shape[0] if isinstance(data, torch.Tensor) and data.dim() else 0  # the Buffer checks x
    if topk_idx is None:
        raise ValueError("topk_idx: required without a cached handle")
    if num_experts is None:
        raise ValueError("num_experts: required without a cached handle")
    cpu_sync = True if do_cpu_sync is None else check_bool("do_cpu_sync", do_cpu_sync)
    alignment = positive_int(1 if expert_alignment is None else expert_alignment, "expert_alignment", 1)
    t_max = buf.num_max_tokens_per_rank if num_max_tokens_per_rank is None else num_max_tokens_per_rank
    if positive_int(t_max, "num_max_tokens_per_rank", 0) == 0:
        raise ValueError(
            "num_max_tokens_per_rank: give it to the constructor or the call (the most tokens "
            "any rank dispatches, the same on every rank)"
        )
    if num_tokens > t_max:
        raise ValueError(f"x: {num_tokens} tokens, more than num_max_tokens_per_rank={t_max}")
    if stats is not None and not (
        isinstance(stats, torch.Tensor)
        and stats.dtype == torch.int32
        and stats.shape == (num_experts // buf.num_ranks,)
    ):
        raise ValueError(
            f"cumulative_local_expert_recv_stats: expected an int32 tensor [{num_experts // buf.num_ranks}]"
        )
    return DispatchArgs(
        None, do_expand, do_handle_copy, sf_col_major, cpu_sync, num_experts, alignment, t_max, topk_idx.shape[-1]
    )


def _check_cached(
    handle: EPHandle,
    topk_idx: torch.Tensor | None,
    do_cpu_sync: bool | None,
    num_experts: int | None,
    expert_alignment: int | None,
    num_max_tokens_per_rank: int | None,
    do_expand: bool,
    stats: torch.Tensor | None,
) -> None:
    """A cached dispatch's arguments agree with its handle."""
    if topk_idx is not None:
        raise ValueError("topk_idx: must be None with a cached handle (the handle's layout is reused)")
    if do_cpu_sync:
        raise ValueError("do_cpu_sync: a cached dispatch reads no counts; pass None or False")
    for name, given, kept in (
        ("num_experts", num_experts, handle.num_experts),
        ("expert_alignment", expert_alignment, handle.expert_alignment),
        ("num_max_tokens_per_rank", num_max_tokens_per_rank, handle.num_max_tokens_per_rank),
    ):
        if given is not None and given != kept:
            raise ValueError(f"{name}: the cached handle was made with {kept}, got {given!r}")
    if do_expand != handle.do_expand:
        raise ValueError(
            f"do_expand: the cached handle was made with do_expand={handle.do_expand}; a cached "
            f"dispatch must ask for the same layout"
        )
    if stats is not None:
        raise ValueError("cumulative_local_expert_recv_stats: not counted again by a cached dispatch")


def check_expanded(handle: EPHandle, topk_weights: torch.Tensor | None, allow_multiple_reduction: bool) -> None:
    """An expanded combine's ``topk_weights`` (``[out rows]`` float32; the biases are the Buffer's to check). Refused
    on a buffer made with ``allow_multiple_reduction=False``: DeepEP then sums a token's rows once, in fp32 over all
    its experts, where this library sums each rank's rows first (a second rounding)."""
    if not allow_multiple_reduction:
        raise ValueError(
            "allow_multiple_reduction: an expanded combine here reduces each rank's rows of a token "
            "before the sum over ranks (two roundings), which a buffer made with "
            "allow_multiple_reduction=False asks not to do; make the buffer with True, or combine "
            "non-expanded rows (reduced over the local experts by the caller)"
        )
    if topk_weights is not None and not (
        isinstance(topk_weights, torch.Tensor)
        and topk_weights.dtype == torch.float32
        and topk_weights.shape == (handle._out_rows,)
    ):
        raise ValueError(f"topk_weights: expected float32 [{handle._out_rows}] (expanded rows)")


__all__ = [
    "DispatchArgs",
    "check_bool",
    "check_expanded",
    "check_num_sms",
    "check_seconds",
    "dispatch_args",
    "group_size",
]
