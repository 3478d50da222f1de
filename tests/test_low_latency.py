"""Low-latency mode on the torch transport (gloo, 1-4 ranks) against a plain loop over every rank's tokens:
BF16 rows bit-exact, FP8 bytes and scales equal (float32, and packed UE8M0), ``recv_count``/``src_info``/
``layout_range``, the statistics, combine's weighted fp32 sum, the hook, zero-copy, ``out=``, normal and
low-latency calls alternating on one Buffer, the two-buffer-set rule, bad inputs, and a peer that never arrives."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from support.reference import expected_dispatch, gather_all

from moe_ep_plugin import Buffer
from moe_ep_plugin.launch import spawn
from moe_ep_plugin.ops import fp8

M, H = 6, 512


def _buffer(num_experts: int, timeout_s: float = 30.0, m: int = M, hidden: int = H) -> Buffer:
    world = dist.get_world_size()
    return Buffer(
        None,
        num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(m, hidden, world, num_experts),
        low_latency_mode=True,
        num_qps_per_rank=num_experts // world,
        transport="torch",
        timeout_s=timeout_s,
    )


def _routing(n: int, k: int, num_experts: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct experts per token, about a fifth of the entries -1."""
    idx = torch.rand(n, num_experts, generator=gen).argsort(dim=1)[:, :k]
    return torch.where(torch.rand(n, k, generator=gen) < 0.2, -1, idx)


def _expected_rows(xs, idxs, rank: int, world: int, num_experts: int):
    """Per local expert: the (source rank, source token) of each row, sources ascending then tokens ascending; an
    expert repeated in a token's row gets one row (combine then applies each of its weights)."""
    local = num_experts // world
    rows = [[] for _ in range(local)]
    for s, idx in enumerate(idxs):
        for t in range(idx.shape[0]):
            for e in sorted(set(idx[t].tolist())):
                if e >= 0 and e // local == rank:
                    rows[e % local].append((s, t))
    return rows


