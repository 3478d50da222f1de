"""``megatron.ncclep_shim`` (megatron-core 0.19.2's ``ncclep`` contract and Megatron-LM main's; 0.16.1 here has no
``ncclep``, so a driver doing what ``_NCCLEPManager`` does calls the functions) on gloo, 1-3 ranks, against a plain
loop: main's eager mode and its static mode's overflow accounting and replay (:func:`_main_contract`), and
packed expert-major ``[C, H]`` rows with alignment, per-row probs, int32 device counts, the unweighted combine
of weighted expert rows, gradients of tokens and weights, zero-copy receive buffers, ``num_local_tokens=None``,
capacity overflow (an error on every rank, or counted drops with ``drop_on_overflow``), and misuse errors."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from support.reference import gather_all, routing

from moe_ep_plugin.launch import spawn

HIDDEN, LOCAL, TOPK = 8, 2, 2


def _layout(idxs, rank: int, alignment: int):
    """Rank ``rank``'s packed rows: per local expert, ``(src, t, k)`` in source order, None padding."""
    rows = []
    for e in range(rank * LOCAL, (rank + 1) * LOCAL):
        block = [
            (s, t, k) for s, idx in enumerate(idxs) for t in range(idx.shape[0]) for k in range(TOPK) if idx[t, k] == e
        ]
        rows += block + [None] * (-len(block) % max(alignment, 1))
    return rows


