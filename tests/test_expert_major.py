"""Expert-major dispatch/combine (Buffer and autograd) on the torch transport (gloo, 1–4 ranks) against plain loops."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from support.reference import dense_reference, gather_all, routing, summing_order

from moe_ep_plugin import Buffer, autograd
from moe_ep_plugin.launch import spawn
from moe_ep_plugin.ops import fp8

# Every case runs on every world size, in BF16 and FP32.
CASES = [
    dict(tokens=lambda r: 7 + 5 * r, hidden=256, topk=2, experts_per_rank=2, routing="random", alignment=1),
    dict(
        tokens=lambda r: 0 if r == 0 else 9, hidden=128, topk=8, experts_per_rank=4, routing="random", alignment=4
    ),  # a rank with 0 tokens; K > E at world 1
    dict(tokens=lambda r: 6, hidden=40, topk=1, experts_per_rank=3, routing="random", alignment=3),
    dict(
        tokens=lambda r: 11 - r, hidden=128, topk=4, experts_per_rank=2, routing="one_expert", alignment=2
    ),  # every token to expert E-1: other ranks receive nothing
    dict(tokens=lambda r: 10, hidden=256, topk=3, experts_per_rank=2, routing="sparse", alignment=1),
]


def expected_layout(idxs: list[torch.Tensor], num_experts: int, rank: int, world: int, alignment: int):
    """The layout on ``rank``: for each source rank, each token in order, each top-k column whose expert is local →
    the next row of that expert's block. Returns ``(tokens_per_expert, recv_slot rows, source (src, t, k) of each
    of the M rows or None for padding)``."""
    local = num_experts // world
    blocks: list[list[tuple[int, int, int]]] = [[] for _ in range(local)]
    received = []  # per received row: (local expert, index in its block) per top-k column, or None
    for src, idx in enumerate(idxs):
        for t, ids in enumerate(idx.tolist()):
            if not any(e >= 0 and e // local == rank for e in ids):
                continue
            row = []
            for k, e in enumerate(ids):
                if e >= 0 and e // local == rank:
                    row.append((e - rank * local, len(blocks[e - rank * local])))
                    blocks[e - rank * local].append((src, t, k))
                else:
                    row.append(None)
            received.append(row)
    tokens_per_expert = [-(-len(b) // alignment) * alignment for b in blocks]
    base = [sum(tokens_per_expert[:le]) for le in range(local)]
    recv_slot = [[-1 if p is None else base[p[0]] + p[1] for p in row] for row in received]
    sources: list = []
    for b, size in zip(blocks, tokens_per_expert, strict=False):
        sources += b + [None] * (size - len(b))
    return tokens_per_expert, recv_slot, sources


def _rows(sources: list, xs: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """``[M, H]``: the source row of each expert-major row, zeros for padding."""
    zero = like.new_zeros(like.shape[1])
    rows = [xs[s[0]][s[1]] if s is not None else zero for s in sources]
    return torch.stack(rows) if rows else like.new_zeros(0, like.shape[1])


def _check_case(buffer: Buffer, case: dict, seed: int, dtype: torch.dtype) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    n, h, k, a = case["tokens"](rank), case["hidden"], case["topk"], case["alignment"]
    num_experts = case["experts_per_rank"] * world
    x = torch.randn(n, h, generator=gen).to(dtype)
    x2 = torch.randn(n, h, generator=gen).to(dtype)
    idx = routing(case["routing"], n, k, num_experts, gen)
    w = torch.rand(n, k, generator=gen)
    xs, x2s, idxs, ws = zip(*gather_all((x, x2, idx, w)), strict=False)
    layouts = [expected_layout(list(idxs), num_experts, q, world, a) for q in range(world)]
    tokens_per_expert, recv_slot, sources = layouts[rank]
    num_rows = sum(tokens_per_expert)

    ex, scales, probs, counts, handle, event = buffer.dispatch_experts(x, idx, w, num_experts, expert_alignment=a)
    event.current_stream_wait()
    assert counts == tokens_per_expert and scales is None
    layout = handle.expert_layout
    assert layout.tokens_per_expert == tokens_per_expert and layout.num_rows == num_rows and layout.alignment == a
    assert layout.recv_slot.dtype == torch.int32 and layout.recv_slot.shape == (len(recv_slot), k)
    assert layout.recv_slot.tolist() == recv_slot
    assert ex.dtype == dtype and torch.equal(ex, _rows(sources, list(xs), x))
    ref_probs = [float(ws[s[0]][s[1], s[2]]) if s is not None else 0.0 for s in sources]
    assert probs.dtype == torch.float32 and probs.tolist() == ref_probs

    # cached layout: other rows, same places; no top-k, no probs
    ex2, _, no_probs, counts2, same, _ = buffer.dispatch_experts(x2, handle=handle, expert_alignment=a)
    assert same is handle and counts2 == tokens_per_expert and no_probs is None
    assert torch.equal(ex2, _rows(sources, list(x2s), x))
    _, _, no_probs, _, _, _ = buffer.dispatch_experts(x, idx, None, num_experts, expert_alignment=a)
    assert no_probs is None

    # combine: padding rows hold garbage that must be ignored
    y = torch.randn(num_rows, h, generator=gen).to(dtype)
    expert_weights = torch.rand(num_rows, generator=gen)
    combined, combined_w, _ = buffer.combine_experts(y, handle, expert_weights)
    ref_x, ref_w = _expected_combine(
        rank, n, k, layouts, gather_all((y, expert_weights)), dtype, idx.tolist(), case["experts_per_rank"]
    )
    assert combined.dtype == dtype and torch.equal(combined, ref_x)
    assert torch.equal(combined_w, ref_w)
    combined_only, no_w, _ = buffer.combine_experts(y, handle)
    assert torch.equal(combined_only, ref_x) and no_w is None

    if h % 128 == 0 and dtype == torch.bfloat16:
        _check_fp8(buffer, x, idx, w, num_experts, a, sources, list(xs), handle)


def _expected_combine(
    rank: int,
    n: int,
    k: int,
    layouts: list,
    ys_and_weights: list,
    dtype: torch.dtype,
    topk: list[list[int]],
    local: int,
):
    """Per rank holding token t: its pairs' rows summed over top-k columns ascending (fp32, rounded to ``dtype``);
    then over ranks in summing order (fp32 from 0, rounded). Weight (t, k): the expert weight at the pair's row."""
    h = ys_and_weights[0][0].shape[1]
    parts: list[dict[int, torch.Tensor]] = [{} for _ in range(n)]  # token -> {rank: its rounded partial}
    out_w = torch.zeros(n, k)
    for q, ((_, _, sources), (y, weights)) in enumerate(zip(layouts, ys_and_weights, strict=False)):
        slot_of = {s: row for row, s in enumerate(sources) if s is not None and s[0] == rank}
        for t in range(n):
            part, hit = torch.zeros(h), False
            for j in range(k):
                if (rank, t, j) in slot_of:
                    part += y[slot_of[rank, t, j]].float()
                    out_w[t, j] = weights[slot_of[rank, t, j]]
                    hit = True
            if hit:
                parts[t][q] = part.to(dtype).float()
    out = torch.zeros(n, h)
    for t in range(n):
        for q in summing_order(topk[t], local, len(layouts)):
            if q in parts[t]:
                out[t] = out[t] + parts[t][q]
    return out.to(dtype), out_w


