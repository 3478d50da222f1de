"""Gradients through dispatch → per-expert linear maps → combine equal a single-process dense reference."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from moe_ep_plugin import Buffer, autograd, fp8
from moe_ep_plugin.launch import spawn
from moe_ep_plugin.permute import permute, unpermute
from reference import gather_all

HIDDEN, TOPK, LOCAL = 128, 3, 2


def _inputs(seed: int, rank: int, num_experts: int):
    gen = torch.Generator().manual_seed(seed * 31 + rank)
    n = 0 if rank == 1 else 6 + 3 * rank  # rank 1 has no tokens at all
    x = torch.randn(n, HIDDEN, generator=gen)
    idx = torch.full((n, TOPK), -1, dtype=torch.int64)
    for t in range(n):
        picked = torch.randperm(num_experts, generator=gen)[:TOPK]
        idx[t, :picked.numel()] = picked
    if n:
        idx[0, -1] = -1
    w = torch.rand(n, TOPK, generator=gen)
    g = torch.randn(n, HIDDEN, generator=gen)
    return x, idx, w, g


def _dense(x, idx, w, weights, straight_through_fp8: bool):
    """out[t] = Σ_k w[t,k] · (x[t] @ W[idx[t,k]]) — one token at a time."""
    if straight_through_fp8 and x.shape[0]:
        x = x + (fp8.dequantize(*fp8.quantize(x.detach()), torch.float32) - x).detach()
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(HIDDEN)
        for j, e in enumerate(idx[t].tolist()):
            if e >= 0:
                acc = acc + w[t, j] * (x[t] @ weights[e])
        rows.append(acc)
    return torch.stack(rows) if rows else torch.zeros(0, HIDDEN)


def _grad(t: torch.Tensor) -> torch.Tensor:
    """A leaf's gradient; an empty leaf no op touched has none, which means zeros."""
    return t.grad if t.grad is not None else torch.zeros_like(t)


def _case(seed: int, fp8_dispatch: bool, alignment: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    num_experts = LOCAL * world
    expert_w = torch.randn(num_experts, HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(seed)) / HIDDEN ** 0.5
    x, idx, w, g = _inputs(seed, rank, num_experts)
    x.requires_grad_(True)
    w.requires_grad_(True)
    local_w = expert_w[rank * LOCAL:(rank + 1) * LOCAL].clone().requires_grad_(True)

    buffer = Buffer(transport="torch", timeout_s=60)
    recv_x, recv_idx, recv_w, counts, handle = autograd.dispatch(buffer, x, idx, w, num_experts,
                                                                 fp8_dispatch=fp8_dispatch, expert_alignment=alignment)
    px, probs, tokens_per_expert, row_map = permute(recv_x, recv_idx, recv_w, LOCAL, counts, alignment)
    pieces, start = [], 0
    for e, count in enumerate(tokens_per_expert.tolist()):
        pieces.append(px[start:start + count] @ local_w[e])
        start += count
    y = torch.cat(pieces) * probs.unsqueeze(1)
    out = autograd.combine(buffer, unpermute(y, row_map), handle)
    (out * g).sum().backward()

    everyone = gather_all((x.detach(), idx, w.detach(), g))
    ref_w = expert_w.clone().requires_grad_(True)
    leaves, total = [], 0.0
    for rx, ridx, rw, rg in everyone:
        rx, rw = rx.clone().requires_grad_(True), rw.clone().requires_grad_(True)
        ref_out = _dense(rx, ridx, rw, ref_w, fp8_dispatch)
        total = total + (ref_out * rg).sum()
        leaves.append((rx, rw, ref_out))
    total.backward()
    rx, rw, ref_out = leaves[rank]
    tol = dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out, ref_out.detach(), **tol)
    torch.testing.assert_close(x.grad, _grad(rx), **tol)
    torch.testing.assert_close(w.grad, _grad(rw), **tol)
    torch.testing.assert_close(local_w.grad, ref_w.grad[rank * LOCAL:(rank + 1) * LOCAL], **tol)


def _suite(seed: int) -> None:
    for fp8_dispatch in (False, True):
        for alignment in (1, 4):
            _case(seed, fp8_dispatch, alignment)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_gradients_match_dense_reference(world: int) -> None:
    spawn(_suite, world, args=(int(time.time()) % 1000,), backend="gloo")


def test_autograd_rejects_non_buffer() -> None:
    with pytest.raises(TypeError, match="buffer"):
        autograd.dispatch(object(), torch.zeros(1, 8), torch.zeros(1, 1, dtype=torch.int64), None, 1)
    with pytest.raises(TypeError, match="buffer"):
        autograd.combine(object(), torch.zeros(1, 8), None)
