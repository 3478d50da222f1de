"""Low-latency mode on the peer-memory kernels (``csrc/kernels/low_latency.cuh``) against the torch transport's
collective form on the same inputs: BF16 rows bit-exact, FP8 bytes and scales equal (float32 and packed UE8M0),
recv_count, src_info and layout_range exact, combine bit for bit (both sum weight * row over k ascending in fp32, no
FMA). Also the hook, zero-copy, ``out=``, normal and low-latency calls alternating on one Buffer, CUDA-graph replay of
dispatch -> expert stand-in -> combine on new inputs, a peer that never arrives and one that refuses a call. Skips
without a GPU or the built kernel library.

With two or more GPUs every rank has its own GPU and the reference runs on NCCL; with one GPU, 2, 3 and 4 ranks
share it (gloo group, ``Buffer(device="cuda:0")``) and the reference runs on the CPU. EP1 is the ``local``
transport's one-rank form (gathers, no exchange: graph-capturable) on the GPU against the same form on the CPU.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from support.gpu_marks import GPUS, NEEDS_KERNELS  # noqa: E402
from support.settle import settle  # noqa: E402

from moe_ep_plugin import Buffer  # noqa: E402
from moe_ep_plugin.launch import spawn  # noqa: E402

pytestmark = NEEDS_KERNELS
_RUNS = [(1, "gloo")] + ([(min(GPUS, 8), "nccl")] if GPUS >= 2 else [(r, "gloo") for r in (2, 3, 4)])

# (M, hidden, experts per rank, top-k): DeepEP's standard decode shape first, then small and odd ones.
CASES = [(128, 7168, 32, 8), (16, 2048, 4, 3), (7, 4096, 8, 9), (33, 2560, 2, 1)]
OPTIONS = [(False, False, False), (True, False, False), (True, True, False), (True, True, True)]


def _buffers(m: int, hidden: int, num_experts: int, timeout_s: float = 60.0) -> tuple[Buffer, Buffer]:
    """This rank's kernel buffer and its torch-transport reference (NCCL on GPU, else gloo on the CPU)."""
    world = dist.get_world_size()
    hint = Buffer.get_low_latency_rdma_size_hint(m, hidden, world, num_experts)
    shared = dist.get_backend() != "nccl"
    nv = Buffer(
        dist.group.WORLD,
        num_rdma_bytes=hint,
        low_latency_mode=True,
        transport="nvlink",
        timeout_s=timeout_s,
        device="cuda:0" if shared else None,
    )
    ref = Buffer(dist.group.WORLD, num_rdma_bytes=hint, low_latency_mode=True, transport="torch", timeout_s=timeout_s)
    return nv, ref


def _ref_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _inputs(n: int, hidden: int, k: int, num_experts: int, gen: torch.Generator, device: torch.device):
    x = torch.randn(n, hidden, generator=gen).bfloat16()
    idx = torch.rand(n, num_experts, generator=gen).argsort(dim=1)[:, :k]
    idx = torch.where(torch.rand(n, k, generator=gen) < 0.2, -1, idx)
    w = torch.rand(n, k, generator=gen)
    return x.to(device), idx.to(device), w.to(device)


