"""Gradients through the row-major dispatch → per-expert linear maps → combine equal a single-process dense reference
(the expert-major autograd is tested in test_expert_major.py)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from support.reference import dense_reference

from moe_ep_plugin import Buffer, autograd
from moe_ep_plugin.launch import spawn
from moe_ep_plugin.ops.routing import routing_map_to_topk

HIDDEN, TOPK, LOCAL = 128, 3, 2


def _inputs(seed: int, rank: int, num_experts: int):
    gen = torch.Generator().manual_seed(seed * 31 + rank)
    n = 0 if rank == 1 else 6 + 3 * rank  # rank 1 has no tokens at all
    x = torch.randn(n, HIDDEN, generator=gen)
    idx = torch.full((n, TOPK), -1, dtype=torch.int64)
    for t in range(n):
        picked = torch.randperm(num_experts, generator=gen)[:TOPK]
        idx[t, : picked.numel()] = picked
    if n:
        idx[0, -1] = -1
    w = torch.rand(n, TOPK, generator=gen)
    g = torch.randn(n, HIDDEN, generator=gen)
    return x, idx, w, g


def _experts(recv_x: torch.Tensor, recv_idx: torch.Tensor, recv_w: torch.Tensor, local_w: torch.Tensor) -> torch.Tensor:
    """Σ_k w[r, k] · (x[r] @ W[idx[r, k]]) over local experts, all received rows at once: the result stays in the
    graph with zero rows too, so every rank joins the backward's collective."""
    valid = (recv_idx >= 0).unsqueeze(2)
    mapped = torch.einsum("nh,nkhd->nkd", recv_x, local_w[recv_idx.clamp_min(0)])
    return (mapped * recv_w.unsqueeze(2) * valid).sum(1)


def _case(seed: int, fp8_dispatch: bool, alignment: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    num_experts = LOCAL * world
    expert_w = torch.randn(num_experts, HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(seed)) / HIDDEN**0.5
    x, idx, w, g = _inputs(seed, rank, num_experts)
    x.requires_grad_(True)
    w.requires_grad_(True)
    local_w = expert_w[rank * LOCAL : (rank + 1) * LOCAL].clone().requires_grad_(True)

    buffer = Buffer(transport="torch", timeout_s=60)
    recv_x, recv_idx, recv_w, counts, handle = autograd.dispatch(
        buffer, x, idx, w, num_experts, fp8_dispatch=fp8_dispatch, expert_alignment=alignment
    )
    assert counts == [-(-int((recv_idx == e).sum()) // alignment) * alignment for e in range(LOCAL)]
    out = autograd.combine(buffer, _experts(recv_x, recv_idx, recv_w, local_w), handle)
    (out * g).sum().backward()

    ref_out, ref_x_grad, ref_w_grad, ref_expert_grad = dense_reference(x, idx, w, g, expert_w, fp8_dispatch)
    tol = dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(x.grad, ref_x_grad, **tol)
    torch.testing.assert_close(w.grad, ref_w_grad, **tol)
    torch.testing.assert_close(local_w.grad, ref_expert_grad[rank * LOCAL : (rank + 1) * LOCAL], **tol)


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


def _routing_map_case(seed: int) -> None:
    """dispatch_experts_from_routing_map equals dispatch_experts of routing_map_to_topk's ids and weights, outputs
    and gradients (x and the [N, E] probs, in the probs' dtype), for tokens with fewer selected experts than top-k,
    a token with none, and a rank with no tokens."""
    rank, world = dist.get_rank(), dist.get_world_size()
    num_experts = 4 * world
    k = 3
    buffer = Buffer(transport="torch", timeout_s=60)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        gen = torch.Generator().manual_seed(seed * 7 + rank)
        n = 0 if rank == 1 else 9
        routing_map = torch.rand(n, num_experts, generator=gen) < 0.4
        if n:
            routing_map[0] = False  # a token with no expert
        scores = torch.rand(n, num_experts, generator=gen).to(dtype)
        g = torch.randn(n, HIDDEN, generator=gen)
        runs = []
        for fused in (True, False):
            x = torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed + rank)).requires_grad_(True)
            probs = scores.clone().requires_grad_(True)
            if fused:
                rows, rows_probs, counts, handle = autograd.dispatch_experts_from_routing_map(
                    buffer, x, routing_map, probs, k, num_experts, expert_alignment=2
                )
            else:
                idx, w = routing_map_to_topk(routing_map, probs, k)
                rows, rows_probs, counts, handle = autograd.dispatch_experts(
                    buffer, x, idx, w, num_experts, expert_alignment=2
                )
            out = autograd.combine_experts(buffer, rows * rows_probs.unsqueeze(1), handle)
            (out * g).sum().backward()
            runs.append((rows, rows_probs, counts, out, x.grad, probs.grad))
        for fused_value, value in zip(*runs, strict=False):
            if isinstance(value, torch.Tensor):
                assert fused_value.dtype == value.dtype, dtype
                torch.testing.assert_close(fused_value, value, rtol=0, atol=0)
            else:
                assert fused_value == value


@pytest.mark.parametrize("world", [1, 2])
def test_dispatch_experts_from_routing_map(world: int) -> None:
    spawn(_routing_map_case, world, args=(int(time.time()) % 1000,), backend="gloo")


def test_dispatch_experts_from_routing_map_validates() -> None:
    with pytest.raises(ValueError, match="routing_map"):
        autograd.dispatch_experts_from_routing_map(
            Buffer.__new__(Buffer), torch.zeros(2, 8), torch.zeros(2, 4), torch.zeros(2, 4), 2, 4
        )
