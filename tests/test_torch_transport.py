"""The torch transport's own guarantees, beyond the Buffer suite (tests/test_buffer.py): the handle fields as
moe_ep_plugin/handle.py defines them, combine's fp32 sum from the biases (or 0.0) in DeepEP V2's summing order
(bit for bit, signed zeros included, for FP32, BF16 and FP16 rows), cached FP8 dispatch, and the collectives each
call makes (one count exchange per new layout; payload and metadata one all-to-all each; none of either in a cached
dispatch or combine)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from support.reference import expected_dispatch, gather_all, summing_order

from moe_ep_plugin import Buffer
from moe_ep_plugin.launch import spawn
from moe_ep_plugin.ops import fp8
from moe_ep_plugin.ops.layout import summing_order as layout_summing_order
from moe_ep_plugin.transports import torch_transport

# Rank r's value in the order-sensitive columns, per dtype of the combined rows: 1 + 2^24 rounds back to 2^24 in fp32,
# so the sum over three ranks is 0, 1 or 2^24 depending on the order the copies are added in. FP16 holds no 2^24: its
# smallest subnormal 2^-24 against 2^15 (whose fp32 ulp is 2^-8) does the same, and both sums round to FP16 exactly.
ORDER_VALUES = {
    torch.float32: (1.0, 2.0**24, -(2.0**24)),
    torch.bfloat16: (1.0, 2.0**24, -(2.0**24)),
    torch.float16: (2.0**-24, 2.0**15, -(2.0**15)),
}


def _record_collectives() -> list[str]:
    """Patch this process's collectives so every call is appended to the returned list."""
    calls: list[str] = []
    all_to_all, all_gather = dist.all_to_all_single, torch_transport._all_gather_single

    def counted_all_to_all(*args, **kwargs):
        calls.append("all_to_all")
        return all_to_all(*args, **kwargs)

    def counted_all_gather(*args, **kwargs):
        calls.append("all_gather")
        return all_gather(*args, **kwargs)

    dist.all_to_all_single = counted_all_to_all
    torch_transport._all_gather_single = counted_all_gather
    return calls


