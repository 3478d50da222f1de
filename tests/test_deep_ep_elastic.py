"""``moe_ep_plugin.deep_ep.ElasticBuffer`` / ``EPBuffer`` on gloo (1-4 ranks, and emulated 2x2 nodes on the
hierarchical transport) against a plain loop over tokens, in every combination DeepEP's ``tests/elastic/test_ep.py``
enumerates (handle copy, alignment 128/1, FP8, bias 0/1/2, previous_event, async, allocate_on_comm_stream), each
with expand on/off and CPU sync on/off; EPBuffer with and without ``defer_epilogue``.

Checked bit for bit: dispatched rows, weights and local ids per source (after sorting by the source's global token
index, as DeepEP's test does), the expanded layout (per expert, zero padding of the alignment gaps), per-expert
counts and prefix sums, cached == fresh (with weights carried by the cached expanded dispatch), combine and reduced
(expanded) combine with 0-2 biases, the carried weights' sum, and the capacity-sized outputs of
``do_cpu_sync=False``. Combine inputs are quarters in [-4, 4]: every sum here is exact in BF16, whatever order a
transport adds in.
"""

from __future__ import annotations

import itertools
import time

import pytest
import torch
import torch.distributed as dist
from support.reference import gather_all, routing

from moe_ep_plugin import deep_ep
from moe_ep_plugin.launch import spawn
from moe_ep_plugin.ops import fp8

HIDDEN = 128  # one FP8 block: the smallest hidden FP8 takes


def enumerate_modes():
    """DeepEP's enumeration: (do_handle_copy, expert_alignment, fp8, num_bias, previous_event, async, alloc)."""
    for copy, alignment, use_fp8, num_bias, prev, async_ in itertools.product(
        (1, 0), (128, 1), (1, 0), (0, 1, 2), (0, 1), (0, 1)
    ):
        for alloc in (1,) if prev else (0, 1):
            yield copy, alignment, use_fp8, num_bias, prev, async_, alloc


def _pattern(global_idx: torch.Tensor, salt: torch.Tensor, hidden: int) -> torch.Tensor:
    """BF16 ``[n, hidden]`` rows of quarters in [-4, 4], a function of (token's global index, salt) only: every
    rank can compute what any rank will send back."""
    cols = torch.arange(hidden)
    v = (global_idx.long()[:, None] * 7 + salt.long()[:, None] * 13 + cols[None, :] * 3) % 33 - 16
    return (v.float() / 4).bfloat16()


def _launch(buffer, name: str, prev: int, async_: int, defer: bool, **params):
    if prev:
        params["previous_event"] = buffer.capture()
    if defer:
        out = getattr(buffer, name)(defer_epilogue=True, **params)
        assert isinstance(out, deep_ep.utils.EventOverlap)
        return out.current_stream_wait()
    values = getattr(buffer, name)(**params)
    if async_:
        values[-1].current_stream_wait()
    return values[:-1]