def _same(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
    a, b = a.cpu(), b.cpu()
    assert a.shape == b.shape and a.dtype == b.dtype, f"{name}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    assert torch.equal(a.contiguous().view(bits), b.contiguous().view(bits)), f"{name} differs"


def _check_dispatch(got: tuple, want: tuple, use_fp8: bool) -> list[int]:
    """Valid rows of every output equal; returns recv_count."""
    (gx, gc, gh), (wx, wc, wh) = got, want
    counts = wc.cpu().tolist()
    _same("recv_count", gc, wc)
    _same("layout_range", gh[1], wh[1])
    g_data, g_scales = gx if use_fp8 else (gx, None)
    w_data, w_scales = wx if use_fp8 else (wx, None)
    for le, c in enumerate(counts):
        _same(f"src_info[{le}]", gh[0][le, :c], wh[0][le, :c])
        _same(f"recv_x[{le}]", g_data[le, :c], w_data[le, :c])
        if use_fp8:
            _same(f"scales[{le}]", g_scales[le, :c], w_scales[le, :c])
    return counts


def _cases() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", 0 if dist.get_backend() != "nccl" else torch.cuda.current_device())
    ref_dev = _ref_device()
    gen = torch.Generator().manual_seed(int(time.time()) % 1000 * 10 + rank)
    for m, hidden, per_rank, k in CASES:
        num_experts = per_rank * world
        k = min(k, num_experts)
        nv, ref = _buffers(m, hidden, num_experts)
        local = num_experts // world
        for it, ((use_fp8, round_scale, use_ue8m0), hook) in enumerate((o, h) for o in OPTIONS for h in (False, True)):
            n = 0 if it == 0 and rank == 0 else int(torch.randint(0, m + 1, (1,), generator=gen))
            x, idx, w = _inputs(n, hidden, k, num_experts, gen, dev)
            opts = dict(use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0)
            stats = torch.zeros(local, dtype=torch.int32, device=dev)
            gx, gc, gh, _, g_hook = nv.low_latency_dispatch(
                x, idx, m, num_experts, return_recv_hook=hook, cumulative_local_expert_recv_stats=stats, **opts
            )
            if hook:
                g_hook()
            wx, wc, wh, _, _ = ref.low_latency_dispatch(x.to(ref_dev), idx.to(ref_dev), m, num_experts, **opts)
            settle(nv)  # a low-latency call never syncs: raise a timed-out receive before comparing
            counts = _check_dispatch((gx, gc, gh), (wx, wc, wh), use_fp8)
            assert stats.cpu().tolist() == counts
            y = torch.randn(local, world * m, hidden, generator=gen).bfloat16()
            mode = it % 3  # plain, out=, zero-copy
            out = torch.empty(n, hidden, dtype=torch.bfloat16, device=dev) if mode == 1 else None
            src = y.to(dev)
            if mode == 2:
                src = nv.get_next_low_latency_combine_buffer(gh)
                src.copy_(y.to(dev))
            got, _, c_hook = nv.low_latency_combine(
                src, idx, w, gh, zero_copy=mode == 2, return_recv_hook=hook, out=out
            )
            if hook:
                c_hook()
            want, _, _ = ref.low_latency_combine(y.to(ref_dev), idx.to(ref_dev), w.to(ref_dev), wh)
            assert out is None or got is out
            settle(nv)  # a low-latency call never syncs: raise a timed-out receive before comparing
            _same("combined", got, want)
        # normal mode on the same Buffer, then low latency again
        x, idx, w = _inputs(m, hidden, k, num_experts, gen, dev)
        recv, _, _, _, handle, _ = nv.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=num_experts)
        nv.combine(recv, handle)
        got = nv.low_latency_dispatch(x, idx, m, num_experts, use_fp8=False)
        want = ref.low_latency_dispatch(x.to(ref_dev), idx.to(ref_dev), m, num_experts, use_fp8=False)
        _check_dispatch(got[:3], want[:3], False)
        torch.cuda.synchronize()
        if rank == 0:
            print(f"ok low-latency M={m} H={hidden} E={num_experts} K={k} on {world} rank(s)", flush=True)
        _graph_replay(nv, ref, m, hidden, num_experts, k, gen, dev, ref_dev)
        nv.destroy()


def _graph_replay(
    nv: Buffer,
    ref: Buffer,
    m: int,
    hidden: int,
    num_experts: int,
    k: int,
    gen: torch.Generator,
    dev: torch.device,
    ref_dev: torch.device,
) -> None:
    """dispatch (FP8) -> expert stand-in (dequantize, times 2) -> combine captured once, replayed on new inputs."""
    x, idx, w = _inputs(m, hidden, k, num_experts, gen, dev)

    def step():
        (q, s), _, handle, _, _ = nv.low_latency_dispatch(x, idx, m, num_experts)
        y = (q.float() * s.repeat_interleave(128, dim=2) * 2).bfloat16()
        return nv.low_latency_combine(y, idx, w, handle)[0]

    step()  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        nx, nidx, nw = _inputs(m, hidden, k, num_experts, gen, dev)
        x.copy_(nx), idx.copy_(nidx), w.copy_(nw)
        graph.replay()
        (q, s), _, handle, _, _ = ref.low_latency_dispatch(nx.to(ref_dev), nidx.to(ref_dev), m, num_experts)
        y = (q.float() * s.repeat_interleave(128, dim=2) * 2).bfloat16()
        want = ref.low_latency_combine(y, nidx.to(ref_dev), nw.to(ref_dev), handle)[0]
        settle(nv)
        _same("graph replay combined", out, want)
    if dist.get_rank() == 0:
        print(f"ok CUDA-graph replay of low-latency dispatch -> stand-in -> combine (M={m})", flush=True)


def _absent_peer(timeout_s: float) -> None:
    """Both ranks lay the buffer out (a clean: the host agreement of M, hidden and experts); then rank 1 misses a
    dispatch, which runs on the kernels alone: rank 0's receive times out naming rank 1."""
    side = dist.new_group(backend="gloo")  # where the absent rank waits until the others timed out
    nv, _ = _buffers(8, 2048, 2 * dist.get_world_size(), timeout_s=timeout_s)
    nv.clean_low_latency_buffer(8, 2048, 2 * dist.get_world_size())
    if dist.get_rank() == 1:
        dist.barrier(group=side)  # never joins
        return
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cuda", 0)
    x = torch.randn(4, 2048, device=dev).bfloat16()
    idx = torch.tensor([[0], [1], [2], [3]], device=dev)
    start = time.monotonic()
    recv_x, _ = nv.low_latency_dispatch(x, idx, 8, 4)[0]  # FP8 rows and scales; the receive spins until the
    with pytest.raises(RuntimeError):  # timeout, records rank 1, traps: the unwritten rows cannot be read as data
        recv_x.float().sum().item()
    with pytest.raises(TimeoutError, match="from rank 1"):
        nv.low_latency_dispatch(x, idx, 8, 4)
    assert time.monotonic() - start < timeout_s + 4
    dist.barrier(group=side)


