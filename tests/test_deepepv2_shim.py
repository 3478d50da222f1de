"""``megatron.deepepv2_shim`` (Megatron-LM dev's ``deepepv2`` contract; the installed megatron-core has no
``deepepv2``, so a driver doing what ``_DeepepV2Manager`` does calls the three functions) on gloo, 1-3 ranks,
against a plain loop: the dispatched rows, local ids, probabilities and per-expert counts, the unweighted combine
of weighted expert rows, gradients of tokens and probabilities (Megatron's ``DeepepV2Dispatch``/``Combine``
autograd), with uneven token counts over ranks and ranks without tokens; the shared buffer kept when the token
count changes and re-made for wider rows; FP8 dispatch from the plugin options; FP16 tokens (moved as they are, the
combine summed in fp32); misuse errors."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from support.reference import expected_dispatch, gather_all, routing

from moe_ep_plugin.launch import spawn

HIDDEN, LOCAL, TOPK = 128, 2, 2


def _manager_round(shim, x, idx, probs, num_experts: int):
    """``_DeepepV2Manager.dispatch`` / the experts / ``_DeepepV2Manager.combine``: expert ``e`` scales its rows by
    ``e + 1`` and weights them by their probability, and each received token's rows are summed over the local
    experts (as Megatron's unpermute does)."""
    group = dist.group.WORLD
    buffer = shim.get_elastic_buffer(
        group, num_max_tokens_per_rank=x.shape[0], hidden=x.shape[1], num_topk=idx.shape[1]
    )
    recv_x, recv_idx, recv_probs, tokens_per_expert, handle = shim.deepepv2_dispatch(
        buffer, x, idx, probs, num_experts, num_max_tokens_per_rank=x.shape[0], expert_alignment=1, num_sms=0
    )
    first = dist.get_rank() * (num_experts // dist.get_world_size())
    scale = ((recv_idx + first + 1) * (recv_idx >= 0)).to(recv_probs.dtype)
    rows = (recv_x * (scale * recv_probs).sum(1, keepdim=True)).to(x.dtype)  # the experts' output in x's dtype
    combined, _ = shim.deepepv2_combine(buffer, rows, handle, num_sms=0)
    return buffer, (recv_x, recv_idx, recv_probs, tokens_per_expert), combined


def _round(shim, seed: int, tokens: tuple[int, ...], kind: str, fp8: bool, dtype: torch.dtype = torch.float32) -> None:
    """One round with ``tokens[rank % len(tokens)]`` tokens of ``dtype`` on each rank (Megatron passes each rank's
    own count as ``num_max_tokens_per_rank``, 0 included)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    n = tokens[rank % len(tokens)]
    num_experts = LOCAL * world
    gen = torch.Generator().manual_seed(seed * 13 + rank)
    x = torch.randn(n, HIDDEN, generator=gen).to(dtype).requires_grad_(True)
    idx = routing(kind, n, TOPK, num_experts, gen)
    probs = torch.rand(n, TOPK, generator=gen).requires_grad_(True)
    xs, idxs, ws = zip(*gather_all((x.detach(), idx, probs.detach())), strict=True)
    _, (recv_x, recv_idx, recv_probs, counts), combined = _manager_round(shim, x, idx, probs, num_experts)
    rows, want_idx, want_w, _, want_counts = expected_dispatch(xs, idxs, ws, num_experts, rank, world)
    want_x = torch.stack(rows) if rows else torch.zeros(0, HIDDEN, dtype=dtype)
    # FP8 on the wire: the rows are exactly the quantizer's round trip of the sent rows
    assert torch.equal(recv_x.detach(), recv_ref_x(want_x) if fp8 else want_x)
    assert recv_idx.tolist() == want_idx and counts.tolist() == want_counts and counts.dtype == torch.int64
    assert torch.equal(recv_probs.detach() * (recv_idx >= 0), torch.tensor(want_w).reshape(-1, TOPK))
    # reference: on each rank the token's row times sum((e + 1) w[t, k]) over that rank's experts (in x's dtype, as
    # the experts return it), summed over ranks in fp32 and rounded once; -1 adds nothing
    x_ref = (recv_ref_x(x.detach()) if fp8 else x.detach()).requires_grad_(True)
    p_ref = probs.detach().clone().requires_grad_(True)
    expected = 0 * x_ref.float() + 0 * p_ref.sum()  # both have a gradient, also on a rank without tokens
    for t in range(n):
        for r in range(world):
            cols = [k for k in range(TOPK) if idx[t, k] >= 0 and idx[t, k] // LOCAL == r]
            if cols:
                weight = sum((idx[t, k] + 1) * p_ref[t, k] for k in cols)
                expected[t] = expected[t] + (x_ref[t] * weight).to(dtype).float()
    expected = expected.to(dtype)
    assert combined.dtype == dtype
    if dtype == torch.float16:  # fp32 holds every fp16 sum of a few ranks exactly: one rounding, as the loop's
        assert torch.equal(combined, expected)
    else:  # float32: only the order of the sums over experts and ranks differs from the loop
        torch.testing.assert_close(combined, expected, rtol=1e-5, atol=1e-5)
    g = torch.randn(n, HIDDEN, generator=gen).to(dtype)
    (combined * g).sum().backward()
    (expected * g).sum().backward()
    assert x.grad.dtype == dtype
    _close(x.grad, x_ref.grad, dtype)  # FP8: the gradient passes straight
    _close(probs.grad, p_ref.grad, dtype)


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Gradients: float32 within 1e-5 relative to the largest value; float16 within four units in its last place
    (the backward rounds to fp16 where the forward did, in another order)."""
    scale = max(float(expected.abs().max()), 1.0) if expected.numel() else 1.0
    step = 1e-5 if dtype == torch.float32 else 4 * 2.0**-11
    torch.testing.assert_close(actual, expected, rtol=0, atol=step * scale)


def recv_ref_x(x: torch.Tensor) -> torch.Tensor:
    """``x`` through the FP8 quantizer and back (the rows the experts see with FP8 dispatch)."""
    from moe_ep_plugin.ops import fp8

    return fp8.dequantize(*fp8.quantize(x), dtype=x.dtype)


def _suite(seed: int) -> None:
    from moe_ep_plugin.megatron import deepep_shim
    from moe_ep_plugin.megatron import deepepv2_shim as shim
    from moe_ep_plugin.megatron.options import PluginOptions

    shim.reset_elastic_buffer()
    deepep_shim.configure(PluginOptions(transport="torch"))
    try:
        rounds = (
            ((4,), "random"),
            ((6,), "sparse"),
            ((6,), "one_expert"),
            ((9,), "random"),
            ((3, 7, 5), "random"),
            ((0, 5), "random"),
            ((5, 0, 2), "one_expert"),
        )
        for i, (tokens, kind) in enumerate(rounds):
            _round(shim, seed + i, tokens, kind, fp8=False)
        first = shim.get_elastic_buffer(dist.group.WORLD, 9, HIDDEN, TOPK)
        # the size does not grow with the tokens (ranks passing different counts decide alike): kept
        assert shim.get_elastic_buffer(dist.group.WORLD, 5 + 20 * dist.get_rank(), HIDDEN, TOPK) is first
        assert shim.get_elastic_buffer(dist.group.WORLD, 9, 16 * HIDDEN, TOPK) is not first  # wider rows: re-made
        deepep_shim.configure(PluginOptions(transport="torch", fp8_dispatch=True))
        _round(shim, seed + 9, (5, 0), "random", fp8=True)
        deepep_shim.configure(PluginOptions(transport="torch"))
        _round(shim, seed + 10, (6, 0, 3), "random", fp8=False, dtype=torch.float16)  # FP16 rows as they are
        buffer = shim.get_elastic_buffer(dist.group.WORLD, 4, HIDDEN, TOPK)
        x, idx = torch.zeros(4, HIDDEN), torch.zeros(4, TOPK, dtype=torch.int64)
        with pytest.raises(TypeError, match="token_probs"):
            shim.deepepv2_dispatch(buffer, x, idx, torch.zeros(4, TOPK, dtype=torch.bfloat16), LOCAL * 1, 4)
        with pytest.raises(TypeError, match="buffer"):
            shim.deepepv2_dispatch(object(), x, idx, torch.zeros(4, TOPK), LOCAL, 4)
        with pytest.raises(TypeError, match="handle"):
            shim.deepepv2_combine(buffer, x, object())
        with pytest.raises(TypeError, match="group"):
            shim.get_elastic_buffer(object(), 4, HIDDEN, TOPK)
    finally:
        deepep_shim.configure(PluginOptions())
        shim.reset_elastic_buffer()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_deepepv2_shim_matches_plain_loop(world: int) -> None:
    spawn(_suite, world, args=(int(time.time()) % 1000,), backend="gloo")
