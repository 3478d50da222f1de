"""The ``flex`` shims' forms a CUDA graph may hold read nothing on the host: ``hybrid_ep_dispatch``/``_combine`` with
``num_permuted_tokens``, ``nccl_ep_dispatch``/``_combine`` in static mode and ``deepepv2_dispatch``/``_combine`` with
``do_cpu_sync=False``, forward and backward, and ``ElasticBuffer``'s expanded dispatch without a CPU sync (fresh,
cached with weights, combine), on the ``local`` transport (one gloo rank) with every tensor-to-Python conversion
patched to raise; and their results equal the counted forms' (rows, probs, counts, output and gradients) where every
row fits the budget."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from support.host_reads import no_host_reads  # noqa: E402

from moe_ep_plugin.launch import spawn  # noqa: E402

EXPERTS, TOPK, HIDDEN, TOKENS = 4, 2, 16, 6


def _routing(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [T, H]``, ``routing_map [T, E]`` (top-k of random scores, one token routed nowhere) and dense fp32
    ``probs [T, E]`` (zero off the map)."""
    x = torch.randn(TOKENS, HIDDEN, generator=gen)
    scores = torch.rand(TOKENS, EXPERTS, generator=gen)
    routing_map = torch.zeros(TOKENS, EXPERTS, dtype=torch.bool).scatter_(1, scores.topk(TOPK, 1).indices, True)
    routing_map[0] = False
    probs = torch.where(routing_map, torch.rand(TOKENS, EXPERTS, generator=gen) + 0.1, 0.0)
    return x, routing_map, probs


def _hybridep(x, routing_map, probs, budget: int | None, checked: bool):
    """Dispatch, an expert scaling each row by its prob, combine, backward of ones → results and gradients."""
    from moe_ep_plugin.megatron import hybridep_shim as shim

    x, probs = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
    with no_host_reads() if checked else _nothing():
        rows, row_probs, _, counts, handle = shim.hybrid_ep_dispatch(
            x, routing_map, probs, dist.group.WORLD, EXPERTS, num_permuted_tokens=budget, pad_multiple=4
        )
        out = shim.hybrid_ep_combine(rows * row_probs.unsqueeze(1), handle, budget, 4)
        out.sum().backward()
    return rows.detach(), row_probs.detach(), counts, handle[-1], out.detach(), x.grad, probs.grad


def _ncclep(x, routing_map, probs, capacity: int | None, checked: bool):
    from moe_ep_plugin.megatron import ncclep_shim as shim

    shim.nccl_ep_finalize()
    shim.ensure_nccl_ep_bootstrapped(dist.group.WORLD, EXPERTS, TOKENS, capacity, HIDDEN, drop_on_overflow=True)
    weights, idx = probs.topk(TOPK, 1)
    idx = torch.where(weights > 0, idx, -1)
    x, weights = x.clone().requires_grad_(True), weights.clone().requires_grad_(True)
    with no_host_reads() if checked else _nothing():
        buffer = shim.new_nccl_ep_buffer(TOPK, TOKENS, capacity, HIDDEN, EXPERTS, alignment=4)
        rows, counts, row_probs = shim.nccl_ep_dispatch(buffer, x, idx, weights)
        out = shim.nccl_ep_combine(buffer, rows * row_probs.unsqueeze(1), TOKENS)
        out.sum().backward()
        total = buffer.total_recv_tokens
    shim.nccl_ep_finalize()
    return rows.detach(), row_probs.detach(), counts, total, out.detach(), x.grad, weights.grad


def _deepepv2(x, routing_map, probs, cpu_sync: bool, tokens_bound: int = TOKENS):
    """``_DeepepV2Manager``'s calls (top-k ids -1 off the map), each received row scaled by its probabilities' sum as
    the experts and Megatron's unpermute would, combine, backward of ones → results and gradients."""
    from moe_ep_plugin.megatron import deepepv2_shim as shim

    weights, idx = probs.topk(TOPK, 1)
    idx = torch.where(weights > 0, idx, -1)
    x, weights = x.clone().requires_grad_(True), weights.clone().requires_grad_(True)
    buffer = shim.get_elastic_buffer(dist.group.WORLD, TOKENS, HIDDEN, TOPK)  # made outside the guard, as Megatron
    with _nothing() if cpu_sync else no_host_reads():
        rows, recv_idx, recv_probs, counts, handle = shim.deepepv2_dispatch(
            buffer, x, idx, weights, EXPERTS, tokens_bound, expert_alignment=4, do_cpu_sync=cpu_sync
        )
        out, _ = shim.deepepv2_combine(buffer, rows * recv_probs.sum(1, keepdim=True), handle)
        out.sum().backward()
    return rows.detach(), recv_idx, recv_probs.detach(), counts, out.detach(), x.grad, weights.grad