def _check_fp8(buffer: Buffer, x, idx, w, num_experts: int, a: int, sources: list, xs: list, handle) -> None:
    ref = _rows(sources, xs, x)
    pad = torch.tensor([s is None for s in sources], dtype=torch.bool).unsqueeze(1)
    ref_q, ref_s = fp8.quantize(ref)
    ref_q = ref_q.view(torch.uint8).masked_fill(pad, 0)  # padding rows: zero bytes and zero scales
    ref_s = ref_s.masked_fill(pad, 0)
    for round_scale in (False, True):
        q, s, _, _, _, _ = buffer.dispatch_experts(
            x, idx, w, num_experts, expert_alignment=a, fp8_dispatch=True, fp8_out=True, round_scale=round_scale
        )
        rq, rs = fp8.quantize(ref, round_scale=round_scale)
        assert q.dtype == fp8.FP8_DTYPE and torch.equal(q.view(torch.uint8), rq.view(torch.uint8).masked_fill(pad, 0))
        assert torch.equal(s, rs.masked_fill(pad, 0))
    bf, no_scales, _, _, _, _ = buffer.dispatch_experts(x, idx, w, num_experts, expert_alignment=a, fp8_dispatch=True)
    assert no_scales is None and bf.dtype == torch.bfloat16
    assert torch.equal(bf, fp8.dequantize(*fp8.quantize(ref)).masked_fill(pad, 0))
    # FP8 input pairs keep their bytes and scales, also through the cached layout
    for kwargs in (dict(topk_idx=idx, num_experts=num_experts, expert_alignment=a), dict(handle=handle)):
        q, s, _, _, _, _ = buffer.dispatch_experts(fp8.quantize(x), **kwargs)
        assert torch.equal(q.view(torch.uint8), ref_q) and torch.equal(s, ref_s)