def _refusing_peer(timeout_s: float) -> None:
    """Rank 1 refuses calls its peer makes. The first dispatch (more than M tokens) and a clean (no experts) lay the
    buffer out, which the ranks agree on over the host: both ranks raise the cause at that call, naming rank 1,
    and the buffer stays usable. A later dispatch (FP16 rows) and a combine (FP16 rows) run on the kernels: rank 1
    raises the cause and takes part without data; rank 0's call returns (no host read) and its next call raises
    the refusal, of the cause's class, naming rank 1 and the call. All well within the timeout, no kernel trapped.
    A first call inside a CUDA-graph capture is refused on every rank (the agreement needs the host)."""
    bad = dist.get_rank() == 1
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cuda", 0)
    m, hidden, num_experts = 8, 2048, 2 * dist.get_world_size()
    x = torch.randn(m, hidden, device=dev).bfloat16()
    idx = torch.arange(m, device=dev).view(m, 1) % num_experts
    w = torch.ones(m, 1, device=dev)
    refused = r"{}: rank\(s\) \[1\] refused the call"
    start = time.monotonic()
    nv, _ = _buffers(m, hidden, num_experts, timeout_s=timeout_s)
    with pytest.raises(ValueError, match=refused.format("low_latency_dispatch") + rf" \(rank 1: x: {m + 1} tokens"):
        nv.low_latency_dispatch(
            torch.cat([x, x[:1]]) if bad else x,
            torch.cat([idx, idx[:1]]) if bad else idx,
            m,
            num_experts,
            use_fp8=False,
        )
    with pytest.raises(ValueError, match=refused.format("clean_low_latency_buffer") + r" \(rank 1: num_experts"):
        nv.clean_low_latency_buffer(m, hidden, 0 if bad else num_experts)
    nv.low_latency_dispatch(x, idx, m, num_experts, use_fp8=False)  # laid out now, and still usable
    if bad:
        with pytest.raises(TypeError, match="x: expected dtype"):
            nv.low_latency_dispatch(x.half(), idx, m, num_experts, use_fp8=False)
    else:
        nv.low_latency_dispatch(x, idx, m, num_experts, use_fp8=False)
        torch.cuda.synchronize(dev)  # no call waits for the GPU: the record is read by a call after the receive ran
        with pytest.raises(TypeError, match=refused.format("low_latency_dispatch")):
            nv.low_latency_dispatch(x, idx, m, num_experts, use_fp8=False)
    torch.cuda.synchronize(dev)
    nv.destroy()

    nv, _ = _buffers(m, hidden, num_experts, timeout_s=timeout_s)
    recv_x, _, handle, _, _ = nv.low_latency_dispatch(x, idx, m, num_experts, use_fp8=False)
    if bad:
        with pytest.raises(TypeError, match="x: expected dtype"):
            nv.low_latency_combine(recv_x.half(), idx, w, handle)
    else:
        nv.low_latency_combine(recv_x, idx, w, handle)
        torch.cuda.synchronize(dev)
        with pytest.raises(TypeError, match=refused.format("low_latency_combine")):
            nv.low_latency_dispatch(x, idx, m, num_experts, use_fp8=False)
    torch.cuda.synchronize(dev)  # no kernel trapped
    nv.destroy()

    nv, _ = _buffers(m, hidden, num_experts, timeout_s=timeout_s)
    with pytest.raises(ValueError, match="cannot be captured in a CUDA graph"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            nv.low_latency_dispatch(x, idx, m, num_experts, use_fp8=False)
    nv.destroy()
    assert time.monotonic() - start < timeout_s


@pytest.mark.parametrize("ranks,backend", _RUNS)
def test_low_latency_kernels_match_torch_form(ranks: int, backend: str) -> None:
    spawn(_cases, ranks, backend=backend, timeout_s=600)


def test_low_latency_peer_that_never_arrives_raises() -> None:
    spawn(_absent_peer, 2, args=(3.0,), backend="nccl" if GPUS >= 2 else "gloo")


def test_low_latency_peer_refusal_raises_on_every_rank() -> None:
    spawn(_refusing_peer, 2, args=(20.0,), backend="nccl" if GPUS >= 2 else "gloo", timeout_s=120.0)
