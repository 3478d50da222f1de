"""The hierarchical transport on one GPU: 4 ranks share it as 2 emulated nodes x 2 ranks (gloo group,
``Buffer(device=...)``), the node stage on the nvlink kernels, and — a gloo group cannot carry CUDA tensors —
the rail stage on the nvlink kernels too (``create_transport(..., rail="nvlink")``). Every output is
compared with the CPU hierarchical transport (torch stages over gloo) on the same inputs, which
tests/test_hierarchical.py proves against the plain-loop reference. Skips without a GPU or the kernel library.
Written without a GPU to run it on (2026-12-01): not yet run; the chunked (``Config.hierarchical_chunks``)
checks were added 2026-12-02, also not yet run."""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from support.gpu_marks import NEEDS_KERNELS  # noqa: E402

from moe_ep_plugin import Buffer, Config, autograd  # noqa: E402
from moe_ep_plugin.launch import spawn  # noqa: E402
from moe_ep_plugin.ops import fp8  # noqa: E402
from moe_ep_plugin.transports import create_transport, node_ids, split_by_node  # noqa: E402

pytestmark = NEEDS_KERNELS


def _buffers() -> tuple[Buffer, Buffer]:
    """A Buffer of the shared GPU whose transport is the hierarchical one with both stages on the kernels (built
    by the registry with ``rail="nvlink"``: a gloo group cannot carry the GPU's rows between emulated nodes), and
    the CPU reference."""
    group, device = dist.group.WORLD, torch.device("cuda", 0)
    gpu = Buffer(transport="nvlink", device=device, timeout_s=60)
    gpu.transport.destroy()
    split = split_by_node(group, node_ids(group, 2, device, 60), 60)
    gpu.transport = create_transport("hierarchical", group, device, 60, 0, split, rail="nvlink")
    cpu = Buffer(transport="hierarchical", ranks_per_node=2, timeout_s=60)
    assert type(gpu.transport.intra).__name__ == "NVLinkTransport"
    assert type(gpu.transport.rail).__name__ == "NVLinkTransport"
    return gpu, cpu


def _routing(n: int, k: int, num_experts: int, gen: torch.Generator, kind: str) -> torch.Tensor:
    if kind == "one_node":  # every token on node 0 (experts [0, E/2))
        idx = torch.rand(n, num_experts // 2, generator=gen).argsort(1)[:, :k]
    else:
        idx = torch.rand(n, num_experts, generator=gen).argsort(1)[:, :k]
    return torch.where(torch.rand(n, k, generator=gen) < 0.2, -1, idx)


def _case(gpu: Buffer, cpu: Buffer, seed: int, kind: str, n: int) -> None:
    rank = dist.get_rank()
    h, k, num_experts = 256, 4, 8
    gen = torch.Generator().manual_seed(seed * 13 + rank)
    x = torch.randn(n, h, generator=gen).bfloat16()
    idx = _routing(n, k, num_experts, gen, kind)
    w = torch.rand(n, k, generator=gen)
    dev = torch.device("cuda", 0)
    ref = cpu.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=num_experts, expert_alignment=2)
    got = gpu.dispatch(
        x.to(dev), topk_idx=idx.to(dev), topk_weights=w.to(dev), num_experts=num_experts, expert_alignment=2
    )
    for a, b in zip(got[:3], ref[:3], strict=False):
        assert torch.equal(a.cpu(), b)
    assert got[3] == ref[3]
    assert torch.equal(got[4].recv_src_idx.cpu(), ref[4].recv_src_idx)
    per_rank, per_node, _, _, _ = gpu.get_dispatch_layout(idx.to(dev), num_experts)
    assert torch.equal(per_node.cpu(), cpu.get_dispatch_layout(idx, num_experts)[1])
    # combine: integer-valued rows make every fp32 sum exact, so both transports agree bit for bit
    y = torch.randint(-4, 4, ref[0].shape, generator=gen).bfloat16()
    out, out_w, _ = gpu.combine(y.to(dev), got[4], topk_weights=got[2])
    ref_out, ref_w, _ = cpu.combine(y, ref[4], topk_weights=ref[2])
    assert torch.equal(out.cpu(), ref_out) and torch.equal(out_w.cpu(), ref_w)
    # chunked (some chunks empty on the nvlink kernels): the same rows, handle and sums; the cached replay too
    config = Config(hierarchical_chunks=3)
    chunked = gpu.dispatch(
        x.to(dev),
        topk_idx=idx.to(dev),
        topk_weights=w.to(dev),
        num_experts=num_experts,
        expert_alignment=2,
        config=config,
    )
    for a, b in zip(chunked[:3], ref[:3], strict=False):
        assert torch.equal(a.cpu(), b)
    assert chunked[3] == ref[3] and torch.equal(chunked[4].recv_src_idx.cpu(), ref[4].recv_src_idx)
    assert torch.equal(gpu.dispatch(x.to(dev), handle=chunked[4])[0].cpu(), ref[0])
    chunked_out, chunked_w, _ = gpu.combine(y.to(dev), chunked[4], topk_weights=chunked[2], config=config)
    assert torch.equal(chunked_out.cpu(), ref_out) and torch.equal(chunked_w.cpu(), ref_w)
    # FP8 on the wire, cached dispatch, worst-case sized outputs
    (q, s), *_ = gpu.dispatch(x.to(dev), topk_idx=idx.to(dev), num_experts=num_experts, fp8_dispatch=True, fp8_out=True)
    ref_q, ref_s = fp8.quantize(ref[0])
    assert torch.equal(q.view(torch.uint8).cpu(), ref_q.view(torch.uint8)) and torch.equal(s.cpu(), ref_s)
    again, *_ = gpu.dispatch(x.to(dev), handle=got[4])
    assert torch.equal(again.cpu(), ref[0])
    worst = gpu.dispatch(x.to(dev), topk_idx=idx.to(dev), num_experts=num_experts, num_worst_tokens=64)[0]
    assert worst.shape[0] == 64 and torch.equal(worst[: ref[0].shape[0]].cpu(), ref[0])
    # expert-major and autograd through it
    ex, _, probs, tpe, eh, _ = gpu.dispatch_experts(x.to(dev), idx.to(dev), w.to(dev), num_experts)
    rx, _, rprobs, rtpe, rh, _ = cpu.dispatch_experts(x, idx, w, num_experts)
    assert torch.equal(ex.cpu(), rx) and torch.equal(probs.cpu(), rprobs) and tpe == rtpe
    xg = x.to(dev).float().requires_grad_(True)
    rows, p, counts, handle = autograd.dispatch_experts(gpu, xg, idx.to(dev), w.to(dev), num_experts)
    autograd.combine_experts(gpu, rows * p.unsqueeze(1), handle).sum().backward()
    expected_grad = torch.where(idx >= 0, w, 0.0).sum(1, keepdim=True).expand(n, h)
    torch.testing.assert_close(xg.grad.cpu(), expected_grad, rtol=1e-6, atol=1e-6)


def _suite(seed: int) -> None:
    gpu, cpu = _buffers()
    for i, (kind, n) in enumerate(
        (("random", 7 + dist.get_rank()), ("one_node", 5), ("random", 0 if dist.get_rank() == 1 else 6))
    ):
        _case(gpu, cpu, seed + i, kind, n)
    gpu.destroy()


def test_two_emulated_nodes_on_one_gpu_match_cpu_hierarchical() -> None:
    spawn(_suite, 4, args=(int(time.time()) % 1000,), backend="gloo", timeout_s=300)
