"""``megatron.hybridep_shim`` called directly (gloo, 1-3 ranks) against a plain loop: the expert-major rows with
``pad_multiple`` padding, per-row probs, ``tokens_per_expert``; the static row budget (``num_permuted_tokens``)
cutting the layout (overflow flag at ``handle[-1]``, clipped device counts, dropped rows contributing nothing to
combine or to the input gradient) or padding it with zero rows; FP32 and FP16 tokens (FP16 bit for bit: rows moved as
they are, sums in fp32 rounded to fp16); and the config-time refusals of ``install()``."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from support.reference import gather_all  # noqa: E402

from moe_ep_plugin.launch import spawn  # noqa: E402

HIDDEN, LOCAL, PAD = 8, 2, 4


def _layout(xs, maps, probs, rank: int, world: int):
    """Rank ``rank``'s expert-major rows: per local expert, ``(src, t, prob)`` in source order, then
    ``None`` padding up to ``PAD``."""
    rows = []
    for e in range(LOCAL):
        block = [
            (src, t, float(probs[src][t, rank * LOCAL + e]))
            for src in range(world)
            for t in range(xs[src].shape[0])
            if maps[src][t, rank * LOCAL + e]
        ]
        rows += block + [None] * (-len(block) % PAD)
    return rows


def _case(seed: int, budget_delta: int | None, dtype: torch.dtype = torch.float32) -> None:
    from moe_ep_plugin.megatron import hybridep_shim

    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(seed * 31 + rank)
    n, num_experts = 3 + (seed + rank) % 5, LOCAL * world
    x = torch.randn(n, HIDDEN, generator=gen).to(dtype).requires_grad_(True)
    routing_map = torch.rand(n, num_experts, generator=gen) < 0.5
    probs = (torch.rand(n, num_experts, generator=gen) * routing_map).requires_grad_(True)
    xs, maps, ps = zip(*gather_all((x.detach(), routing_map, probs.detach())), strict=True)
    layouts = [_layout(xs, maps, ps, r, world) for r in range(world)]
    budgets = [None if budget_delta is None else max(0, len(lay) + budget_delta) for lay in layouts]
    out, out_probs, scale, tokens_per_expert, handle = hybridep_shim.hybrid_ep_dispatch(
        x,
        routing_map,
        probs,
        dist.group.WORLD,
        LOCAL,
        num_sms_dispatch_api=16,
        num_sms_combine_api=16,
        num_permuted_tokens=budgets[rank],
        pad_multiple=PAD,
    )
    assert scale is None
    mine, budget = layouts[rank], budgets[rank]
    kept = mine if budget is None else mine[:budget]
    rows = len(mine) if budget is None else budget
    want = torch.zeros(rows, HIDDEN, dtype=dtype)
    want_p = torch.zeros(rows)
    for i, r in enumerate(kept):
        if r is not None:
            want[i], want_p[i] = xs[r[0]][r[1]], r[2]
    assert torch.equal(out.detach(), want) and torch.equal(out_probs.detach(), want_p)
    counts = [
        sum(1 for src in range(world) for t in range(xs[src].shape[0]) if maps[src][t, rank * LOCAL + e])
        for e in range(LOCAL)
    ]
    aligned = [c + (-c % PAD) for c in counts]
    if budget is not None:
        ends = torch.tensor(aligned).cumsum(0)
        aligned = (ends.clamp(max=budget) - (ends - torch.tensor(aligned)).clamp(max=budget)).tolist()
    assert tokens_per_expert.dtype == torch.int64 and tokens_per_expert.tolist() == aligned
    assert int(handle[-1][0]) == int(budget is not None and len(mine) > budget)

    # combine of y = the rows themselves scaled by the receiving rank (in dtype): each token's kept rows summed in
    # fp32. FP16: a token's rows on one rank are copies of one value (at most two: exact), its ranks' partials of
    # like magnitude (exact in fp32), so the kernels' two roundings (per rank, then over ranks) equal this one.
    y = out * (rank + 1)
    combined = hybridep_shim.hybrid_ep_combine(y, handle, num_permuted_tokens=None, pad_multiple=PAD)
    expected = torch.zeros(n, HIDDEN)
    grad_x = torch.zeros(n, HIDDEN)
    for r, lay in enumerate(layouts):
        for row in lay if budgets[r] is None else lay[: budgets[r]]:
            if row is not None and row[0] == rank:
                expected[row[1]] += (xs[rank][row[1]] * (r + 1)).float()
                grad_x[row[1]] += r + 1
    exact = dict(rtol=0, atol=0) if dtype == torch.float16 else dict(rtol=1e-6, atol=1e-6)
    assert combined.dtype == dtype
    torch.testing.assert_close(combined, expected.to(dtype), **exact)
    combined.sum().backward()  # d/dx of sum(combine(dispatch(x) * s)): s per kept row
    assert x.grad.dtype == dtype
    torch.testing.assert_close(x.grad, grad_x.to(dtype), **exact)


def _suite(seed: int) -> None:
    import moe_ep_plugin.megatron as ep_megatron

    ep_megatron.install(ep_megatron.PluginOptions(transport="torch"))
    try:
        for i, delta in enumerate((None, -3, 5, -1000)):
            _case(seed + i, delta)
        for i, delta in enumerate((None, -3)):  # FP16 tokens, as Megatron's fp16: True hands them
            _case(seed + 10 + i, delta, torch.float16)
    finally:
        ep_megatron.uninstall()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_hybridep_shim_matches_plain_loop(world: int) -> None:
    spawn(_suite, world, args=(int(time.time()) % 1000,), backend="gloo")


def test_flex_config_refusals() -> None:
    from megatron.core.transformer.transformer_config import TransformerConfig

    import moe_ep_plugin.megatron as ep_megatron
    from moe_ep_plugin.megatron import registration

    def config(backend: str, hidden: int = 16, **extra):
        return TransformerConfig(
            num_layers=1,
            hidden_size=hidden,
            num_attention_heads=2,
            num_moe_experts=4,
            moe_router_topk=2,
            moe_token_dispatcher_type="flex",
            moe_flex_dispatcher_backend=backend,
            use_cpu_initialization=True,
            **extra,
        )

    ep_megatron.install(ep_megatron.PluginOptions(transport="torch"))
    try:
        config("hybridep")
        pad = dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
        config("hybridep", expert_model_parallel_size=2, **pad)  # drop-and-pad at expert TP 1
        with pytest.raises(ValueError, match="moe_pad_expert_input_to_capacity.*'hybridep'.*expert_tensor_parallel"):
            config(
                "hybridep",
                tensor_model_parallel_size=2,
                expert_model_parallel_size=2,
                sequence_parallel=True,
                add_bias_linear=False,
                **pad,
            )
        # the refusal follows the installed megatron-core: ncclep from 0.19, deepepv2 on Megatron-LM dev
        for backend in ("ncclep", "deepepv2"):
            if backend in registration.SERVED_FLEX_BACKENDS:
                config(backend)
            else:
                with pytest.raises(ValueError, match=f"moe_flex_dispatcher_backend: '{backend}' is not served"):
                    config(backend)
        # FP16 tokens: served on every transport (rows as they are, as BF16's); FP8 dispatch with them is refused
        # when the config is built, not at the first dispatch
        for transport in ("torch", "nvlink"):
            ep_megatron.install(ep_megatron.PluginOptions(transport=transport))
            for backend in registration.SERVED_FLEX_BACKENDS:
                config(backend, fp16=True)
        ep_megatron.install(ep_megatron.PluginOptions(transport="torch", fp8_dispatch=True))
        with pytest.raises(ValueError, match="ep_plugin.fp8_dispatch"):
            config("hybridep")
        config("hybridep", hidden=128)
        with pytest.raises(ValueError, match="fp16: True with ep_plugin.fp8_dispatch"):
            config("deepep", hidden=128, fp16=True)
    finally:
        ep_megatron.uninstall()