def _check_gradients(
    buffer: Buffer, seed: int, fp8_dispatch: bool, alignment: int, probs_use: str, dtype: torch.dtype
) -> None:
    """autograd.dispatch_experts → expert e scales its rows by e + 1 (times the probs when ``probs_use`` is
    ``"used"``; ``"unused"`` leaves them out, ``"none"`` passes no weights) → autograd.combine_experts, against
    every token through every selected expert densely (fp32)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local, k, h = 2, 3, 128
    num_experts = local * world
    gen = torch.Generator().manual_seed(seed * 31 + rank)
    n = 0 if rank == 1 else 5 + 2 * rank
    x = torch.randn(n, h, generator=gen).to(dtype).requires_grad_(True)
    w = torch.rand(n, k, generator=gen).requires_grad_(True)
    idx = routing("random", n, k, num_experts, gen)
    g = torch.randn(n, h, generator=gen)

    expert_x, probs, tokens_per_expert, handle = autograd.dispatch_experts(
        buffer,
        x,
        idx,
        None if probs_use == "none" else w,
        num_experts,
        fp8_dispatch=fp8_dispatch,
        expert_alignment=alignment,
    )
    assert (probs is None) == (probs_use == "none")
    scale = torch.arange(rank * local, (rank + 1) * local, dtype=torch.float32) + 1
    row_scale = scale.repeat_interleave(torch.tensor(tokens_per_expert, dtype=torch.int64))
    if probs_use == "used":
        row_scale = row_scale * probs
    out = autograd.combine_experts(buffer, (expert_x * row_scale.unsqueeze(1)).to(dtype), handle)
    (out.float() * g).sum().backward()

    experts = (torch.arange(num_experts, dtype=torch.float32) + 1).view(-1, 1, 1) * torch.eye(h)
    ref_w = w if probs_use == "used" else torch.ones_like(w)
    ref_out, ref_x_grad, ref_w_grad, _ = dense_reference(x.float(), idx, ref_w, g, experts, fp8_dispatch)
    # The same sums over absolute values bound each element's rounding error: a BF16 path rounds every term a few
    # times (2^-9 each: activations, probs, products, the FP8 round trip) and the sum once, so its error stays a
    # few times below 2^-5 of the sum of the terms' magnitudes (measured: at most 0.66 * 2^-6).
    abs_out, abs_x_grad, abs_w_grad, _ = dense_reference(
        x.float().abs(), idx, ref_w.abs(), g.abs(), experts, fp8_dispatch
    )
    assert out.dtype == dtype and x.grad.dtype == dtype  # BF16 activations: BF16 forward and gradients

    def close(actual: torch.Tensor, expected: torch.Tensor, magnitude: torch.Tensor) -> None:
        tol = magnitude * (1e-5 if dtype == torch.float32 else 2.0**-5) + 1e-6
        error = (actual.float() - expected).abs()
        assert bool((error <= tol).all()), f"max error {float((error - tol).max()):+.3g} over the bound"

    close(out, ref_out, abs_out)
    close(x.grad, ref_x_grad, abs_x_grad)
    if probs_use == "none":
        assert w.grad is None
    else:
        close(w.grad, ref_w_grad if probs_use == "used" else torch.zeros_like(w), abs_w_grad)


def _check_errors(buffer: Buffer) -> None:
    world = dist.get_world_size()
    x = torch.randn(4, 256).bfloat16()
    idx = torch.zeros(4, 2, dtype=torch.int64)
    _, _, _, _, row_handle, _ = buffer.dispatch(x, topk_idx=idx, num_experts=world)
    _, _, _, _, handle, _ = buffer.dispatch_experts(x, idx, None, world, expert_alignment=2)
    rows = handle.expert_layout.num_rows
    bad = [
        (lambda: buffer.dispatch_experts(x), ValueError, "topk_idx"),
        (lambda: buffer.dispatch_experts(x, idx), ValueError, "num_experts"),
        (lambda: buffer.dispatch_experts(x.double(), idx, None, world), TypeError, "x"),
        (lambda: buffer.dispatch_experts(x, idx[:3], None, world), ValueError, "topk_idx"),
        (lambda: buffer.dispatch_experts(x, idx + world, None, world), ValueError, "topk_idx"),
        (
            lambda: buffer.dispatch_experts(x, idx, torch.ones(4, 2, dtype=torch.float64), world),
            TypeError,
            "topk_weights",
        ),
        (lambda: buffer.dispatch_experts(x, idx, None, world, expert_alignment=0), ValueError, "expert_alignment"),
        (lambda: buffer.dispatch_experts(x, idx, None, world, fp8_out=True), ValueError, "fp8_out"),
        (
            lambda: buffer.dispatch_experts(x[:, :100], idx, None, world, fp8_dispatch=True),
            ValueError,
            "multiple of 128",
        ),
        (lambda: buffer.dispatch_experts(x, idx, None, world, config="fast"), TypeError, "config"),
        (lambda: buffer.dispatch_experts(x, handle=row_handle), ValueError, "handle"),
        (lambda: buffer.dispatch_experts(x, handle=handle, expert_alignment=3), ValueError, "expert_alignment"),
        (lambda: buffer.dispatch_experts(x, idx, handle=handle), ValueError, "topk_idx"),
        (lambda: buffer.dispatch_experts(x[:3], handle=handle), ValueError, "x"),
        (lambda: buffer.combine_experts(torch.zeros(rows + 1, 256), handle), ValueError, "y"),
        (lambda: buffer.combine_experts(torch.zeros(rows, 256).double(), handle), TypeError, "y"),
        (
            lambda: buffer.combine_experts(torch.zeros(rows, 256), handle, torch.ones(rows, 1)),
            ValueError,
            "expert_weights",
        ),
        (
            lambda: buffer.combine_experts(torch.zeros(rows, 256), handle, torch.ones(rows).double()),
            TypeError,
            "expert_weights",
        ),
        (lambda: buffer.combine_experts(torch.zeros(rows, 256), row_handle), ValueError, "handle"),
        (lambda: buffer.combine_experts(torch.zeros(rows, 256), "handle"), TypeError, "handle"),
        (lambda: autograd.dispatch_experts(buffer, fp8.quantize(x), idx, None, world), TypeError, "x"),
        (lambda: autograd.combine_experts(object(), torch.zeros(rows, 256), handle), TypeError, "buffer"),
    ]
    for call, exc, needle in bad:
        with pytest.raises(exc, match=needle):
            call()
    dist.barrier()  # every rank is still in step: nothing was half-sent


def _suite(seed: int) -> None:
    buffer = Buffer(transport="torch", timeout_s=60)
    for i, case in enumerate(CASES):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            _check_case(buffer, case, seed + i, dtype)
    for fp8_dispatch, alignment, probs_use, dtype in (
        (False, 1, "used", torch.float32),
        (False, 4, "used", torch.float32),
        (True, 4, "used", torch.float32),
        (True, 1, "unused", torch.float32),
        (False, 2, "none", torch.bfloat16),
        (True, 3, "used", torch.bfloat16),
        (False, 4, "used", torch.float16),  # FP16 rows as BF16 ones (FP8 dispatch takes no FP16)
    ):
        _check_gradients(buffer, seed, fp8_dispatch, alignment, probs_use, dtype)
    _check_errors(buffer)
    # previous_event / async_finish / allocate_on_comm_stream are accepted and harmless on CPU
    idx = torch.zeros(3, 1, dtype=torch.int64)
    ev = Buffer.capture()
    out = buffer.dispatch_experts(
        torch.ones(3, 8),
        idx,
        None,
        dist.get_world_size(),
        previous_event=ev,
        async_finish=True,
        allocate_on_comm_stream=True,
    )
    out[-1].current_stream_wait()
    _, _, done = buffer.combine_experts(out[0], out[4], async_finish=True)
    done.current_stream_wait()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_expert_major_matches_reference(world: int) -> None:
    spawn(_suite, world, args=(int(time.time()) % 1000,), backend="gloo")
