"""The hierarchical transport on gloo, nodes emulated with ``ranks_per_node``: 2x2, 3x2, 2x4 and 4x2 (one process
launch per world size). Every output equals a plain loop over tokens of the flat contract; combine equals the
stated two-level sum (per node in fp32, rounded to the rows' dtype, then over nodes in fp32); the bytes sent over
the rail group equal the analytic count and never exceed what the flat torch transport sends."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from support.reference import dense_reference, expected_dispatch, gather_all, routing, summing_order
from test_autograd import _experts
from test_buffer import _check_fp8

from moe_ep_plugin import Buffer, Config, autograd
from moe_ep_plugin.launch import spawn
from moe_ep_plugin.ops import fp8
from moe_ep_plugin.traffic import node_traffic


def _routing(kind: str, n: int, k: int, num_experts: int, num_nodes: int, gen: torch.Generator) -> torch.Tensor:
    """``routing`` kinds plus ``one_node`` (every token's experts on node 0) and ``every_node`` (one expert on
    each node, then random ones)."""
    per_node = num_experts // num_nodes
    if kind == "one_node":
        idx = routing("random", n, min(k, per_node), per_node, gen)
        return torch.cat([idx, torch.full((n, k - idx.shape[1]), -1, dtype=torch.int64)], 1)
    if kind == "every_node":
        first = torch.stack([torch.randint(per_node, (n,), generator=gen) + m * per_node for m in range(num_nodes)], 1)
        return (
            first.reshape(n, num_nodes)[:, :k]
            if k <= num_nodes
            else torch.cat([first, torch.full((n, k - num_nodes), -1, dtype=torch.int64)], 1)
        )
    return routing(kind, n, k, num_experts, gen)


def _source_ranks(handle, rank: int) -> list[int]:
    """Source rank of every received row, from the flat rank prefix matrix."""
    col = [0] + handle.rank_prefix_matrix[:, rank].tolist()
    return [s for s in range(len(col) - 1) for _ in range(col[s + 1] - col[s])]


def _expected_combine(
    ys,
    srcs,
    src_ranks,
    n: int,
    h: int,
    dtype,
    ranks_per_node: int,
    rank: int,
    bias: torch.Tensor | None,
    topk: list[list[int]],
    local: int,
) -> torch.Tensor:
    """The numeric contract, token by token: per node, the rows of the ranks that received the token summed in
    fp32 from 0 in summing order (among the node's ranks) and rounded to ``dtype``; then the node partials in
    summing order (over nodes) in fp32 from the bias (DeepEP V2's hybrid combine)."""
    num_ranks = len(ys)
    num_nodes, per_node = num_ranks // ranks_per_node, local * ranks_per_node  # per_node: experts per node
    out = torch.zeros(n, h)
    for t in range(n):
        acc = bias[t].float().clone() if bias is not None else torch.zeros(h)
        for m in summing_order(topk[t], per_node, num_nodes):
            on_node = [e - m * per_node if 0 <= e - m * per_node < per_node else -1 for e in topk[t]]
            partial, hit = torch.zeros(h), False
            for q in summing_order(on_node, local, ranks_per_node):
                r = m * ranks_per_node + q
                for row, (s, j) in enumerate(zip(src_ranks[r], srcs[r], strict=False)):
                    if s == rank and j == t:
                        partial, hit = partial + ys[r][row].float(), True
            if hit:
                acc = acc + partial.to(dtype).float()
        out[t] = acc
    return out.to(dtype)


CASES = [  # (tokens of rank r, hidden, top-k, experts per rank, routing)
    (lambda r: 5 + 3 * r, 128, 3, 2, "random"),
    (lambda r: 0 if r == 1 else 6, 128, 4, 1, "sparse"),  # a rank with no tokens; many -1
    (lambda r: 4 + r % 3, 128, 2, 2, "one_node"),  # every token to node 0 only
    (lambda r: 3 + r, 128, 8, 2, "every_node"),  # every token reaches every node
    (lambda r: 7 - r % 4, 256, 1, 2, "one_expert"),  # all tokens to expert E-1 (the last node)
]


def _check_case(buffer: Buffer, flat: Buffer, case, seed: int, dtype: torch.dtype, p: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, h, k, local, kind = case
    gen = torch.Generator().manual_seed(seed * 101 + rank)
    n, num_experts, num_nodes = tokens(rank), local * world, world // p
    x = torch.randn(n, h, generator=gen).to(dtype)
    idx = _routing(kind, n, k, num_experts, num_nodes, gen)
    w = torch.rand(n, k, generator=gen)
    xs, idxs, ws = zip(*gather_all((x, idx, w)), strict=False)

    per_rank, per_node, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, num_experts)
    ref_in_rank = torch.tensor(
        [[any(e >= 0 and e // local == r for e in row) for r in range(world)] for row in idx.tolist()], dtype=torch.bool
    ).reshape(n, world)
    assert torch.equal(in_rank, ref_in_rank) and per_rank.tolist() == ref_in_rank.sum(0).tolist()
    assert per_node.dtype == torch.int32
    assert per_node.tolist() == ref_in_rank.view(n, num_nodes, p).any(2).sum(0).tolist()
    assert per_expert.tolist() == [int((idx == e).sum()) for e in range(num_experts)]

    recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
        x,
        num_tokens_per_rank=per_rank,
        num_tokens_per_rdma_rank=per_node,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        topk_idx=idx,
        topk_weights=w,
        expert_alignment=2,
    )
    rows, ref_idx, ref_w, ref_src, ref_counts = expected_dispatch(xs, idxs, ws, num_experts, rank, world)
    assert recv_x.shape == (len(rows), h) and recv_x.dtype == dtype
    assert counts == [(c + 1) // 2 * 2 for c in ref_counts]
    if rows:
        assert torch.equal(recv_x, torch.stack(rows))
        assert recv_idx.tolist() == ref_idx and recv_w.tolist() == ref_w
    assert handle.recv_src_idx.tolist() == ref_src
    sent = torch.stack([r.sum(0) for r in gather_all(ref_in_rank)])
    assert torch.equal(handle.rank_prefix_matrix.long(), sent.cumsum(0))

    again, none_idx, _, no_counts, _, _ = buffer.dispatch(x, handle=handle)
    assert torch.equal(again, recv_x) and none_idx is None and no_counts == []
    worst = sum(c.shape[0] for c in xs) + 1
    wx, widx, ww, wcounts, whandle, _ = buffer.dispatch(
        x, topk_idx=idx, topk_weights=w, num_experts=num_experts, num_worst_tokens=worst
    )
    assert wx.shape[0] == worst and wcounts == [] and torch.equal(wx[: len(rows)], recv_x)
    assert bool((widx[len(rows) :] == -1).all()) and bool((ww[len(rows) :] == 0).all())

    # combine: rank r scales its rows by (r + 1); the two-level sum of the contract, bit for bit
    topk = idx.tolist()
    y = (recv_x.float() * (rank + 1)).to(dtype)
    bias = torch.randn(n, h, generator=gen).to(dtype)
    combined, combined_w, _ = buffer.combine(y, handle, topk_weights=recv_w, bias=bias)
    ys, srcs, src_ranks, rws = zip(
        *gather_all((y, handle.recv_src_idx.tolist(), _source_ranks(handle, rank), recv_w)), strict=False
    )
    assert torch.equal(combined, _expected_combine(ys, srcs, src_ranks, n, h, dtype, p, rank, bias, topk, local))
    expected_w = _expected_combine(rws, srcs, src_ranks, n, k, torch.float32, p, rank, None, topk, local)
    assert torch.equal(combined_w, expected_w)
    assert torch.equal(combined_w, torch.where(idx >= 0, w, 0.0))  # each weight comes back from its one expert
    wcombined, _, _ = buffer.combine((wx.float() * (rank + 1)).to(dtype), whandle, bias=bias)
    assert torch.equal(wcombined, combined)

    # expert-major: identical to the flat torch transport; integer-valued fp32 rows make every sum exact
    ex, _, probs, tpe, ehandle, _ = buffer.dispatch_experts(x, idx, w, num_experts, expert_alignment=4)
    fx, _, fprobs, ftpe, fhandle, _ = flat.dispatch_experts(x, idx, w, num_experts, expert_alignment=4)
    assert torch.equal(ex, fx) and torch.equal(probs, fprobs) and tpe == ftpe
    ey = torch.randint(-8, 8, (ex.shape[0], h), generator=gen).float()
    out, out_w, _ = buffer.combine_experts(ey, ehandle, expert_weights=probs)
    ref, ref_w, _ = flat.combine_experts(ey, fhandle, expert_weights=fprobs)
    assert torch.equal(out, ref) and torch.equal(out_w, ref_w)
    cached, _, none_probs, _, _, _ = buffer.dispatch_experts(x, handle=ehandle)
    assert torch.equal(cached, ex) and none_probs is None

    if dtype == torch.bfloat16:
        _check_fp8(buffer, x, idx, w, num_experts, recv_x, recv_idx)
        _check_fp8_cached(buffer, x, recv_x, handle)
    _check_rail_bytes(buffer, flat, x, idx, w, num_experts, p)


def _check_fp8_cached(buffer: Buffer, x, recv_x, handle) -> None:
    cached, _, _, _, _, _ = buffer.dispatch(x, handle=handle, fp8_dispatch=True)
    assert torch.equal(cached, fp8.dequantize(*fp8.quantize(recv_x)))


def _sent_off_rank(fn, group) -> int:
    """Bytes this rank's ``all_to_all_single`` calls on ``group`` send to other ranks while ``fn`` runs."""
    sent = [0]
    original = dist.all_to_all_single
    me = dist.get_rank(group)

    def counting(out, inp, out_splits=None, in_splits=None, group=None, async_op=False):
        if group is watched:
            row = inp[0].numel() * inp.element_size() if inp.shape[0] else 0
            sent[0] += sum(c for r, c in enumerate(in_splits) if r != me) * row
        return original(out, inp, out_splits, in_splits, group=group, async_op=async_op)

    watched = group
    dist.all_to_all_single = counting
    try:
        fn()
    finally:
        dist.all_to_all_single = original
    return sent[0]


def _check_rail_bytes(buffer: Buffer, flat: Buffer, x, idx, w, num_experts: int, p: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    k = idx.shape[1]
    row_bytes = x.shape[1] * x.element_size() + (2 * k + 1) * 4  # row + top-k ids, source index, weights (int32)
    rail_group = buffer.transport.rail.group
    hier = _sent_off_rank(lambda: buffer.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=num_experts), rail_group)
    flat_sent = _sent_off_rank(
        lambda: flat.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=num_experts), flat.group
    )
    traffic = node_traffic(idx, num_experts, world, p, rank)
    assert hier == traffic.hier_network_rows * row_bytes, (hier, traffic)
    assert flat_sent == (traffic.flat_network_rows + traffic.flat_nvlink_rows) * row_bytes, (flat_sent, traffic)
    assert hier <= flat_sent


def _autograd(buffer: Buffer, seed: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    h, k, local = 128, 3, 2
    num_experts = local * world
    gen = torch.Generator().manual_seed(seed)
    expert_w = torch.randn(num_experts, h, h, generator=gen) / h**0.5
    gen = torch.Generator().manual_seed(seed * 7 + rank)
    n = 0 if rank == world - 1 else 4 + rank
    x = torch.randn(n, h, generator=gen).requires_grad_(True)
    idx = routing("random", n, k, num_experts, gen)
    w = torch.rand(n, k, generator=gen).requires_grad_(True)
    g = torch.randn(n, h, generator=gen)
    local_w = expert_w[rank * local : (rank + 1) * local].clone().requires_grad_(True)
    recv_x, recv_idx, recv_w, _, handle = autograd.dispatch(buffer, x, idx, w, num_experts)
    out = autograd.combine(buffer, _experts(recv_x, recv_idx, recv_w, local_w), handle)
    (out * g).sum().backward()
    ref = dense_reference(x, idx, w, g, expert_w, False)
    got = (out, x.grad, w.grad, local_w.grad)
    want = ref[:3] + (ref[3][rank * local : (rank + 1) * local],)
    for name, a, b in zip(("out", "x.grad", "w.grad", "expert grad"), got, want, strict=False):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def _errors(buffer: Buffer) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    num_experts = 2 * world
    idx = torch.zeros(3, 2, dtype=torch.int64)
    bad = idx.clone()
    if rank == 1:
        bad[0, 0] = num_experts  # out of range on one rank only: every rank raises the same error
    with pytest.raises(ValueError, match=r"topk_idx: expert ids must lie in .*rank\(s\) \[1\]"):
        buffer.dispatch(torch.zeros(3, 128), topk_idx=bad, num_experts=num_experts)
    hidden = 256 if rank == 0 else 128  # ranks that disagree on the hidden size
    with pytest.raises(ValueError, match="disagree on \\['hidden'\\]"):
        buffer.dispatch(torch.zeros(3, hidden), topk_idx=idx, num_experts=num_experts)
    with pytest.raises(ValueError, match="num_experts"):
        buffer.dispatch(torch.zeros(3, 128), topk_idx=idx, num_experts=num_experts + 1)
    # still usable after the errors
    out, *_ = buffer.dispatch(torch.ones(3, 128), topk_idx=idx, num_experts=num_experts)
    assert out.shape[0] == (3 * world if rank == 0 else 0)


def _run_all(buffer: Buffer, x, idx, w, num_experts: int, config: Config) -> dict[str, object]:
    """Every output of the calls a layer makes, by name, with ``config`` on each call: dispatch (and its handle's
    contents), cached dispatch (BF16 and FP8 on the wire), combine with weights and bias, FP8 in the send path (FP8
    out and dequantized), ``num_worst_tokens`` and its combine, expert-major dispatch/combine and their cached
    replay. Tensors compare with ``torch.equal``, the rest with ``==``."""
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    out: dict[str, object] = {}
    recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
        x, topk_idx=idx, topk_weights=w, num_experts=num_experts, expert_alignment=2, config=config
    )
    out.update(
        recv_x=recv_x,
        recv_idx=recv_idx,
        recv_w=recv_w,
        counts=counts,
        prefix=handle.rank_prefix_matrix,
        src=handle.recv_src_idx,
        in_rank=handle.is_token_in_rank,
        send_pos=handle.send_pos,
        sizes=(handle.num_tokens, handle.num_recv_tokens, handle.num_recv_rows),
    )
    out["cached"] = buffer.dispatch(x, handle=handle, config=config)[0]
    # a replay follows the handle's chunks, whatever its own config says
    out["cached_other_config"] = buffer.dispatch(x, handle=handle, config=Config(hierarchical_chunks=5))[0]
    out["cached_fp8"] = buffer.dispatch(x, handle=handle, fp8_dispatch=True, config=config)[0]
    y = (recv_x.float() * (rank + 1)).to(x.dtype)
    bias = torch.randn(x.shape[0], x.shape[1], generator=gen).to(x.dtype)
    out["combined"], out["combined_w"], _ = buffer.combine(y, handle, topk_weights=recv_w, bias=bias, config=config)
    out["combined_other_config"] = buffer.combine(y, handle, bias=bias, config=Config(hierarchical_chunks=5))[0]
    (fq, fs), *_ = buffer.dispatch(
        x, topk_idx=idx, topk_weights=w, num_experts=num_experts, fp8_dispatch=True, fp8_out=True, config=config
    )
    out.update(fp8_rows=fq.view(torch.uint8), fp8_scales=fs)
    out["fp8_dequantized"] = buffer.dispatch(
        x, topk_idx=idx, topk_weights=w, num_experts=num_experts, fp8_dispatch=True, config=config
    )[0]
    worst = recv_x.shape[0] + 3
    wx, widx, _, _, whandle, _ = buffer.dispatch(
        x, topk_idx=idx, topk_weights=w, num_experts=num_experts, num_worst_tokens=worst, config=config
    )
    out.update(worst_x=wx, worst_idx=widx)
    out["worst_combined"] = buffer.combine((wx.float() * (rank + 1)).to(x.dtype), whandle, config=config)[0]
    ex, _, probs, tpe, ehandle, _ = buffer.dispatch_experts(x, idx, w, num_experts, expert_alignment=4, config=config)
    out.update(expert_x=ex, probs=probs, tokens_per_expert=tpe)
    ey = torch.randn(ex.shape[0], x.shape[1], generator=gen).to(x.dtype)
    out["expert_combined"], out["expert_combined_w"], _ = buffer.combine_experts(
        ey, ehandle, expert_weights=probs, config=config
    )
    out["expert_cached"] = buffer.dispatch_experts(x, handle=ehandle, config=config)[0]
    return out


def _check_chunks(buffer: Buffer, case, seed: int) -> None:
    """Every chunk count, 1 to 4 and more chunks than any rank has tokens, gives the unchunked outputs exactly."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, h, k, local, kind = case
    gen = torch.Generator().manual_seed(seed * 101 + rank)
    n, num_experts = tokens(rank), local * world
    x = torch.randn(n, h, generator=gen).to(torch.bfloat16)
    idx = _routing(kind, n, k, num_experts, buffer.transport.num_nodes, gen)
    w = torch.rand(n, k, generator=gen)
    ref = _run_all(buffer, x, idx, w, num_experts, Config())
    most = max(tokens(r) for r in range(world))
    for chunks in (1, 2, 3, 4, most + 2):
        got = _run_all(buffer, x, idx, w, num_experts, Config(hierarchical_chunks=chunks))
        for name, value in ref.items():
            same = torch.equal(got[name], value) if isinstance(value, torch.Tensor) else got[name] == value
            assert same, f"hierarchical_chunks={chunks}: {name} differs from the unchunked path"


def _autograd_chunked(buffer: Buffer, seed: int) -> None:
    """Forward and every gradient through chunked dispatch and combine equal the unchunked ones bit for bit."""
    rank, world = dist.get_rank(), dist.get_world_size()
    h, k, local = 128, 3, 2
    num_experts = local * world
    gen = torch.Generator().manual_seed(seed * 7 + rank)
    n = 0 if rank == 0 else 3 + rank
    x0 = torch.randn(n, h, generator=gen)
    idx = routing("random", n, k, num_experts, gen)
    w0 = torch.rand(n, k, generator=gen)
    g = torch.randn(n, h, generator=gen)
    expert_w0 = torch.randn(local, h, h, generator=gen) / h**0.5
    results = []
    for chunks in (1, 3):
        config = Config(hierarchical_chunks=chunks)
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        expert_w = expert_w0.clone().requires_grad_(True)
        recv_x, recv_idx, recv_w, _, handle = autograd.dispatch(
            buffer, x, idx, w, num_experts, configs=(config, config)
        )
        out = autograd.combine(buffer, _experts(recv_x, recv_idx, recv_w, expert_w), handle, configs=(config, config))
        (out * g).sum().backward()
        results.append((out, x.grad, w.grad, expert_w.grad))
    for name, a, b in zip(("out", "x.grad", "w.grad", "expert grad"), *results, strict=False):
        assert torch.equal(a, b), f"{name}: hierarchical_chunks=3 differs from the unchunked path"


def _chunk_suite(seed: int, layouts: tuple[int, ...]) -> None:
    for p in layouts:
        buffer = Buffer(transport="hierarchical", ranks_per_node=p, timeout_s=60)
        for i, case in enumerate(CASES):
            _check_chunks(buffer, case, seed + i)
        _autograd_chunked(buffer, seed)
        disagreeing = Config(hierarchical_chunks=1 + dist.get_rank() % 2)
        with pytest.raises(ValueError, match=r"disagree on \['Config.hierarchical_chunks'\]"):
            buffer.dispatch(
                torch.zeros(2, 128),
                topk_idx=torch.zeros(2, 1, dtype=torch.int64),
                num_experts=dist.get_world_size(),
                config=disagreeing,
            )


def _suite(seed: int, layouts: tuple[int, ...]) -> None:
    world = dist.get_world_size()
    flat = Buffer(transport="torch", timeout_s=60)
    for p in layouts:
        buffer = Buffer(transport="hierarchical", ranks_per_node=p, timeout_s=60)
        assert buffer.transport_name == "hierarchical" and buffer.transport.num_nodes == world // p
        assert type(buffer.transport.intra).__name__ == "TorchTransport"  # CPU: the torch transport inside nodes
        for i, case in enumerate(CASES):
            for dtype in (torch.bfloat16, torch.float16, torch.float32) if i == 0 else (torch.bfloat16,):
                _check_case(buffer, flat, case, seed + i, dtype, p)
        _autograd(buffer, seed)
        _errors(buffer)
    # auto on CPU stays flat: nvlink cannot serve the nodes
    assert Buffer(transport="auto", ranks_per_node=layouts[0], timeout_s=60).transport_name == "torch"


@pytest.mark.parametrize("world,layouts", [(4, (2,)), (6, (2,)), (8, (4, 2))], ids=["2x2", "3x2", "2x4+4x2"])
def test_hierarchical_matches_flat_contract(world: int, layouts: tuple[int, ...]) -> None:
    spawn(_suite, world, args=(int(time.time()) % 1000, layouts), backend="gloo", timeout_s=600)


@pytest.mark.parametrize("world,layouts", [(4, (2,)), (6, (2,)), (8, (4, 2))], ids=["2x2", "3x2", "2x4+4x2"])
def test_hierarchical_chunks_match_unchunked(world: int, layouts: tuple[int, ...]) -> None:
    spawn(_chunk_suite, world, args=(int(time.time()) % 1000, layouts), backend="gloo", timeout_s=600)


@pytest.mark.parametrize(
    "chunks, error", [(0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError), (None, TypeError)]
)
def test_hierarchical_chunks_validated(chunks, error: type) -> None:
    with pytest.raises(error, match="Config.hierarchical_chunks"):
        Config(hierarchical_chunks=chunks)


def _timeout() -> None:
    side = dist.new_group()  # where the absent rank waits until the others timed out (it must not leave earlier)
    # new_group returns on each rank at its own time: line the ranks up so that no rank's slow start on a loaded
    # machine eats into the short timeout of the Buffer's own set-up exchanges
    dist.barrier(group=side)
    buffer = Buffer(transport="hierarchical", ranks_per_node=2, timeout_s=5)
    if dist.get_rank() == 3:
        dist.barrier(group=side)  # never joins the dispatch
        return
    with pytest.raises(TimeoutError, match=r"hierarchical\] rank \d/4.*count exchange over the whole EP group"):
        buffer.dispatch(torch.ones(2, 128), topk_idx=torch.zeros(2, 1, dtype=torch.int64), num_experts=4)
    dist.barrier(group=side)


def test_stalled_rank_times_out() -> None:
    spawn(_timeout, 4, backend="gloo", timeout_s=60)


def _bad_ranks_per_node() -> None:
    with pytest.raises(ValueError, match="ranks_per_node: 2 does not divide the 3 EP ranks"):
        Buffer(transport="hierarchical", ranks_per_node=2)
    with pytest.raises(ValueError, match="ranks_per_node: expected a positive int"):
        Buffer(transport="hierarchical", ranks_per_node=0)


def test_ranks_per_node_validated() -> None:
    spawn(_bad_ranks_per_node, 3, backend="gloo")


def _disagreeing_layouts() -> None:
    """Ranks that disagree on the node layout raise the same error on every rank, at once (no subgroup is made:
    before, they hung in ``new_group``), and a Buffer made afterwards works."""
    rank = dist.get_rank()
    every = (
        r"rank\(s\) \[3\] differ from rank 0 \(rank 0 ranks_per_node=2, rank 1 ranks_per_node=2, rank 2 "
        r"ranks_per_node=2, rank 3 "
    )
    cases = [
        (dict(ranks_per_node=4 if rank == 3 else 2), every + r"ranks_per_node=4\)"),
        (dict(ranks_per_node=0 if rank == 3 else 2), every + r"ranks_per_node=invalid\)"),
        (dict(ranks_per_node=None if rank == 3 else 2), every + r"LOCAL_WORLD_SIZE=4\)"),
        # nodes started with different --nproc-per-node: torchrun's LOCAL_WORLD_SIZE differs
        (dict(local_world="1" if rank == 3 else "2"), r"rank 2 LOCAL_WORLD_SIZE=2, rank 3 LOCAL_WORLD_SIZE=1\)"),
    ]
    for kwargs, needle in cases:
        saved = os.environ["LOCAL_WORLD_SIZE"]
        os.environ["LOCAL_WORLD_SIZE"] = kwargs.pop("local_world", saved)
        start = time.monotonic()
        try:
            with pytest.raises(ValueError, match="ranks_per_node: the ranks disagree on the node layout: .*" + needle):
                Buffer(transport="hierarchical", timeout_s=60, **kwargs)
        finally:
            os.environ["LOCAL_WORLD_SIZE"] = saved
        assert time.monotonic() - start < 30  # at the exchange, not by a timeout
    for transport in ("torch", "nvlink"):  # one-host transports have no node layout: refused, not ignored
        with pytest.raises(ValueError, match=f"ranks_per_node: only the 'hierarchical' transport .*{transport}"):
            Buffer(transport=transport, ranks_per_node=2)
    _errors(Buffer(transport="hierarchical", ranks_per_node=2, timeout_s=60))


def test_disagreeing_node_layouts_raise_on_every_rank() -> None:
    spawn(_disagreeing_layouts, 4, backend="gloo", timeout_s=120)