def _routing(n: int, k: int, num_experts: int, gen: torch.Generator) -> torch.Tensor:
    """``[n, k]`` distinct experts per token, about a fifth of the entries -1."""
    idx = torch.rand(n, num_experts, generator=gen).argsort(dim=1)[:, :k]
    return torch.where(torch.rand(n, k, generator=gen) < 0.2, -1, idx)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _suite(seed: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    calls = _record_collectives()
    buffer = Buffer(transport="torch", timeout_s=60)
    gen = torch.Generator().manual_seed(seed * 10 + rank)
    n, h, k, local = (9, 0, 14)[rank % 3], 256, 4, 2  # rank 1 has no tokens
    num_experts = local * world
    x = torch.randn(n, h, generator=gen).bfloat16()
    idx = _routing(n, k, num_experts, gen)
    w = torch.rand(n, k, generator=gen)
    xs, idxs, ws = zip(*gather_all((x, idx, w)), strict=False)

    calls.clear()
    recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
        x, topk_idx=idx, topk_weights=w, num_experts=num_experts
    )
    assert calls == ["all_gather", "all_to_all", "all_to_all"], calls
    rows, ref_idx, ref_w, ref_src, ref_counts = expected_dispatch(xs, idxs, ws, num_experts, rank, world)
    assert recv_x.shape == (len(rows), h) and counts == ref_counts
    if rows:
        assert torch.equal(recv_x, torch.stack(rows))
        assert recv_idx.tolist() == ref_idx and recv_w.tolist() == ref_w
    assert handle.recv_src_idx.tolist() == ref_src and handle.num_recv_tokens == len(rows)

    # send_pos: index of t among the tokens sent to r; rank_prefix_matrix: inclusive prefix over sources. Together
    # they place token t's row on rank r at rpm[me - 1, r] + send_pos[t, r].
    in_rank = [[any(e >= 0 and e // local == r for e in row) for r in range(world)] for row in idx.tolist()]
    running = [0] * world
    ref_pos = []
    for sent in in_rank:
        ref_pos.append([running[r] if sent[r] else -1 for r in range(world)])
        running = [c + s for c, s in zip(running, sent, strict=False)]
    assert handle.send_pos.tolist() == ref_pos
    all_running = gather_all(running)
    assert handle.rank_prefix_matrix.tolist() == torch.tensor(all_running).cumsum(0).tolist()
    recv_xs = gather_all(recv_x)
    for t in range(n):
        for r in range(world):
            if in_rank[t][r]:
                row = (handle.rank_prefix_matrix[rank - 1, r] if rank else 0) + handle.send_pos[t, r]
                assert torch.equal(recv_xs[r][row], x[t])

    # cached dispatch: the rows only (FP8: bytes, then scales), no count exchange
    calls.clear()
    again, none_idx, _, _, _, _ = buffer.dispatch(x, handle=handle)
    assert calls == ["all_to_all"] and torch.equal(again, recv_x) and none_idx is None
    calls.clear()
    (rq, rs), _, _, _, _, _ = buffer.dispatch(fp8.quantize(x), handle=handle)
    assert calls == ["all_to_all", "all_to_all"], calls
    ref_q, ref_s = fp8.quantize(recv_x)
    assert torch.equal(rq.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(rs, ref_s)

    # combine: half the columns carry rank-scaled rows (which row goes where), half ORDER_VALUES (summation
    # order); rows of tokens with t % 3 == 0 are -0.0 everywhere, which must sum to +0.0 as from 0.0.
    srcs, recv_ws = zip(*gather_all((handle.recv_src_idx, recv_w)), strict=False)
    copies: list[dict[int, int]] = [{} for _ in range(n)]  # token -> {rank: row of its copy on that rank}
    for r in range(world):
        # rank r's rows from this rank: the slice [rpm[me-1, r], rpm[me, r]) of what r received
        lo = int(handle.rank_prefix_matrix[rank - 1, r]) if rank else 0
        for row in range(lo, int(handle.rank_prefix_matrix[rank, r])):
            copies[int(srcs[r][row])][r] = row
    orders = [summing_order(row, local, world) for row in idx.tolist()]
    bias = torch.randn(n, h, generator=gen)
    for dtype, order_values in ORDER_VALUES.items():
        y = recv_x.float() * (rank + 1)
        y[:, h // 2 :] = order_values[rank % 3]
        y[handle.recv_src_idx % 3 == 0] = -0.0
        ys = gather_all(y)
        expected, expected_b = torch.zeros(n, h), bias.to(dtype).float().clone()
        expected_w = torch.zeros(n, k)
        for t in range(n):  # fp32 from 0.0 (or the bias), the copies in summing order
            for r in orders[t]:
                if r in copies[t]:
                    expected[t] = expected[t] + ys[r][copies[t][r]].to(dtype).float()
                    expected_b[t] = expected_b[t] + ys[r][copies[t][r]].to(dtype).float()
                    expected_w[t] = expected_w[t] + recv_ws[r][copies[t][r]]
        calls.clear()
        combined, combined_w, _ = buffer.combine(y.to(dtype), handle, topk_weights=recv_w, bias=bias.to(dtype))
        assert calls == ["all_to_all", "all_to_all"], calls
        assert torch.equal(_bits(combined), _bits(expected_b.to(dtype)))
        assert torch.equal(_bits(combined_w), _bits(expected_w))
        calls.clear()
        plain, none_w, _ = buffer.combine(y.to(dtype), handle)
        assert calls == ["all_to_all"] and none_w is None
        assert torch.equal(_bits(plain), _bits(expected.to(dtype)))


def test_torch_transport_layout_order_and_collectives() -> None:
    spawn(_suite, 3, args=(int(time.time()) % 1000,), backend="gloo")


def test_summing_order_matches_plain_loop() -> None:
    """``ops.layout.summing_order`` (torch ops, what the transports use) against the plain loop, with -1, repeated
    and out-of-range ids, tokens naming no rank, and a dispatch by layout alone (ascending)."""
    gen = torch.Generator().manual_seed(int(time.time()) % 1000)
    for world, local, k in ((1, 4, 3), (3, 2, 4), (4, 3, 8), (8, 1, 5)):
        n, num_experts = 17, world * local
        idx = torch.randint(-1, num_experts + 2, (n, k), generator=gen)
        idx[0] = -1
        idx[1] = idx[1, 0]
        got = layout_summing_order(idx, num_experts, world, n, torch.device("cpu"))
        assert got.tolist() == [summing_order(row, local, world) for row in idx.tolist()]
        plain = layout_summing_order(None, num_experts, world, n, torch.device("cpu"))
        assert plain.tolist() == [list(range(world))] * n
