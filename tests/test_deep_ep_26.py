"""DeepEP 2.6's ``EPBuffer`` additions (``moe_ep_plugin.deep_ep.ep_buffer``) on gloo, 1-4 ranks, against a plain loop.

- FP32 combine output (``out_dtype=torch.float32``): non-expanded and expanded, expert alignment 1 and 128, hidden
  384 (a multiple of 128 and of nothing larger among 256/512), with and without a bias, ranks without tokens and -1
  in ``topk_idx``: bit for bit the fp32 sum of every row a token's copies carry. The rows are multiples of 1/16 in
  [-16, 16] (8 significant bits, exact in BF16) whose sums need more bits than BF16 has, so a BF16 rounding anywhere
  would show.
- ``resize``: new sizes serve a dispatch and combine exactly; a handle from before is refused naming it; a refusal on
  one rank or ranks asking for different ``num_bytes`` raise on every rank and leave the buffer usable.
- ``lb_get_redundancy_mapping`` refused by name; a bad ``out_dtype`` named.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from support.reference import gather_all, routing

from moe_ep_plugin import deep_ep
from moe_ep_plugin.launch import spawn

TOPK = 3


def _rows(global_idx: torch.Tensor, salt: torch.Tensor, hidden: int) -> torch.Tensor:
    """BF16 ``[n, hidden]`` rows of multiples of 1/16 in [-255/16, 255/16], a function of (global index, salt) only:
    every rank can compute what any rank sends."""
    cols = torch.arange(hidden)
    v = (global_idx.long()[:, None] * 7 + salt.long()[:, None] * 13 + cols[None, :] * 3) % 511 - 255
    return (v.float() / 16).bfloat16()


def _round(
    buffer,
    seed: int,
    hidden: int,
    t_max: int,
    expand: bool,
    alignment: int,
    with_bias: bool,
    out_dtype: torch.dtype | None = torch.float32,
):
    """One dispatch and combine; returns the handle. The combine input row of (token, rank) (not expanded) or of
    (token, expert) (expanded) is ``_rows(global index, rank or expert)``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(seed * 7919 + rank)
    local = 2 + seed % 2
    num_experts = local * world
    n = (seed + 3 * rank) % (t_max + 1) if seed % 4 else 0  # some rounds send nothing from some ranks
    idx = routing(("random", "sparse", "one_expert")[seed % 3], n, TOPK, num_experts, gen)
    x = _rows(rank * t_max + torch.arange(n), torch.zeros(n), hidden)
    idxs = gather_all(idx)
    _, _, _, handle, _ = buffer.dispatch(
        x,
        topk_idx=idx,
        num_experts=num_experts,
        num_max_tokens_per_rank=t_max,
        expert_alignment=alignment,
        do_expand=expand,
    )
    meta = handle.recv_src_metadata
    if expand:
        y = torch.zeros(handle.num_expanded_tokens, hidden, dtype=torch.bfloat16)
        for g, src, *slots in meta.tolist():
            for k, row in enumerate(slots):
                if row >= 0:
                    y[row] = _rows(torch.tensor([g]), idxs[src][g - src * t_max, k].reshape(1), hidden)[0]
    else:
        y = _rows(meta[:, 0], torch.full((meta.shape[0],), rank), hidden)
    bias = _rows(torch.arange(n), torch.full((n,), 99), hidden) if with_bias else None
    combined, _, _ = buffer.combine(y, handle, bias=bias, out_dtype=out_dtype)
    expected = torch.zeros(n, hidden) if bias is None else bias.float()
    g = rank * t_max + torch.arange(n)
    for k in range(TOPK):
        e = idx[:, k]
        if expand:
            salt = e
        else:  # each destination rank once, at the first top-k column naming it
            salt = torch.where(e >= 0, e // local, -1)
            for j in range(k):
                salt = torch.where((idx[:, j] >= 0) & (idx[:, j] // local == salt), -1, salt)
        valid = salt >= 0
        expected[valid] += _rows(g[valid], salt[valid], hidden).float()
    want = expected if out_dtype == torch.float32 else expected.bfloat16()
    assert combined.dtype == want.dtype and torch.equal(combined, want), (seed, expand, alignment, with_bias)
    return handle


def _fp32_suite(seed: int) -> None:
    buffer = deep_ep.EPBuffer(
        dist.group.WORLD,
        num_max_tokens_per_rank=12,
        hidden=384,
        num_topk=TOPK,
        transport="torch",
        explicitly_destroy=True,
    )
    try:
        for i, (expand, alignment, with_bias) in enumerate(
            (e, a, b) for e in (False, True) for a in (1, 128) for b in (False, True)
        ):
            for j in range(3):
                _round(buffer, seed + 3 * i + j, 384, 12, expand, alignment, with_bias)
    finally:
        buffer.destroy()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_fp32_combine_output_matches_plain_loop(world: int) -> None:
    spawn(_fp32_suite, world, args=(int(time.time()) % 1000,), backend="gloo")


def _resize_suite(seed: int) -> None:
    rank = dist.get_rank()
    group = dist.group.WORLD
    buffer = deep_ep.EPBuffer(
        group, num_max_tokens_per_rank=6, hidden=128, num_topk=TOPK, transport="torch", explicitly_destroy=True
    )
    try:
        old = _round(buffer, seed, 128, 6, False, 1, False, out_dtype=None)
        buffer.resize(num_max_tokens_per_rank=16, hidden=384)
        assert (buffer.num_max_tokens_per_rank, buffer.hidden, buffer.num_topk) == (16, 384, TOPK)
        assert buffer.num_bytes == deep_ep.EPBuffer.get_buffer_size_hint(group, 16, 384, TOPK)
        with pytest.raises(ValueError, match=r"handle: it was made before the buffer's resize\(\)"):
            buffer.combine(torch.zeros(old.num_recv_tokens, 128, dtype=torch.bfloat16), old)
        for i in range(3):
            _round(buffer, seed + 1 + i, 384, 16, i % 2 == 1, 128, i == 2)
        handle = _round(buffer, seed + 5, 384, 16, True, 1, False)
        # a refusal (on the last rank only) and ranks asking for different sizes: every rank raises, nothing is
        # resized and the last handle still combines
        last = dist.get_world_size() - 1
        with pytest.raises(
            ValueError, match="num_bytes: expected" if rank == last else rf"resize: rank\(s\) \[{last}\] refused"
        ):
            buffer.resize(num_bytes=-1 if rank == last else None, hidden=512)
        if last > 0:
            with pytest.raises(ValueError, match="num_bytes: the ranks ask for different sizes"):
                buffer.resize(num_bytes=(rank + 1) * deep_ep.elastic.BUFFER_ALIGNMENT)
        assert buffer.hidden == 384
        buffer.combine(torch.zeros(handle.num_expanded_tokens, 384, dtype=torch.bfloat16), handle)
        buffer.resize(num_bytes=4 * deep_ep.elastic.BUFFER_ALIGNMENT, num_topk=2)
        assert buffer.num_bytes == 4 * deep_ep.elastic.BUFFER_ALIGNMENT and buffer.num_topk == 2
        with pytest.raises(NotImplementedError, match="EPBuffer.lb_get_redundancy_mapping: not served"):
            buffer.lb_get_redundancy_mapping(torch.zeros(4, dtype=torch.int32))
        x = torch.zeros(2, 384, dtype=torch.bfloat16)
        idx = torch.tensor([[0, -1], [-1, -1]])
        _, _, _, small, _ = buffer.dispatch(x, topk_idx=idx, num_experts=dist.get_world_size())
        rows = torch.zeros(small.num_recv_tokens, 384, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="out_dtype: expected None"):
            buffer.combine(rows, small, out_dtype=torch.float16)
        with pytest.raises(TypeError, match="out_dtype: expected a torch.dtype"):
            buffer.combine(rows, small, out_dtype="fp32")
        buffer.combine(rows, small)  # the refusals left the handle usable
    finally:
        buffer.destroy()


@pytest.mark.parametrize("world", [1, 3])
def test_resize(world: int) -> None:
    spawn(_resize_suite, world, args=(int(time.time()) % 1000,), backend="gloo")