def _elastic_expanded(x, routing_map, probs, cpu_sync: bool):
    """``ElasticBuffer``'s expanded dispatch, its cached dispatch carrying the weights, and the reduced combine
    (rows scaled by their probs) → rows, probs, cached rows and probs, handle counts, output."""
    from moe_ep_plugin import deep_ep

    weights, idx = probs.topk(TOPK, 1)
    idx = torch.where(weights > 0, idx, -1)
    buffer = deep_ep.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=TOKENS, hidden=HIDDEN, transport="local")
    with _nothing() if cpu_sync else no_host_reads():
        rows, _, row_probs, handle, _ = buffer.dispatch(
            x.bfloat16(),
            topk_idx=idx,
            topk_weights=weights,
            num_experts=EXPERTS,
            expert_alignment=4,
            do_expand=True,
            do_cpu_sync=cpu_sync,
        )
        cached, _, cached_probs, _, _ = buffer.dispatch(
            x.bfloat16(), handle=handle, topk_weights=weights, do_expand=True
        )
        out, out_w, _ = buffer.combine((rows.float() * row_probs[:, None]).bfloat16(), handle, topk_weights=row_probs)
    counts = (handle.psum_num_recv_tokens_per_expert, handle.num_unaligned_recv_tokens_per_expert)
    return rows, row_probs, cached, cached_probs, counts, out, out_w, handle


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _suite() -> None:
    from moe_ep_plugin.megatron import PluginOptions, deepep_shim

    deepep_shim.configure(PluginOptions(transport="local"))
    x, routing_map, probs = _routing(torch.Generator().manual_seed(5))
    # the counted forms give the layout: 4 experts' blocks aligned to 4
    rows, row_probs, counts, _, out, dx, dp = _hybridep(x, routing_map, probs, None, False)
    budget = rows.shape[0] + 8  # every row fits, 8 zero rows past the layout
    got = _hybridep(x, routing_map, probs, budget, True)
    assert torch.equal(got[0][: rows.shape[0]], rows) and not got[0][rows.shape[0] :].any()
    assert torch.equal(got[1][: rows.shape[0]], row_probs) and got[2].tolist() == counts.tolist()
    assert got[3].tolist() == [0]
    for name, a, b in zip(("output", "x grad", "probs grad"), got[4:], (out, dx, dp), strict=True):
        assert torch.equal(a, b), f"hybridep budgeted {name} differs from the counted form's"
    cut = _hybridep(x, routing_map, probs, rows.shape[0] - 4, True)  # the last expert's block cut: overflow flag
    assert cut[3].tolist() == [1] and cut[2].sum().tolist() == rows.shape[0] - 4

    eager = _ncclep(x, routing_map, probs, None, False)
    static = _ncclep(x, routing_map, probs, eager[0].shape[0] + 8, True)
    n = eager[0].shape[0]
    assert torch.equal(static[0][:n], eager[0]) and not static[0][n:].any()
    assert torch.equal(static[1][:n], eager[1]) and static[2].tolist() == eager[2].tolist()
    assert static[3].tolist() == eager[3].tolist() == [n]
    for name, a, b in zip(("output", "x grad", "weights grad"), static[4:], eager[4:], strict=True):
        assert torch.equal(a, b), f"ncclep static {name} differs from the eager form's"

    counted = _deepepv2(x, routing_map, probs, True)
    free = _deepepv2(x, routing_map, probs, False)
    n = counted[0].shape[0]
    assert free[0].shape[0] == TOKENS and n < TOKENS  # capacity rows: one rank's bound; token 0 is routed nowhere
    assert torch.equal(free[0][:n], counted[0]) and not free[0][n:].any()
    assert torch.equal(free[1][:n], counted[1]) and bool((free[1][n:] == -1).all())
    assert torch.equal(free[2][:n], counted[2]) and not free[2][n:].any()
    assert free[3].dtype == counted[3].dtype == torch.int64 and free[3].tolist() == counted[3].tolist()
    for name, a, b in zip(("output", "x grad", "weights grad"), free[4:], counted[4:], strict=True):
        assert torch.equal(a, b), f"deepepv2 without a CPU sync: {name} differs from the counted form's"
    with pytest.raises(ValueError, match="x: 6 tokens, more than num_max_tokens_per_rank=5"):
        _deepepv2(x, routing_map, probs, False, TOKENS - 1)  # a bound below the tokens: refused, nothing sent

    sync = _elastic_expanded(x, routing_map, probs, True)
    free = _elastic_expanded(x, routing_map, probs, False)
    m = sync[0].shape[0]
    # DeepEP V2's worst case: T_max tokens on min(K, L) experts, each expert's block padding, aligned
    assert free[0].shape[0] == free[7].num_expanded_tokens == TOKENS * TOPK + EXPERTS * 3 > m
    assert free[7].num_recv_tokens_per_expert_list == [] and free[7].num_recv_tokens == TOKENS
    for i in (0, 1, 2, 3):  # rows, probs, cached rows, cached probs: the valid rows equal, zero past them
        assert torch.equal(free[i][:m], sync[i][:m]) and not free[i][m:].any()
    assert all(torch.equal(a, b) for a, b in zip(free[4], sync[4], strict=True))
    assert torch.equal(free[5], sync[5]) and torch.equal(free[6], sync[6])
    deepep_shim.configure(PluginOptions())


def test_flex_shims_read_nothing_on_the_host() -> None:
    spawn(_suite, 1, backend="gloo", timeout_s=120)
