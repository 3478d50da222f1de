"""The CUDA routing-map → top-k kernel of the Megatron dispatcher against a plain loop, on one GPU.

Each token's selected experts must come out in ascending order with their probs, -1 / 0 past them, and the
gradient must reach exactly the selected probs. Skips without a GPU or without the built kernel library.
"""

from __future__ import annotations

import pytest
import torch

from moe_ep_plugin.ops import library

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        torch.cuda.is_available() and library.unavailable_reason() is not None,
        reason=f"kernel library unavailable: {library.unavailable_reason()}",
    ),
]


@pytest.mark.parametrize("tokens,experts,topk", [(4096, 256, 8), (37, 8, 1), (0, 16, 2), (130, 64, 6)])
def test_routing_map_to_topk_kernel_matches_plain_loop(tokens: int, experts: int, topk: int) -> None:
    from moe_ep_plugin.ops.routing import routing_map_to_topk

    device = torch.device("cuda")
    scores = torch.rand(tokens, experts, device=device)
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool, device=device)
    routing_map.scatter_(1, scores.topk(topk, dim=1).indices, True)
    routing_map[::7] = False  # dropped tokens
    if tokens > 3:  # a token with fewer than K selected experts
        routing_map[3] = False
        routing_map[3, : topk - 1] = True
    probs = torch.rand(tokens, experts, device=device, requires_grad=True)
    idx, weights = routing_map_to_topk(routing_map, probs, topk)
    want_idx, want_w = [], []
    for row, p in zip(routing_map.tolist(), probs.tolist(), strict=False):
        chosen = [e for e, on in enumerate(row) if on][:topk]
        want_idx.append(chosen + [-1] * (topk - len(chosen)))
        want_w.append([p[e] for e in chosen] + [0.0] * (topk - len(chosen)))
    assert idx.dtype == torch.int64 and weights.dtype == torch.float32
    assert idx.tolist() == want_idx
    assert weights.tolist() == want_w
    grad_w = torch.randn(tokens, topk, device=device)
    (weights * grad_w).sum().backward()
    want_grad = torch.zeros(tokens, experts)
    for t, (row, g) in enumerate(zip(want_idx, grad_w.tolist(), strict=False)):
        for e, v in zip(row, g, strict=False):
            if e >= 0:
                want_grad[t, e] += v
    assert torch.equal(probs.grad.cpu(), want_grad)
