"""Buffer on the torch transport (gloo, 1–4 ranks) against the plain-loop reference in tests/support/reference.py."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from support.reference import expected_dispatch, gather_all, routing, summing_order

from moe_ep_plugin import Buffer, Config
from moe_ep_plugin.launch import spawn
from moe_ep_plugin.ops import fp8

# (tokens on rank r as a function of r, hidden, top-k, experts, routing) — every case runs on every world size.
CASES = [
    dict(tokens=lambda r: 7 + 5 * r, hidden=256, topk=2, experts_per_rank=2, routing="random"),
    # a rank with 0 tokens
    dict(tokens=lambda r: 0 if r == 0 else 9, hidden=128, topk=8, experts_per_rank=4, routing="random"),
    dict(tokens=lambda r: 6, hidden=40, topk=1, experts_per_rank=3, routing="random"),  # H not a multiple of 128 (BF16)
    # all tokens to expert E-1
    dict(tokens=lambda r: 11 - r, hidden=128, topk=4, experts_per_rank=2, routing="one_expert"),
    # many -1 entries, some rows empty
    dict(tokens=lambda r: 10, hidden=256, topk=3, experts_per_rank=2, routing="sparse"),
]


def _check_dispatch_case(buffer: Buffer, case: dict, seed: int, dtype: torch.dtype) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    n, h, k = case["tokens"](rank), case["hidden"], case["topk"]
    num_experts = case["experts_per_rank"] * world
    local = case["experts_per_rank"]
    x = torch.randn(n, h, generator=gen).to(dtype)
    idx = routing(case["routing"], n, k, num_experts, gen)
    # K = 1 weights made by a transpose: contiguous by torch's rules, yet with a last stride that is not 1
    w = torch.rand(k, n, generator=gen).t() if k == 1 else torch.rand(n, k, generator=gen)
    xs, idxs, ws = zip(*gather_all((x, idx, w)), strict=False)

    # layout
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, num_experts)
    assert per_rdma is None
    ref_in_rank = torch.tensor(
        [[any(e >= 0 and e // local == r for e in row) for r in range(world)] for row in idx.tolist()], dtype=torch.bool
    ).reshape(n, world)
    assert torch.equal(in_rank, ref_in_rank)
    assert per_rank.tolist() == ref_in_rank.sum(0).tolist()
    assert per_expert.tolist() == [int((idx == e).sum()) for e in range(num_experts)]

    # dispatch with the layout, alignment 3
    recv_x, recv_idx, recv_w, counts, handle, event = buffer.dispatch(
        x,
        num_tokens_per_rank=per_rank,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        topk_idx=idx,
        topk_weights=w,
        expert_alignment=3,
    )
    event.current_stream_wait()
    rows, ref_idx, ref_w, ref_src, ref_counts = expected_dispatch(xs, idxs, ws, num_experts, rank, world)
    assert recv_x.shape == (len(rows), h) and recv_x.dtype == dtype
    if rows:
        assert torch.equal(recv_x, torch.stack(rows))
        assert recv_idx.tolist() == ref_idx
        assert recv_w.tolist() == ref_w
        assert handle.recv_src_idx.tolist() == ref_src
    assert counts == [(c + 2) // 3 * 3 for c in ref_counts]
    send_counts = [[int(v) for v in ref_in_rank_r.sum(0)] for ref_in_rank_r in gather_all(ref_in_rank)]
    rpm = torch.tensor(send_counts).cumsum(0)
    assert torch.equal(handle.rank_prefix_matrix.long(), rpm)

    # cached dispatch reproduces the rows without top-k
    again, none_idx, none_w, no_counts, _, _ = buffer.dispatch(x, handle=handle)
    assert torch.equal(again, recv_x) and none_idx is None and none_w is None and no_counts == []

    # worst-case sized outputs: exact prefix, -1 tail, no count list
    worst = sum(c.shape[0] for c in xs) + 1  # > 0 even when no rank has tokens
    wx, widx, ww, wcounts, whandle, _ = buffer.dispatch(
        x, topk_idx=idx, topk_weights=w, num_experts=num_experts, num_worst_tokens=worst
    )
    assert wx.shape[0] == worst, (wx.shape, worst)
    assert wcounts == [], wcounts
    assert torch.equal(wx[: len(rows)], recv_x) and bool((widx[len(rows) :] == -1).all())
    assert torch.equal(widx[: len(rows)], recv_idx) and bool((ww[len(rows) :] == 0).all())

    # combine: every rank transforms its rows by (rank + 1); expected = fp32 from the bias, plus the copies of the
    # receiving ranks in summing order
    y = (recv_x.float() * (rank + 1)).to(dtype)
    bias = torch.randn(n, h, generator=gen).to(dtype)
    combined, combined_w, _ = buffer.combine(y, handle, topk_weights=recv_w, bias=bias)
    expected = bias.float().clone()
    expected_w = torch.zeros(n, k)
    for t, row in enumerate(idx.tolist()):
        for r in summing_order(row, local, world):
            if ref_in_rank[t, r]:
                expected[t] = expected[t] + (x[t].float() * (r + 1)).to(dtype).float()
    for r in range(world):
        mask = ref_in_rank[:, r]
        owned = (idx >= 0) & (idx // local == r)
        expected_w[mask] += torch.where(owned, w, torch.zeros_like(w))[mask]
    expected = expected.to(dtype)
    assert torch.equal(combined, expected)
    assert torch.equal(combined_w, expected_w)
    # combine of worst-sized rows uses only the valid prefix
    wcombined, _, _ = buffer.combine((wx.float() * (rank + 1)).to(dtype), whandle, bias=bias)
    assert torch.equal(wcombined, expected)

    if h % 128 == 0 and dtype == torch.bfloat16:
        _check_fp8(buffer, x, idx, w, num_experts, recv_x, recv_idx)
    if h % 128 == 0 and dtype == torch.float16:  # FP16 rows travel as they are: the send path quantizes no FP16
        with pytest.raises(ValueError, match="x: fp8_dispatch quantizes BF16 or FP32 rows, got float16"):
            buffer.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=num_experts, fp8_dispatch=True)


def _check_fp8(buffer: Buffer, x, idx, w, num_experts, recv_x, recv_idx) -> None:
    # FP8 tuple input: bytes and scales carried unchanged.
    q, s = fp8.quantize(x)
    (rq, rs), ridx, _, _, _, _ = buffer.dispatch((q, s), topk_idx=idx, topk_weights=w, num_experts=num_experts)
    ref_q, ref_s = fp8.quantize(recv_x)
    assert torch.equal(rq.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(rs, ref_s)
    assert torch.equal(ridx, recv_idx)
    # BF16 in, FP8 on the wire: same bytes as the reference quantizer, or BF16 dequantized on receive.
    for round_scale in (False, True):
        (fq, fs), _, _, _, _, _ = buffer.dispatch(
            x,
            topk_idx=idx,
            topk_weights=w,
            num_experts=num_experts,
            fp8_dispatch=True,
            fp8_out=True,
            round_scale=round_scale,
        )
        ref_q, ref_s = fp8.quantize(recv_x, round_scale=round_scale)
        assert torch.equal(fq.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(fs, ref_s)
        bf, _, _, _, _, _ = buffer.dispatch(
            x, topk_idx=idx, topk_weights=w, num_experts=num_experts, fp8_dispatch=True, round_scale=round_scale
        )
        assert bf.dtype == torch.bfloat16 and torch.equal(bf, fp8.dequantize(ref_q, ref_s))


def _suite(seed: int) -> None:
    buffer = Buffer(transport="torch", timeout_s=60)
    assert buffer.transport_name == ("local" if dist.get_world_size() == 1 else "torch")
    for i, case in enumerate(CASES):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            _check_dispatch_case(buffer, case, seed + i, dtype)
    # async_finish / previous_event / allocate_on_comm_stream are accepted and harmless on CPU
    idx = torch.zeros(3, 1, dtype=torch.int64)
    per_rank, _, per_expert, in_rank, ev = buffer.get_dispatch_layout(idx, dist.get_world_size(), async_finish=True)
    with ev:
        pass
    out = buffer.dispatch(
        torch.ones(3, 8),
        topk_idx=idx,
        num_experts=dist.get_world_size(),
        previous_event=ev,
        async_finish=True,
        allocate_on_comm_stream=True,
    )
    out[-1].current_stream_wait()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_dispatch_combine_matches_reference(world: int) -> None:
    spawn(_suite, world, args=(int(time.time()) % 1000,), backend="gloo")


def _errors() -> None:
    buffer = Buffer(transport="torch", timeout_s=30)
    world = dist.get_world_size()
    x = torch.randn(4, 256).bfloat16()
    idx = torch.zeros(4, 2, dtype=torch.int64)
    bad = [
        (lambda: buffer.get_dispatch_layout(idx.float(), world), TypeError, "topk_idx"),
        (lambda: buffer.get_dispatch_layout(idx, world + 1), ValueError, "num_experts") if world > 1 else None,
        (lambda: buffer.dispatch(x, topk_idx=idx - 2, num_experts=2 * world), ValueError, "topk_idx"),
        (lambda: buffer.dispatch_experts(x, topk_idx=idx + 2 * world, num_experts=2 * world), ValueError, "topk_idx"),
        (lambda: buffer.dispatch(x.double(), topk_idx=idx, num_experts=world), TypeError, "x"),
        (lambda: buffer.dispatch(x[0], topk_idx=idx, num_experts=world), ValueError, "x"),
        (lambda: buffer.dispatch(x, topk_idx=idx[:3], num_experts=world), ValueError, "topk_idx"),
        (
            lambda: buffer.dispatch(
                x, topk_idx=idx, topk_weights=torch.ones(4, 2, dtype=torch.float64), num_experts=world
            ),
            TypeError,
            "topk_weights",
        ),
        (lambda: buffer.dispatch(x, topk_idx=idx), ValueError, "num_experts"),
        (
            lambda: buffer.dispatch(x[:, :100], topk_idx=idx, num_experts=world, fp8_dispatch=True),
            ValueError,
            "multiple of 128",
        ),
        (
            lambda: buffer.dispatch(x, topk_idx=idx, num_experts=world, expert_alignment=0),
            ValueError,
            "expert_alignment",
        ),
        (lambda: buffer.dispatch(x, topk_idx=idx, num_experts=world, fp8_out=True), ValueError, "fp8_out"),
        (lambda: buffer.dispatch(x, topk_idx=idx, num_experts=world, config=object()), TypeError, "config"),
        (lambda: buffer.dispatch(x, handle=("not", "a", "handle")), TypeError, "handle"),
        (lambda: buffer.combine(x, handle=None), TypeError, "handle"),
        (lambda: Buffer(transport="carrier-pigeon"), ValueError, "transport"),
        (lambda: Buffer.set_num_sms(3), ValueError, "new_num_sms"),
        (lambda: Config(num_sms=0), ValueError, "num_sms"),
        (lambda: Buffer(low_latency_mode=True, num_qps_per_rank=0), ValueError, "num_qps_per_rank"),
        (lambda: Buffer(low_latency_mode=True, enable_shrink=True), ValueError, "enable_shrink: shrink mode"),
    ]
    for entry in bad:
        if entry is None:
            continue
        call, exc, needle = entry
        with pytest.raises(exc, match=needle):
            call()
    # transport selection: $MOE_EP_TRANSPORT overrides "auto"; nvlink needs CUDA, so on CPU it is a clear error;
    # a group of one rank gets the local transport for every request
    os.environ["MOE_EP_TRANSPORT"] = "torch"
    assert Buffer(transport="auto").transport_name == ("local" if world == 1 else "torch")
    os.environ["MOE_EP_TRANSPORT"] = "nvlink"
    if world == 1:
        assert Buffer(transport="auto").transport_name == "local"
        assert Buffer(transport="hierarchical").transport_name == "local"
    else:
        with pytest.raises(ValueError, match="transport='nvlink' is not usable"):
            Buffer(transport="auto")
        with pytest.raises(ValueError, match="transport='local' serves a group of one rank, got"):
            Buffer(transport="local")
    os.environ["MOE_EP_TRANSPORT"] = "smoke-signals"
    with pytest.raises(ValueError, match="transport must be one of"):
        Buffer()
    del os.environ["MOE_EP_TRANSPORT"]
    # device: checked before any transport is built
    with pytest.raises(TypeError, match="device"):
        Buffer(transport="torch", device=0)
    with pytest.raises(ValueError, match="device"):
        Buffer(transport="torch", device="nowhere")
    with pytest.raises(ValueError, match="device"):
        Buffer(transport="torch", device="meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device: cuda:0 was asked for but CUDA is not available"):
            Buffer(transport="nvlink", device="cuda:0")
    assert Buffer(transport="torch", device="cpu").device == torch.device("cpu")
    # out-of-range ids on one rank only: they ride on the count exchange, so every rank raises, naming that rank
    # (get_dispatch_layout itself leaves them out of its counts rather than pay a host sync to check)
    odd = idx + (2 * world if dist.get_rank() == world - 1 else 0)
    assert buffer.get_dispatch_layout(odd, 2 * world)[2].sum().item() == (0 if dist.get_rank() == world - 1 else 8)
    for call in (buffer.dispatch, buffer.dispatch_experts):
        with pytest.raises(
            ValueError, match=rf"topk_idx: expert ids must lie in \[-1, {2 * world}\); rank\(s\) \[{world - 1}\]"
        ):
            call(x, topk_idx=odd, num_experts=2 * world)
    # a combine with rows that do not match the handle is refused before communicating
    _, _, _, _, handle, _ = buffer.dispatch(x, topk_idx=idx, num_experts=world)
    with pytest.raises(ValueError, match="x"):
        buffer.combine(x[:1], handle)
    dist.barrier()  # every rank is still in step: nothing was half-sent


@pytest.mark.parametrize("world", [1, 2])
def test_bad_inputs_raise_before_communicating(world: int) -> None:
    spawn(_errors, world, backend="gloo")


def _absent_peer(timeout_s: float) -> None:
    rank = dist.get_rank()
    side = dist.new_group()  # where the absent rank waits until the others timed out (it must not leave earlier)
    buffer = Buffer(transport="torch", timeout_s=timeout_s)
    if rank == 1:
        dist.barrier(group=side)  # never joins the dispatch
        return
    x = torch.randn(4, 16)
    idx = torch.tensor([[0], [1], [1], [0]])
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="count exchange"):
        buffer.dispatch(x, topk_idx=idx, num_experts=2)
    assert time.monotonic() - start < timeout_s + 20  # at the timeout, not later (with room for a loaded machine)
    dist.barrier(group=side)


def test_absent_rank_times_out() -> None:
    spawn(_absent_peer, 2, args=(2.0,), backend="gloo")


def _recorded_error_replaces_the_cuda_error() -> None:
    buffer = Buffer(transport="torch", timeout_s=30)
    recorded: list[TimeoutError] = []

    def check_error() -> None:
        if recorded:
            raise recorded[0]

    def trapped(args) -> None:  # a kernel recorded a timeout and trapped: the call's next host read fails
        recorded.append(TimeoutError("rank 0/1: dispatch rows from rank 1 (chunk 0) did not arrive within 30 s"))
        raise RuntimeError("CUDA error: unspecified launch failure")

    buffer.transport.check_error, buffer.transport.dispatch = check_error, trapped
    x, idx = torch.ones(3, 8), torch.zeros(3, 1, dtype=torch.int64)
    with pytest.raises(TimeoutError, match="dispatch rows from rank 1"):
        buffer.dispatch(x, topk_idx=idx, num_experts=1)
    with pytest.raises(TimeoutError, match="dispatch rows from rank 1"):  # every later call, before any work
        buffer.get_dispatch_layout(idx, 1)


def test_a_recorded_kernel_error_replaces_the_cuda_error() -> None:
    """A kernel that records an error traps, so the call's next host read fails with a bare CUDA error: the Buffer
    raises what the kernel recorded instead, and so does every later call."""
    spawn(_recorded_error_replaces_the_cuda_error, 1, backend="gloo")