def _check_dispatch(
    recv_x, recv_count, handle, xs, idxs, rank, world, num_experts, use_fp8, round_scale, use_ue8m0
) -> list[list[tuple[int, int]]]:
    local = num_experts // world
    expected = _expected_rows(xs, idxs, rank, world, num_experts)
    assert recv_count.tolist() == [len(r) for r in expected]
    src_info, layout_range = handle[0], handle[1]
    assert tuple(handle[2:]) == (M, H, num_experts) and len(handle) == 5
    data, scales = recv_x if use_fp8 else (recv_x, None)
    assert data.shape == (local, world * M, H)
    assert data.dtype == (fp8.FP8_DTYPE if use_fp8 else torch.bfloat16)
    for le, rows in enumerate(expected):
        begin = 0
        for s in range(world):
            count = sum(1 for src, _ in rows if src == s)
            assert int(layout_range[le, s]) == (begin << 32) | count
            begin += count
        for j, (s, t) in enumerate(rows):
            assert int(src_info[le, j]) == t
            row = xs[s][t : t + 1]
            if not use_fp8:
                assert torch.equal(data[le, j].view(torch.int16), row[0].view(torch.int16))
                continue
            q, sc = fp8.quantize(row, round_scale=round_scale)
            assert torch.equal(data[le, j].view(torch.uint8), q[0].view(torch.uint8))
            if use_ue8m0:
                assert scales.dtype == torch.int32 and scales.shape == (local, world * M, H // 512)
                assert torch.equal(scales[le, j], fp8.pack_ue8m0(sc)[0])
            else:
                assert scales.dtype == torch.float32 and scales.shape == (local, world * M, H // 128)
                assert torch.equal(scales[le, j].view(torch.int32), sc[0].view(torch.int32))
    if use_fp8:
        assert scales.stride(1) == 1  # column-major in the last two dims, as DeepEP returns them
    return expected


def _expected_combine(y_all, rows_all, x_idx, w, rank, world, num_experts):
    """combined[t] = Σ_k w[t, k] · y_e[row of (rank, t)] in fp32 (k ascending), then BF16."""
    local = num_experts // world
    out = torch.zeros(x_idx.shape[0], H)
    for t in range(x_idx.shape[0]):
        acc = torch.zeros(H)
        for k, e in enumerate(x_idx[t].tolist()):
            if e < 0:
                continue
            r, le = divmod(e, local)
            j = rows_all[r][le].index((rank, t))
            acc = acc + w[t, k] * y_all[r][le, j].float()
        out[t] = acc
    return out.bfloat16()


def _suite(seed: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    num_experts = 3 * world if world > 1 else 12
    buffer = _buffer(num_experts)
    local = num_experts // world
    options = [(False, False, False), (True, False, False), (True, True, False), (True, True, True)]
    for it, ((use_fp8, round_scale, use_ue8m0), hook) in enumerate((o, h) for o in options for h in (False, True)):
        # Token counts 0..M, rank 0 empty in the first round; top-k up to 9 when there are experts for it.
        n = 0 if it == 0 and rank == 0 else int(torch.randint(0, M + 1, (1,), generator=gen))
        k = min(9, num_experts) if it % 2 else min(3, num_experts)
        x = torch.randn(n, H, generator=gen).bfloat16()
        idx = _routing(n, k, num_experts, gen)
        if it == 3:
            idx[:, 0] = num_experts - 1  # every token to one expert (others -1)
            idx[:, 1:] = -1
        w = torch.rand(n, k, generator=gen)
        xs, idxs = zip(*gather_all((x, idx)), strict=False)
        stats = torch.zeros(local, dtype=torch.int32)
        wait = torch.zeros(world, dtype=torch.int64)
        recv_x, recv_count, handle, event, recv_hook = buffer.low_latency_dispatch(
            x,
            idx,
            M,
            num_experts,
            cumulative_local_expert_recv_stats=stats,
            dispatch_wait_recv_cost_stats=wait,
            use_fp8=use_fp8,
            round_scale=round_scale,
            use_ue8m0=use_ue8m0,
            return_recv_hook=hook,
        )
        event.current_stream_wait()
        assert (recv_hook is not None) == hook
        if hook:
            recv_hook()
        rows = _check_dispatch(
            recv_x, recv_count, handle, xs, idxs, rank, world, num_experts, use_fp8, round_scale, use_ue8m0
        )
        assert stats.tolist() == recv_count.tolist() and bool((wait >= 0).all())

        # Expert stand-in: any BF16 values in the valid rows (garbage elsewhere must not leak into the sum).
        y = torch.randn(local, world * M, H, generator=gen).bfloat16()
        y_all, rows_all = zip(*gather_all((y, rows)), strict=False)
        want = _expected_combine(y_all, rows_all, idx, w, rank, world, num_experts)
        mode = it % 3  # plain, out=, zero-copy
        out = torch.full((n, H), float("nan")).bfloat16() if mode == 1 else None
        if mode == 2:
            buffer.get_next_low_latency_combine_buffer(handle).copy_(y)
        combine_wait = torch.zeros(world, dtype=torch.int64)
        combined, _, combine_hook = buffer.low_latency_combine(
            buffer.get_next_low_latency_combine_buffer(handle) if mode == 2 else y,
            idx,
            w,
            handle,
            zero_copy=mode == 2,
            return_recv_hook=hook,
            out=out,
            combine_wait_recv_cost_stats=combine_wait,
        )
        if hook:
            combine_hook()
        if mode == 1:
            assert combined is out
        assert combined.shape == (n, H) and combined.dtype == torch.bfloat16
        assert torch.equal(combined.view(torch.int16), want.view(torch.int16))

    # Normal mode on the same Buffer between low-latency calls.
    x = torch.randn(4, H, generator=gen).bfloat16()
    idx = _routing(4, 2, num_experts, gen)
    w = torch.rand(4, 2, generator=gen)
    recv, recv_idx, _, counts, nh, _ = buffer.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=num_experts)
    xs, idxs, ws = zip(*gather_all((x, idx, w)), strict=False)
    rows_ref, idx_ref, _, _, counts_ref = expected_dispatch(xs, idxs, ws, num_experts, rank, world)
    assert counts == counts_ref and recv_idx.tolist() == idx_ref
    assert torch.equal(recv, torch.stack(rows_ref) if rows_ref else recv[:0])
    combined, _, _ = buffer.combine(recv, nh)
    recv_x, recv_count, handle, _, _ = buffer.low_latency_dispatch(x, idx, M, num_experts, use_fp8=False)
    _check_dispatch(recv_x, recv_count, handle, xs, idxs, rank, world, num_experts, False, False, False)
    buffer.clean_low_latency_buffer(M, H, num_experts)


def _two_sets() -> None:
    """At most two live results: a third call that would overwrite an un-received one raises on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    num_experts = 2 * world
    buffer = _buffer(num_experts)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(M, H, generator=gen).bfloat16()
    idx = _routing(M, 2, num_experts, gen)
    a = buffer.low_latency_dispatch(x, idx, M, num_experts, use_fp8=False, return_recv_hook=True)
    b = buffer.low_latency_dispatch(x, idx, M, num_experts, return_recv_hook=True)
    with pytest.raises(RuntimeError, match="at most two low-latency results"):
        buffer.low_latency_dispatch(x, idx, M, num_experts)
    b[4]()
    a[4]()
    with pytest.raises(RuntimeError, match="already ran"):
        a[4]()
    xs, idxs = zip(*gather_all((x, idx)), strict=False)
    _check_dispatch(a[0], a[1], a[2], xs, idxs, rank, world, num_experts, False, False, False)
    _check_dispatch(b[0], b[1], b[2], xs, idxs, rank, world, num_experts, True, False, False)
    # A zero-copy buffer handed out belongs to the next call: any other call first is refused.
    buffer.get_next_low_latency_combine_buffer(a[2])
    with pytest.raises(RuntimeError, match="zero-copy combine buffer"):
        buffer.low_latency_dispatch(x, idx, M, num_experts)
    with pytest.raises(RuntimeError, match="zero-copy combine buffer"):
        buffer.low_latency_combine(a[0], idx, torch.ones(M, 2), a[2])
    y = buffer.get_next_low_latency_combine_buffer(a[2])
    y.copy_(a[0])
    combined, _, _ = buffer.low_latency_combine(y, idx, torch.ones(M, 2), a[2], zero_copy=True)
    assert combined.shape == (M, H)
    with pytest.raises(ValueError, match="zero_copy: call get_next_low_latency_combine_buffer"):
        buffer.low_latency_combine(y, idx, torch.ones(M, 2), a[2], zero_copy=True)
    # A hook whose buffers were cleaned has no data left to receive.
    c = buffer.low_latency_dispatch(x, idx, M, num_experts, return_recv_hook=True)
    buffer.clean_low_latency_buffer(M, H, num_experts)
    with pytest.raises(RuntimeError, match="clean_low_latency_buffer ran before"):
        c[4]()
    dist.barrier()


def _errors() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    num_experts = 2 * world
    buffer = _buffer(num_experts)
    x = torch.randn(M, H).bfloat16()
    idx = torch.randint(0, num_experts, (M, 2))  # repeats within a row too
    w = torch.ones(M, 2)
    d = buffer.low_latency_dispatch
    local_errors = [
        (
            lambda: d(torch.randn(M + 1, H).bfloat16(), torch.zeros(M + 1, 1, dtype=torch.int64), M, num_experts),
            ValueError,
            "x: 7 tokens exceed",
        ),
        (lambda: d(x.float(), idx, M, num_experts), TypeError, "x: expected dtype"),
        (lambda: d(x[:, :100].contiguous(), idx, M, num_experts), ValueError, "multiple of 128"),
        (lambda: d(x, idx[:2], M, num_experts), ValueError, "topk_idx: expected shape"),
        (lambda: d(x, idx.float(), M, num_experts), TypeError, "topk_idx: expected dtype"),
        (lambda: d(x, idx, M, 0), ValueError, "num_experts: expected a positive int"),
        (lambda: d(x, idx, 0, num_experts), ValueError, "num_max_dispatch_tokens_per_rank"),
        (lambda: d(x, idx, 64, num_experts), ValueError, "num_rdma_bytes: the buffer has"),
        (lambda: d(x, idx, M, num_experts, use_ue8m0=True), ValueError, "use_ue8m0: packed UE8M0 scales need"),
        (lambda: d(x, idx, M, num_experts, use_fp8=False, round_scale=True), ValueError, "round_scale"),
        (lambda: d(x, idx, M, num_experts, async_finish=True, return_recv_hook=True), ValueError, "async_finish"),
        (
            lambda: d(x, idx, M, num_experts, cumulative_local_expert_recv_stats=torch.zeros(2, dtype=torch.int64)),
            TypeError,
            "cumulative_local_expert_recv_stats",
        ),
        (
            lambda: d(x, idx, M, num_experts, dispatch_wait_recv_cost_stats=torch.zeros(world + 1, dtype=torch.int64)),
            ValueError,
            "dispatch_wait_recv_cost_stats",
        ),
        (lambda: buffer.low_latency_combine(x, idx, w, (None,) * 5), TypeError, "handle"),
    ]
    for call, exc, match in local_errors:
        with pytest.raises(exc, match=match):
            call()
    recv_x, _, handle, _, _ = d(x, idx, M, num_experts, use_fp8=False)
    c = buffer.low_latency_combine
    for call, exc, match in [
        (lambda: c(recv_x, idx, w, handle, use_logfmt=True), ValueError, "use_logfmt"),
        (lambda: c(recv_x[:, :1], idx, w, handle), ValueError, "x: expected shape"),
        (lambda: c(recv_x, idx[:1], w, handle), ValueError, "topk_idx"),
        (lambda: c(recv_x, idx, w[:, :1], handle), ValueError, "topk_weights"),
        (lambda: c(recv_x, idx, w, handle, out=torch.empty(M, H)), TypeError, "out"),
    ]:
        with pytest.raises(exc, match=match):
            call()
    # Only one rank's input is wrong, yet every rank raises the same error, and nothing was sent.
    bad = idx + (num_experts if rank == world - 1 else 0)
    with pytest.raises(
        ValueError,
        match=rf"topk_idx: expert ids must lie in \[-1, {num_experts}\); rank\(s\) "
        rf"\[{world - 1}\]",
    ):
        d(x, bad, M, num_experts)
    if world > 1:
        with pytest.raises(ValueError, match=r"use_fp8: ranks disagree"):
            d(x, idx, M, num_experts, use_fp8=rank == 0)
        with pytest.raises(ValueError, match="ranks are in different low-latency calls"):
            if rank == 0:
                d(x, idx, M, num_experts)
            else:
                c(recv_x, idx, w, handle)
    with pytest.raises(ValueError, match="low_latency_mode"):
        Buffer(transport="torch").low_latency_dispatch(x, idx, M, num_experts)
    with pytest.raises(ValueError, match="num_qps_per_rank"):
        Buffer(transport="torch", low_latency_mode=True, num_qps_per_rank=0)
    # Still in step: a good call after all of the refused ones.
    recv_x, recv_count, handle, _, _ = d(x, idx, M, num_experts, use_fp8=False)
    xs, idxs = zip(*gather_all((x, idx)), strict=False)
    rows = _check_dispatch(recv_x, recv_count, handle, xs, idxs, rank, world, num_experts, False, False, False)
    y_all, rows_all = zip(*gather_all((recv_x, rows)), strict=False)
    combined, _, _ = c(recv_x, idx, w, handle)
    assert torch.equal(combined, _expected_combine(y_all, rows_all, idx, w, rank, world, num_experts))


def _one_rank_bad_input() -> None:
    """Bad input on the last rank only: every rank raises its cause, naming the rank, at once (before, the peers
    waited for the refusing rank until they timed out, never told why); then a good call works."""
    rank, world = dist.get_rank(), dist.get_world_size()
    odd, num_experts = rank == world - 1, 2 * world
    buffer = _buffer(num_experts, timeout_s=60)
    gen = torch.Generator().manual_seed(5 + rank)
    x = torch.randn(4, H, generator=gen).bfloat16()
    idx = _routing(4, 2, num_experts, gen)
    last = rf"rank\(s\) \[{world - 1}\] refused the call \(rank {world - 1}: "
    long_x, long_idx = torch.zeros(M + 1, H).bfloat16(), torch.zeros(M + 1, 2, dtype=torch.int64)
    cases = [
        (
            ValueError,
            lambda: buffer.low_latency_dispatch(long_x if odd else x, long_idx if odd else idx, M, num_experts),
            rf"low_latency_dispatch: {last}x: {M + 1} tokens exceed num_max_dispatch_tokens_per_rank={M}\)",
        ),
        (
            TypeError,
            lambda: buffer.low_latency_dispatch(x.half() if odd else x, idx, M, num_experts),
            rf"low_latency_dispatch: {last}x: expected dtype in \['torch.bfloat16'\], got torch.float16\)",
        ),
        (
            ValueError,
            lambda: buffer.clean_low_latency_buffer(M, H, 0 if odd else num_experts),
            rf"clean_low_latency_buffer: {last}num_experts: expected a positive int, got 0\)",
        ),
    ]
    for error, call, needle in cases:
        start = time.monotonic()
        with pytest.raises(error, match=needle + "; every rank raises, nothing was sent"):
            call()
        assert time.monotonic() - start < 30  # at the header exchange, not by a timeout
    recv_x, recv_count, handle, _, _ = buffer.low_latency_dispatch(x, idx, M, num_experts, use_fp8=False)
    with pytest.raises(TypeError, match=rf"low_latency_combine: {last}topk_weights: expected dtype"):
        buffer.low_latency_combine(recv_x, idx, torch.rand(4, 2).double() if odd else torch.rand(4, 2), handle)
    xs, idxs = zip(*gather_all((x, idx)), strict=False)
    rows = _check_dispatch(recv_x, recv_count, handle, xs, idxs, rank, world, num_experts, False, False, False)
    y_all, rows_all = zip(*gather_all((recv_x, rows)), strict=False)
    w = torch.rand(4, 2, generator=gen)
    combined, _, _ = buffer.low_latency_combine(recv_x, idx, w, handle)
    assert torch.equal(combined, _expected_combine(y_all, rows_all, idx, w, rank, world, num_experts))


@pytest.mark.parametrize("world", [2, 3])
def test_bad_input_on_one_rank_raises_on_every_rank(world: int) -> None:
    spawn(_one_rank_bad_input, world, backend="gloo")


def _absent_peer(timeout_s: float) -> None:
    side = dist.new_group()  # where the absent rank waits until the others timed out (it must not leave earlier)
    buffer = _buffer(4, timeout_s=timeout_s)
    if dist.get_rank() == 1:
        dist.barrier(group=side)  # never joins the dispatch
        return
    x = torch.randn(2, H).bfloat16()
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not complete within"):
        buffer.low_latency_dispatch(x, torch.tensor([[0], [3]]), M, 4)
    assert time.monotonic() - start < timeout_s + 20  # at the timeout, not later (with room for a loaded machine)
    dist.barrier(group=side)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_low_latency_matches_reference(world: int) -> None:
    spawn(_suite, world, args=(int(time.time()) % 1000,), backend="gloo")


@pytest.mark.parametrize("world", [1, 2])
def test_two_buffer_sets(world: int) -> None:
    spawn(_two_sets, world, backend="gloo")


@pytest.mark.parametrize("world", [1, 3])
def test_bad_inputs_raise_before_sending(world: int) -> None:
    spawn(_errors, world, backend="gloo")


def test_size_hint_matches_deepep_formula() -> None:
    # DeepEP V1 for the standard decode shape: two sets of (send, receive, signals) at 128 tokens, 7168, 256 experts.
    dispatch_msg, combine_msg = 16 + 7168 * 2, 56 * 4 + 7168 * 2
    per_set = max(128 * dispatch_msg, 256 * 128 * combine_msg) + 256 * 128 * combine_msg + 1024
    assert Buffer.get_low_latency_rdma_size_hint(128, 7168, 2, 256) == 2 * per_set + 128
    with pytest.raises(ValueError, match="hidden"):
        Buffer.get_low_latency_rdma_size_hint(128, 0, 2, 256)


def test_absent_rank_times_out() -> None:
    spawn(_absent_peer, 2, args=(2.0,), backend="gloo")