def _reference(xs, idxs, ws, t_max: int, num_experts: int, rank: int, world: int):
    """What ``rank`` receives: non-expanded rows keyed by source global index, and per local expert the expanded
    rows (source global index order)."""
    local = num_experts // world
    rows, expert_rows = [], [[] for _ in range(local)]
    for src, (_x, idx, w) in enumerate(zip(xs, idxs, ws, strict=False)):
        for t in range(idx.shape[0]):
            loc = [e - rank * local if e >= 0 and e // local == rank else -1 for e in idx[t].tolist()]
            if all(e < 0 for e in loc):
                continue
            gidx = src * t_max + t
            wt = [float(w[t, j]) if loc[j] >= 0 else 0.0 for j in range(len(loc))]
            rows.append((gidx, t, src, loc, wt))
            for j, e in enumerate(loc):
                if e >= 0:
                    expert_rows[e].append((gidx, t, src, float(w[t, j])))
    return rows, expert_rows


def _dst_rows(idxs, rank: int, local: int, num_experts: int) -> list[list[int]]:
    """For each (token, k) of ``rank``: the row its token lands in on the destination rank (rows arrive by source
    rank, then token), -1 where the id names no expert."""

    def goes(s: int, t: int, r: int) -> bool:
        return any(0 <= e < num_experts and e // local == r for e in idxs[s][t].tolist())

    out = []
    for t, ids in enumerate(idxs[rank].tolist()):
        row = []
        for e in ids:
            if not 0 <= e < num_experts:
                row.append(-1)
                continue
            r = e // local
            before = sum(goes(s, u, r) for s in range(rank) for u in range(idxs[s].shape[0]))
            row.append(before + sum(goes(rank, u, r) for u in range(t)))
        out.append(row)
    return out


def _rows_of(x, t):
    """Row(s) ``t`` (an index or index tensor) of a tensor or FP8 pair."""
    return (x[0][t], x[1][t]) if isinstance(x, tuple) else x[t]


def _equal_rows(got, want_list) -> None:
    if isinstance(got, tuple):
        q = torch.stack([w[0] for w in want_list]) if want_list else got[0][:0]
        s = torch.stack([w[1] for w in want_list]) if want_list else got[1][:0]
        assert torch.equal(got[0].view(torch.uint8), q.view(torch.uint8)) and torch.equal(got[1], s)
    else:
        want = torch.stack(want_list) if want_list else got[:0]
        assert torch.equal(got, want)


def _prefix(v, n: int):
    return tuple(t[:n] for t in v) if isinstance(v, tuple) else v[:n]


def _case(
    buffer, world: int, rank: int, mode: tuple, cpu_sync: bool, defer: bool, seed: int, cls_reference: bool
) -> None:
    copy, alignment, use_fp8, num_bias, prev, async_, alloc = mode
    gen = torch.Generator().manual_seed(seed * 7919 + rank)
    local = 2 + seed % 2
    num_experts, topk, t_max = local * world, 3, 12
    n = (seed + 3 * rank) % (t_max + 1) if seed % 5 else 0  # some rounds send nothing from some ranks
    kind = ("random", "sparse", "one_expert")[seed % 3]
    idx = routing(kind, n, topk, num_experts, gen)
    w = torch.rand(n, topk, generator=gen).masked_fill(idx < 0, 0.0)
    x = torch.randn(n, HIDDEN, generator=gen).bfloat16()
    x_in = fp8.quantize(x) if use_fp8 else x
    biases = tuple(_pattern(torch.arange(n), torch.full((n,), 50 + b), HIDDEN) for b in range(num_bias))
    bias = None if num_bias == 0 else biases[0] if num_bias == 1 else biases
    xs, idxs, ws = zip(*gather_all((x, idx, w)), strict=False)  # FP8 tensors do not pickle: quantized again here
    xs = [fp8.quantize(v) for v in xs] if use_fp8 else xs
    rows, expert_rows = _reference(xs, idxs, ws, t_max, num_experts, rank, world)
    stream = dict(async_with_compute_stream=bool(async_), allocate_on_comm_stream=bool(alloc))
    common = dict(
        num_experts=num_experts,
        num_max_tokens_per_rank=t_max,
        expert_alignment=alignment,
        do_cpu_sync=cpu_sync,
        do_handle_copy=bool(copy),
        **stream,
    )

    # ---- non-expanded dispatch ----
    stats = torch.zeros(local, dtype=torch.int32)
    recv_x, recv_idx, recv_w, handle = _launch(
        buffer,
        "dispatch",
        prev,
        async_,
        defer,
        x=x_in,
        topk_idx=idx,
        topk_weights=w,
        cumulative_local_expert_recv_stats=stats,
        **common,
    )
    num_recv = len(rows)
    capacity = num_recv if cpu_sync else world * t_max
    assert int(handle.psum_num_recv_tokens_per_scaleup_rank[-1]) == num_recv and handle.num_recv_tokens == capacity
    assert recv_idx.shape[0] == capacity and recv_w.shape == (capacity, topk)
    meta = handle.recv_src_metadata
    order = torch.sort(meta[:num_recv, 0]).indices
    assert meta[:num_recv, 0][order].tolist() == [r[0] for r in rows]
    assert meta[:num_recv, 1][order].tolist() == [r[2] for r in rows]
    assert bool((meta[num_recv:] == -1).all()) and bool((meta[:, 2:] == -1).all())
    _equal_rows(_rows_of(_prefix(recv_x, num_recv), order), [_rows_of(xs[r[2]], r[1]) for r in rows])
    assert recv_idx[:num_recv][order].tolist() == [r[3] for r in rows]
    assert recv_w[:num_recv][order].tolist() == [r[4] for r in rows]
    assert bool((recv_idx[num_recv:] == -1).all()) and bool((recv_w[num_recv:] == 0).all())
    real = [len(expert_rows[e]) for e in range(local)]
    aligned = [(c + alignment - 1) // alignment * alignment for c in real]
    assert handle.num_recv_tokens_per_expert_list == (aligned if cpu_sync else [])
    assert handle.psum_num_recv_tokens_per_expert.tolist() == torch.tensor(aligned).cumsum(0).tolist()
    assert stats.tolist() == real
    assert (handle.topk_idx is idx) == (not copy) and torch.equal(handle.topk_idx, idx)
    slots = handle.dst_buffer_slot_idx
    assert slots.dtype == torch.int32 and slots.tolist() == _dst_rows(idxs, rank, local, num_experts)

    # ---- expanded dispatch ----
    e_x, e_idx, e_w, e_handle = _launch(
        buffer,
        "dispatch",
        prev,
        async_,
        defer,
        x=x_in,
        topk_idx=idx,
        topk_weights=w,
        do_expand=True,
        use_tma_aligned_col_major_sf=True,
        **common,
    )
    assert e_idx is None and e_w.dim() == 1
    assert int(e_handle.psum_num_recv_tokens_per_scaleup_rank[-1]) == num_recv
    starts = [sum(aligned[:e]) for e in range(local)]
    # without a CPU sync DeepEP V2's worst case: every rank's most tokens on min(K, L) experts, each block's padding
    worst = world * t_max * min(topk, local) + local * (alignment - 1)
    num_expanded = sum(aligned) if cpu_sync else (worst + alignment - 1) // alignment * alignment
    assert e_handle.num_expanded_tokens == num_expanded
    assert e_handle.num_recv_tokens == (num_recv if cpu_sync else world * t_max)
    assert e_handle.recv_src_metadata.shape[0] == e_handle.num_recv_tokens
    assert e_handle.num_unaligned_recv_tokens_per_expert.tolist() == real
    assert e_handle.psum_num_recv_tokens_per_expert.tolist() == [s + c for s, c in zip(starts, real, strict=False)]
    assert e_handle.num_recv_tokens_per_expert_list == (aligned if cpu_sync else [])
    e_rows = e_x[0].shape[0] if isinstance(e_x, tuple) else e_x.shape[0]
    assert e_rows == num_expanded and e_w.shape == (num_expanded,)
    if isinstance(e_x, tuple):
        assert e_x[1].stride(0) == 1  # column-major scales (use_tma_aligned_col_major_sf)
    slots = e_handle.recv_src_metadata[:num_recv, 2:]
    src_of_slot = torch.full((e_rows,), -1, dtype=torch.int64)
    valid = slots >= 0
    src_of_slot[slots[valid].long()] = e_handle.recv_src_metadata[:num_recv, 0:1].expand_as(slots)[valid].long()
    for e in range(local):
        block = torch.arange(starts[e], starts[e] + real[e])
        key = src_of_slot[block]
        block = block[torch.sort(key).indices]
        assert src_of_slot[block].tolist() == [r[0] for r in expert_rows[e]]
        _equal_rows(_rows_of(e_x, block), [_rows_of(xs[r[2]], r[1]) for r in expert_rows[e]])
        assert e_w[block].tolist() == [r[3] for r in expert_rows[e]]
    pad = torch.ones(e_rows, dtype=torch.bool)
    for e in range(local):
        pad[starts[e] : starts[e] + real[e]] = False
    data = e_x[0].view(torch.uint8) if isinstance(e_x, tuple) else e_x
    assert bool((data[pad] == 0).all()) and bool((e_w[pad] == 0).all())  # alignment gaps and capacity tail
    if isinstance(e_x, tuple):
        assert bool((e_x[1][pad] == 0).all())

    # ---- cached dispatches == fresh ----
    cached_x, cached_idx, cached_w, cached_handle = _launch(
        buffer, "dispatch", prev, async_, defer, x=x_in, handle=handle, **stream
    )
    assert cached_handle is handle and cached_w is None and torch.equal(cached_idx, recv_idx)
    _equal_rows(cached_x, list(recv_x) if not isinstance(recv_x, tuple) else list(zip(*recv_x, strict=False)))
    ce_x, _, ce_w, _ = _launch(
        buffer,
        "dispatch",
        prev,
        async_,
        defer,
        x=x_in,
        handle=e_handle,
        topk_weights=w,
        do_expand=True,
        do_zero_padding=True,
        use_tma_aligned_col_major_sf=True,
        **stream,
    )
    _equal_rows(ce_x, list(e_x) if not isinstance(e_x, tuple) else list(zip(*e_x, strict=False)))
    assert torch.equal(ce_w, e_w)
    cw = _launch(buffer, "dispatch", prev, async_, defer, x=x_in, handle=handle, topk_weights=w, **stream)[2]
    assert torch.equal(cw, recv_w)

    # ---- combine (rows not weighted; weights carried and summed) ----
    my_gidx = rank * t_max + torch.arange(n)
    receivers = [sorted({e // local for e in idx[t].tolist() if e >= 0}) for t in range(n)]
    src_gidx = meta[:, 0].clamp(min=0)
    y = _pattern(src_gidx, torch.full_like(src_gidx, rank), HIDDEN)
    y[num_recv:] = 0
    combined, combined_w = _launch(
        buffer, "combine", prev, async_, defer, x=y, handle=handle, topk_weights=recv_w, bias=bias, **stream
    )
    expected = torch.zeros(n, HIDDEN)
    for t in range(n):
        for r in receivers[t]:
            expected[t] += _pattern(my_gidx[t : t + 1], torch.tensor([r]), HIDDEN)[0].float()
    for b in biases:
        expected += b.float()
    assert torch.equal(combined, expected.bfloat16())
    assert torch.equal(combined_w, w)

    # ---- reduced (expanded) combine ----
    ey = torch.zeros(e_rows, HIDDEN, dtype=torch.bfloat16)
    slot_expert = torch.full((e_rows,), -1, dtype=torch.int64)
    for e in range(local):
        slot_expert[starts[e] : starts[e] + real[e]] = e + rank * local
    hit = src_of_slot >= 0
    ey[hit] = _pattern(src_of_slot[hit], 100 + slot_expert[hit], HIDDEN)
    reduced, reduced_w = _launch(
        buffer, "combine", prev, async_, defer, x=ey, handle=e_handle, topk_weights=e_w, bias=bias, **stream
    )
    expected = torch.zeros(n, HIDDEN)
    for t in range(n):
        for e in idx[t].tolist():
            if e >= 0:
                expected[t] += _pattern(my_gidx[t : t + 1], torch.tensor([100 + e]), HIDDEN)[0].float()
    for b in biases:
        expected += b.float()
    assert torch.equal(reduced, expected.bfloat16())
    assert torch.equal(reduced_w, w)


def _suite(seed: int, transport: str, ranks_per_node, which: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    kw = dict(
        transport=transport,
        ranks_per_node=ranks_per_node,
        num_max_tokens_per_rank=12,
        hidden=HIDDEN,
        num_topk=3,
        explicitly_destroy=True,
        num_cpu_timeout_secs=60,
    )
    elastic = deep_ep.ElasticBuffer(dist.group.WORLD, **kw)
    if ranks_per_node:
        assert elastic.get_logical_domain_size() == (world // ranks_per_node, ranks_per_node)
    sms = elastic.get_theoretical_num_sms(4 * world, 3)
    assert sms % 2 == 0 and sms >= 2
    modes = list(enumerate_modes())
    count = 0
    if which == "elastic":
        for i, mode in enumerate(modes):
            for cpu_sync in (True, False):
                _case(elastic, world, rank, mode, cpu_sync, False, seed + 2 * i + cpu_sync, True)
                count += 1
    else:
        ep = deep_ep.EPBuffer(dist.group.WORLD, **kw)
        for i, mode in enumerate(m for m in modes if m[0] == 0):
            for cpu_sync, defer in ((True, False), (False, True)):
                _case(ep, world, rank, mode, cpu_sync, defer, seed + 3 * i + cpu_sync, False)
                count += 1
        ep.destroy()
    elastic.destroy()
    assert count > 0


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_elastic_buffer_matches_reference(world: int) -> None:
    spawn(_suite, world, args=(int(time.time()) % 1000, "torch", None, "elastic"), backend="gloo")


def test_elastic_buffer_hierarchical_2x2() -> None:
    spawn(_suite, 4, args=(int(time.time()) % 1000, "hierarchical", 2, "elastic"), backend="gloo")


@pytest.mark.parametrize("world", [1, 3])
def test_ep_buffer_matches_reference(world: int) -> None:
    spawn(_suite, world, args=(int(time.time()) % 1000, "torch", None, "ep"), backend="gloo")


def _bias_and_inference_mode() -> None:
    """Two ranks, every token to expert 0 (rank 0) and expert 2 (rank 1), expanded. The reduced combine adds the
    bias in the fp32 sum over ranks and rounds once: rows 1 (rank 0) and 2^-9 (rank 1) plus a bias of 2^-8 give
    bf16(1 + 3 * 2^-9) = 1 + 2^-7, where rounding the rows' sum before adding the bias would give 1. Under
    ``torch.inference_mode()`` (DeepEP's test loop) a handle keeps ``topk_idx`` by reference without a version."""
    rank = dist.get_rank()
    buffer = deep_ep.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=4, hidden=HIDDEN, transport="torch")
    with torch.inference_mode():
        x = torch.ones(4, HIDDEN, dtype=torch.bfloat16)
        idx = torch.tensor([[0, 2]] * 4)  # an inference tensor: no version counter
        e_x, _, _, handle, _ = buffer.dispatch(x, topk_idx=idx, num_experts=4, do_expand=True, do_handle_copy=False)
        assert handle.topk_idx is idx
        y = torch.zeros_like(e_x)
        y[: handle.num_expanded_tokens] = 1.0 if rank == 0 else 2.0**-9
        bias = torch.full((4, HIDDEN), 2.0**-8, dtype=torch.bfloat16)
        combined = buffer.combine(y, handle, bias=bias)[0]
    assert bool((combined == 1 + 2.0**-7).all()), combined[:, 0].tolist()


def test_expanded_combine_bias_and_inference_mode() -> None:
    spawn(_bias_and_inference_mode, 2, backend="gloo")


def _errors() -> None:
    world = dist.get_world_size()
    group = dist.group.WORLD
    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=4, hidden=HIDDEN, transport="torch")
    x = torch.zeros(4, HIDDEN, dtype=torch.bfloat16)
    idx = torch.zeros(4, 2, dtype=torch.int64)
    ok = dict(topk_idx=idx, num_experts=2 * world)
    _, _, _, handle, _ = buffer.dispatch(x, **ok)
    cases = [
        (
            lambda: buffer.dispatch(
                torch.zeros(5, HIDDEN, dtype=torch.bfloat16), topk_idx=torch.zeros(5, 2).long(), num_experts=2 * world
            ),
            "num_max_tokens_per_rank",
        ),
        (lambda: buffer.dispatch(x, handle=handle, topk_idx=idx), "topk_idx"),
        (lambda: buffer.dispatch(x, handle=handle, do_expand=True), "do_expand"),
        (lambda: buffer.dispatch(x, handle=handle, do_cpu_sync=True), "do_cpu_sync"),
        (lambda: buffer.dispatch(x, handle=handle, expert_alignment=4), "expert_alignment"),
        (lambda: buffer.dispatch(x, do_zero_padding=True, **ok), "do_zero_padding"),
        (lambda: buffer.dispatch(x, topk_idx=idx), "num_experts"),
        (lambda: buffer.dispatch(x, num_max_tokens_per_rank=0, **ok), "num_max_tokens_per_rank"),
        (lambda: buffer.dispatch(x, num_sms=3, **ok), "num_sms: expected a positive even int"),
        (lambda: buffer.combine(torch.zeros(handle.num_recv_tokens + 1, HIDDEN, dtype=torch.bfloat16), handle), "x"),
        (lambda: buffer.combine(x, "handle"), "handle"),
        (lambda: buffer.destroy(), "explicitly_destroy"),
        (lambda: deep_ep.ElasticBuffer(group, num_cpu_bytes=2 << 20, transport="torch"), "num_cpu_bytes"),
        (
            lambda: deep_ep.EPBuffer(group, lb_allocation_plan_or_num_bytes=1, transport="torch"),
            "lb_allocation_plan_or_num_bytes",
        ),
        (
            lambda: (
                buffer.get_theoretical_num_sms(2 * world + 1, 2) if world > 1 else buffer.get_theoretical_num_sms(0, 2)
            ),
            "num_experts",
        ),
    ]
    for fn, name in cases:
        with pytest.raises((ValueError, TypeError), match=name):
            fn()
    ep = deep_ep.EPBuffer(group, num_max_tokens_per_rank=4, hidden=HIDDEN, transport="torch")
    with pytest.raises(ValueError, match="do_handle_copy"):
        ep.dispatch(x, do_handle_copy=True, **ok)
    mine = idx.clone()
    _, _, _, ep_handle, _ = ep.dispatch(x, topk_idx=mine, num_experts=2 * world)
    assert ep_handle.topk_idx is mine
    mine[0, 0] = 1  # DeepEP 2.5 keeps topk_idx by reference: a later use of the handle must notice
    with pytest.raises(ValueError, match="modified"):
        ep.combine(torch.zeros(ep_handle.num_recv_tokens, HIDDEN, dtype=torch.bfloat16), ep_handle)
    with pytest.raises(ValueError, match="another buffer"):
        ep.combine(x, handle)
    single = deep_ep.ElasticBuffer(
        group, num_max_tokens_per_rank=4, hidden=HIDDEN, transport="torch", allow_multiple_reduction=False
    )
    e_x, _, _, e_handle, _ = single.dispatch(x, do_expand=True, **ok)
    with pytest.raises(ValueError, match="allow_multiple_reduction"):
        single.combine(torch.zeros_like(e_x), e_handle)
    plain = single.dispatch(x, **ok)[3]  # non-expanded rows, reduced by the caller: one reduction, served
    single.combine(torch.zeros(plain.num_recv_tokens, HIDDEN, dtype=torch.bfloat16), plain)


def test_errors_name_the_argument() -> None:
    spawn(_errors, 2, backend="gloo")


@pytest.mark.parametrize("num_topk", [1, 3, 8])
@pytest.mark.parametrize("num_tokens", [0, 1, 7])
def test_weights_packed_for_dispatch_come_back_exact(num_tokens: int, num_topk: int) -> None:
    """The cached dispatch carries float32 weights as BF16 pairs: unpacked, every weight is back bit for bit, 0 where
    the id is -1; also for a rank with no tokens and one expert per token (a ``[0, 1]`` tensor, whose last stride
    may be 0)."""
    from moe_ep_plugin.deep_ep import layout

    weights = torch.rand(num_tokens, num_topk) + 0.5
    idx = torch.randint(0, 8, (num_tokens, num_topk))
    idx[torch.rand(num_tokens, num_topk) < 0.2] = -1
    packed = layout.pack_weights(weights)
    assert packed.dtype == torch.bfloat16 and packed.shape[0] == num_tokens and packed.shape[1] % 8 == 0
    want = torch.tensor(
        [[0.0 if idx[t, k] < 0 else weights[t, k].item() for k in range(num_topk)] for t in range(num_tokens)]
    ).reshape(num_tokens, num_topk)
    assert torch.equal(layout.unpack_weights(packed, num_topk, idx, None), want)