def _round(shim, seed: int, alignment: int, capacity: int | None, zero_copy: bool, eager: bool = False) -> int:
    """One dispatch/combine (and a second with ``num_local_tokens=None``) against the plain loop; ``eager``: the
    buffer has no capacity and returns exactly the rows received. Returns the rows past the capacity, all ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(seed * 13 + rank)
    n = 2 + (seed + rank) % 6
    x = torch.randn(n, HIDDEN, generator=gen).requires_grad_(True)
    idx = routing("random", n, TOPK, LOCAL * world, gen)
    w = torch.rand(n, TOPK, generator=gen).requires_grad_(True)
    xs, idxs = zip(*gather_all((x.detach(), idx)), strict=True)
    layouts = [_layout(idxs, r, alignment) for r in range(world)]
    max_tokens = 8
    cap = len(layouts[rank]) if eager else capacity or max_tokens * TOPK * world + LOCAL * alignment
    buffer = shim.new_nccl_ep_buffer(TOPK, max_tokens, None if eager else cap, HIDDEN, LOCAL, alignment=alignment)
    recv = shim.alloc_ep_symm_buffer((cap, HIDDEN), torch.float32, dist.group.WORLD) if zero_copy else None
    recv_w = shim.alloc_ep_symm_buffer((cap,), torch.float32, dist.group.WORLD) if zero_copy else None
    rows, tokens_per_expert, probs = shim.nccl_ep_dispatch(
        buffer, x, idx, w, recv_tokens=recv, recv_topk_weights=recv_w
    )
    mine = layouts[rank][:cap]
    assert rows.shape == (cap, HIDDEN) and probs.shape == (cap,) and tokens_per_expert.dtype == torch.int32
    all_w = gather_all(w.detach())
    want = torch.zeros(cap, HIDDEN)
    want_p = torch.zeros(cap)
    for i, r in enumerate(mine):
        if r is not None:
            want[i], want_p[i] = xs[r[0]][r[1]], all_w[r[0]][r[1], r[2]]
    assert torch.equal(rows.detach(), want) and torch.equal(probs.detach(), want_p)
    ends, counts = 0, []
    for e in range(LOCAL):
        real = sum(
            1
            for s, i2 in enumerate(idxs)
            for t in range(i2.shape[0])
            for k in range(TOPK)
            if i2[t, k] == rank * LOCAL + e
        )
        size = real + (-real % max(alignment, 1))
        counts.append(max(0, min(cap, ends + size) - min(cap, ends)))
        ends += size
    assert tokens_per_expert.tolist() == counts
    if zero_copy:
        assert torch.equal(recv, want) and torch.equal(recv_w, want_p)
    # experts: expert e scales by (e + 1), rows weighted by their probs (as Megatron's experts do)
    scale = torch.zeros(cap)
    for i, r in enumerate(mine):
        if r is not None:
            scale[i] = idxs[r[0]][r[1], r[2]] + 1
    expert_out = rows * scale[:, None] * probs[:, None]
    combined = shim.nccl_ep_combine(buffer, expert_out, num_local_tokens=n)
    caps = [len(lay) if eager else cap for lay in layouts]  # each rank's rows (eager: all it received)
    kept = {(r[0], r[1], r[2]) for lay, c in zip(layouts, caps, strict=True) for r in lay[:c] if r is not None}
    x_ref, w_ref = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    expected = 0 * x_ref * w_ref[:, :1]  # zeros on the autograd graph (a token may keep no row)
    for t in range(n):
        for k in range(TOPK):
            if idx[t, k] >= 0 and (rank, t, k) in kept:
                expected[t] = expected[t] + x_ref[t] * (idx[t, k] + 1) * w_ref[t, k]
    torch.testing.assert_close(combined, expected, rtol=1e-6, atol=1e-6)
    g = torch.randn(n, HIDDEN, generator=gen)
    (combined * g).sum().backward()
    (expected * g).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-5, atol=1e-6)
    # num_local_tokens=None: max_tokens_per_rank rows, zero past the dispatched tokens
    again = shim.new_nccl_ep_buffer(TOPK, max_tokens, None if eager else cap, HIDDEN, LOCAL, alignment=alignment)
    shim.nccl_ep_dispatch(again, x.detach(), idx, w.detach())
    padded = shim.nccl_ep_combine(again, expert_out.detach())
    assert padded.shape == (max_tokens, HIDDEN) and bool((padded[n:] == 0).all())
    torch.testing.assert_close(padded[:n], expected.detach(), rtol=1e-6, atol=1e-6)
    return sum(max(0, len(lay) - c) for lay, c in zip(layouts, caps, strict=True))


def _suite(seed: int) -> None:
    from moe_ep_plugin.megatron import ncclep_shim as shim

    world = dist.get_world_size()
    group = dist.group.WORLD
    with pytest.raises(RuntimeError, match="ensure_nccl_ep_bootstrapped"):
        shim.new_nccl_ep_buffer(TOPK, 8, 64, HIDDEN, LOCAL)
    big = 8 * TOPK * world + 8 * LOCAL
    shim.ensure_nccl_ep_bootstrapped(
        group, num_experts=LOCAL * world, max_tokens_per_rank=8, recv_capacity_per_rank=big, hidden_dim=HIDDEN
    )
    for i, (alignment, zero_copy) in enumerate(((0, False), (4, True), (1, False))):
        assert _round(shim, seed + i, alignment, big, zero_copy) == 0
    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        shim.nccl_ep_dispatch(
            shim.new_nccl_ep_buffer(TOPK, 8, big, HIDDEN, LOCAL),
            torch.zeros(9, HIDDEN),
            torch.zeros(9, TOPK, dtype=torch.int64),
            torch.zeros(9, TOPK),
        )
    with pytest.raises(ValueError, match="recv_capacity_per_rank"):
        shim.new_nccl_ep_buffer(TOPK, 8, big + 1, HIDDEN, LOCAL)
    # overflow: every rank sends all its tokens to expert 0 on rank 0 -> rank 0 overflows; the dispatch drops on the
    # device, and the check after the step raises on all ranks naming rank 0 and the key to raise
    shim.nccl_ep_finalize()
    shim.ensure_nccl_ep_bootstrapped(group, LOCAL * world, 8, 3, HIDDEN)
    shim.check_over_budget()  # nothing dropped yet
    idx = torch.zeros(4, TOPK, dtype=torch.int64)
    idx[:, 1] = -1
    shim.nccl_ep_dispatch(
        shim.new_nccl_ep_buffer(TOPK, 8, 3, HIDDEN, LOCAL), torch.ones(4, HIDDEN), idx, torch.ones(4, TOPK)
    )
    over = rf"rank\(s\) \[0\] received \[{4 * world - 3}\] rows more.*raise moe_expert_rank_capacity_factor"
    with pytest.raises(ValueError, match=over):
        shim.check_over_budget()
    shim.check_over_budget()  # the count was reset
    # drop_on_overflow: rows past the capacity dropped and counted, combine leaves them out
    shim.nccl_ep_finalize()
    shim.ensure_nccl_ep_bootstrapped(group, LOCAL * world, 8, None, HIDDEN, num_topk=TOPK, drop_on_overflow=True)
    shim.nccl_ep_finalize()
    small = 3
    shim.ensure_nccl_ep_bootstrapped(group, LOCAL * world, 8, small, HIDDEN, drop_on_overflow=True)
    over = _round(shim, seed + 7, 0, small, False)  # rows past the capacity, summed over the ranks
    dropped = torch.tensor([shim.dropped_rows()])
    dist.all_reduce(dropped)
    assert int(dropped) == 2 * over  # _round dispatches twice
    shim.nccl_ep_finalize()
    shim.nccl_ep_finalize()  # idempotent
    assert shim.dropped_rows() == 0 and not shim.is_nccl_ep_bootstrapped()
    _main_contract(shim, seed)


def _main_contract(shim, seed: int) -> None:
    """Megatron-LM main's ``_NCCLEPManager``: its keyword call with ``num_topk``; eager mode; static mode dropping
    on overflow while the manager accumulates ``over_budget``/``required_recv`` from ``total_recv_tokens``; the
    replay after ``nccl_ep_release_context`` (finalize) with the capacity grown to the peak; MXFP8 refused."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD

    def bootstrap(capacity: int | None) -> None:
        shim.ensure_nccl_ep_bootstrapped(
            group,
            num_experts=LOCAL * world,
            max_tokens_per_rank=8,
            recv_capacity_per_rank=capacity,
            hidden_dim=HIDDEN,
            num_topk=TOPK,
            num_sms=0,
            zero_copy=False,
        )

    def new_buffer(capacity: int | None, **recipes):
        return shim.new_nccl_ep_buffer(
            top_k=TOPK,
            max_tokens_per_rank=8,
            recv_capacity_per_rank=capacity,
            hidden_dim=HIDDEN,
            num_local_experts=LOCAL,
            alignment=0,
            **recipes,
        )

    bootstrap(None)
    assert shim.is_nccl_ep_bootstrapped()
    for i, alignment in enumerate((0, 4, 1)):
        assert _round(shim, seed + 20 + i, alignment, None, False, eager=True) == 0
    with pytest.raises(ValueError, match="dispatch_fwd_quant_recipe: TransformerEngine's quantized"):
        new_buffer(None, dispatch_fwd_quant_recipe=object(), combine_bwd_quant_recipe=None)
    shim.nccl_ep_finalize()  # main's nccl_ep_release_context
    # static: every token to expert 0, so rank 0 needs 4 x world rows and keeps 3; no error, counted drops
    n = 4 if rank < world - 1 or world == 1 else 0  # the last rank sends nothing
    gen = torch.Generator().manual_seed(seed * 5 + rank)
    x, w = torch.randn(n, HIDDEN, generator=gen), torch.rand(n, TOPK, generator=gen)
    idx = torch.full((n, TOPK), -1, dtype=torch.int64)
    idx[:, 0] = 0
    over_budget, required = torch.zeros(1, dtype=torch.bool), torch.zeros(1, dtype=torch.int64)
    capacity = 3
    for replay in (False, True):
        bootstrap(capacity)
        buffer = new_buffer(capacity, dispatch_fwd_quant_recipe=None, combine_bwd_quant_recipe=None)
        rows, _, probs = shim.nccl_ep_dispatch(buffer, x, idx, w)
        over_budget |= buffer.total_recv_tokens > capacity
        torch.maximum(required, buffer.total_recv_tokens, out=required)
        combined = shim.nccl_ep_combine(buffer, rows * probs[:, None], num_local_tokens=n)
        senders = sum(1 if r < world - 1 or world == 1 else 0 for r in range(world))
        assert int(buffer.total_recv_tokens) == (4 * senders if rank == 0 else 0)
        if not replay:  # the manager's check after the step, then the replay at the peak all ranks needed
            assert bool(over_budget) == (rank == 0 and 4 * senders > capacity)
            peak = required.clone()
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            shim.nccl_ep_finalize()
            assert not shim.is_nccl_ep_bootstrapped()
            capacity = int(peak)
    assert torch.equal(combined, x * w[:, :1])  # the replay kept every row
    shim.nccl_ep_finalize()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ncclep_shim_matches_plain_loop(world: int) -> None:
    spawn(_suite, world, args=(int(time.time()) % 1000,), backend="gloo")
