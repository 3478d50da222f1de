"""``EPPluginTokenDispatcher``'s six methods driven directly (as Megatron's own dispatcher tests do), on gloo.

Covers what Megatron's ``MoELayer`` cannot reach on CPU: a rank with zero tokens, routing maps with fewer
than top-k experts (-1 slots), every token on one expert, FP8 dispatch (BF16 in, FP8 on the wire, BF16 out),
and per-expert padding to the FP8 GEMM alignment.
The expert-major layout is checked row by row against a plain loop over every rank's tokens; with identity
experts the output is ``sum_k p_k x`` (``x`` FP8-rounded when dispatched in FP8) and the gradients are exact.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from moe_ep_plugin.launch import spawn  # noqa: E402
from moe_ep_plugin.ops import fp8  # noqa: E402

EXPERTS, TOPK = 8, 3


def _routing(case: str, tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense ``probs [T, E]`` (zero off the map) and ``routing_map [T, E]`` for one routing pattern."""
    scores = torch.rand(tokens, EXPERTS, generator=gen)
    if case == "one_expert":
        scores[:, 0] = 2.0
    idx = scores.topk(TOPK, dim=1).indices
    routing_map = torch.zeros(tokens, EXPERTS, dtype=torch.bool).scatter_(1, idx, True)
    if case == "dropped":  # some (token, expert) pairs dropped, as capacity dropping leaves them
        routing_map &= torch.rand(tokens, EXPERTS, generator=gen) > 0.4
    probs = torch.where(routing_map, torch.rand(tokens, EXPERTS, generator=gen) + 0.1, 0.0)
    return probs, routing_map


def _check(case: str, hidden: int, dtype: torch.dtype, fp8_dispatch: bool, seed: int, alignment: int = 1) -> None:
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from moe_ep_plugin.megatron import EPPluginTokenDispatcher, PluginOptions

    rank, world = dist.get_rank(), dist.get_world_size()
    num_local = EXPERTS // world
    config = TransformerConfig(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=2,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOPK,
        expert_model_parallel_size=world,
        use_cpu_initialization=True,
        moe_token_dispatcher_type="ep_plugin",
    )
    dispatcher = EPPluginTokenDispatcher(
        num_local,
        list(range(rank * num_local, (rank + 1) * num_local)),
        config,
        get_default_pg_collection(),
        options=PluginOptions(fp8_dispatch=fp8_dispatch),
    )
    # What moe_router_padding_for_quantization sets (its config needs TransformerEngine for FP8).
    dispatcher.alignment = alignment
    all_tokens = [0 if (case == "zero_rank" and r == 0) else 4 + 3 * r for r in range(world)]
    gens = [torch.Generator().manual_seed(seed * 10 + r) for r in range(world)]
    inputs = [
        (torch.randn(n, 1, hidden, generator=g).to(dtype), *_routing(case, n, g))
        for n, g in zip(all_tokens, gens, strict=False)
    ]
    x_all = [x.view(-1, hidden) for x, _, _ in inputs]
    sent = [fp8.dequantize(*fp8.quantize(x), dtype) if fp8_dispatch else x for x in x_all]  # what the experts see
    x, probs, routing_map = (t.clone() for t in inputs[rank])
    x.requires_grad_(True)
    probs.requires_grad_(True)

    h, p = dispatcher.dispatch_preprocess(x, routing_map, probs)
    h, p = dispatcher.token_dispatch(h, p)
    permuted, tokens_per_expert, permuted_probs = dispatcher.dispatch_postprocess(h, p)

    # Expert-major layout: expert l holds, in (source rank, token) order, every token that selected it.
    expected_rows, expected_probs, expected_counts = [], [], []
    for local in range(num_local):
        e = rank * num_local + local
        count = 0
        for src in range(world):
            for t in range(all_tokens[src]):
                if inputs[src][2][t, e]:
                    expected_rows.append(sent[src][t])
                    expected_probs.append(inputs[src][1][t, e])
                    count += 1
        padding = -count % alignment  # zero rows with zero probs complete each expert's block
        expected_rows += [torch.zeros(hidden, dtype=dtype)] * padding
        expected_probs += [torch.zeros(())] * padding
        expected_counts.append(count + padding)
    assert tokens_per_expert.tolist() == expected_counts and tokens_per_expert.dtype == torch.int64
    assert permuted.dtype == dtype
    if expected_rows:
        assert torch.equal(permuted, torch.stack(expected_rows))
        assert torch.equal(permuted_probs, torch.stack(expected_probs).float())
    else:
        assert permuted.shape == (0, hidden) and permuted_probs.shape == (0,)

    expert_out = (permuted.float() * permuted_probs.unsqueeze(-1)).to(dtype)  # an fp32-math identity expert
    out = dispatcher.combine_postprocess(dispatcher.token_combine(dispatcher.combine_preprocess(expert_out)))
    assert out.shape == x.shape and out.dtype == dtype
    mine = sent[rank]
    # Rounded where the path rounds: each expert's product, each rank's partial sum (fp32 sums, cast to
    # ``dtype``), the final sum; what remains is the fp32 summation order (1 ulp of ``dtype`` at most).
    expected = torch.zeros(mine.shape[0], hidden, dtype=torch.float32)
    for t in range(mine.shape[0]):
        for owner in range(world):
            partial = torch.zeros(hidden, dtype=torch.float32)
            for e in range(owner * num_local, (owner + 1) * num_local):
                if routing_map[t, e]:
                    partial += (mine[t].float() * probs[t, e].detach()).to(dtype).float()
            expected[t] += partial.to(dtype).float()
    expected = expected.to(dtype).float()
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-3}
    torch.testing.assert_close(out.view(-1, hidden).float(), expected, **tol)

    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 99 + rank)).to(dtype)
    out.backward(grad)
    g = grad.view(-1, hidden).float()
    expected_dx = g * (probs.detach() * routing_map).sum(1, keepdim=True)
    expected_dp = torch.where(routing_map, (mine.float() * g).sum(1, keepdim=True), 0.0)
    torch.testing.assert_close(x.grad.view(-1, hidden).float(), expected_dx, **tol)
    # The identity expert's fp32 math makes the prob gradient exact up to fp32 summation order.
    torch.testing.assert_close(probs.grad, expected_dp, rtol=1e-4, atol=1e-4)


def _suite(seed: int) -> None:
    from megatron.core import parallel_state as ps

    world = dist.get_world_size()
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    try:
        for i, case in enumerate(("random", "zero_rank", "dropped", "one_expert")):
            _check(case, 32, torch.float32, False, seed + i)
        _check("random", 256, torch.bfloat16, True, seed + 7)
        _check("dropped", 128, torch.bfloat16, False, seed + 8)
        _check("random", 32, torch.float32, False, seed + 9, alignment=16)
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize("world", [2, 4])
def test_dispatcher_methods_match_plain_loop(world: int) -> None:
    spawn(_suite, world, args=(int(time.time()) % 1000,), backend="gloo", timeout_s=120)


def test_routing_map_to_topk_matches_plain_loop() -> None:
    """Each token's ids are exactly its routing-map experts (any order), then -1 slots; weights are the probs at
    those ids (float32), 0 on -1 slots; prob gradients land on the selected entries only. Dense probs whose
    largest entries are not the selected experts, tied probs, a token without experts, a non-contiguous map."""
    from moe_ep_plugin.megatron import routing_map_to_topk

    gen = torch.Generator().manual_seed(int(time.time()) % 1000)
    tokens = 24
    scores = torch.rand(tokens, EXPERTS, generator=gen)
    routing_map = torch.zeros(tokens, EXPERTS, dtype=torch.bool).scatter_(1, scores.topk(TOPK, 1).indices, True)
    routing_map &= torch.rand(tokens, EXPERTS, generator=gen) > 0.3  # fewer than top-k for some tokens
    routing_map[0] = False
    routing_map[1] = torch.arange(EXPERTS) >= EXPERTS - TOPK
    routing_map = routing_map.t().contiguous().t()  # column-major: a strided view like a transposed map
    probs = torch.rand(tokens, EXPERTS, generator=gen)
    probs[2] = 0.5
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        p = probs.to(dtype, copy=True).requires_grad_(True)
        idx, w = routing_map_to_topk(routing_map, p, TOPK)
        assert idx.dtype == torch.int64 and w.dtype == torch.float32 and idx.shape == w.shape == (tokens, TOPK)
        grad = torch.randn(tokens, TOPK, generator=gen)
        w.backward(grad)
        expected_grad = torch.zeros(tokens, EXPERTS, dtype=torch.float64)
        for t in range(tokens):
            chosen = [e for e in range(EXPERTS) if routing_map[t, e]]
            expected = sorted([(e, float(p[t, e].detach())) for e in chosen] + [(-1, 0.0)] * (TOPK - len(chosen)))
            assert sorted(zip(idx[t].tolist(), w[t].tolist(), strict=False)) == expected, (dtype, t)
            for k in range(TOPK):
                if idx[t, k] >= 0:
                    expected_grad[t, idx[t, k]] += grad[t, k].item()
        assert torch.equal(p.grad, expected_grad.to(dtype)), dtype


def _errors() -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from moe_ep_plugin.megatron import EPPluginTokenDispatcher, PluginOptions, routing_map_to_topk

    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    try:
        config = TransformerConfig(
            num_layers=1,
            hidden_size=96,
            num_attention_heads=2,
            num_moe_experts=EXPERTS,
            moe_router_topk=TOPK,
            use_cpu_initialization=True,
        )
        pgc = get_default_pg_collection()
        with pytest.raises(ValueError, match="num_local_experts"):
            EPPluginTokenDispatcher(4, list(range(4)), config, pgc)
        with pytest.raises(TypeError, match="options"):
            EPPluginTokenDispatcher(EXPERTS, list(range(EXPERTS)), config, pgc, options={"fp8_dispatch": True})
        fp8_dispatcher = EPPluginTokenDispatcher(
            EXPERTS, list(range(EXPERTS)), config, pgc, options=PluginOptions(fp8_dispatch=True)
        )
        rmap = torch.zeros(2, EXPERTS, dtype=torch.bool)
        rmap[:, :TOPK] = True
        with pytest.raises(ValueError, match="hidden % 128"):
            fp8_dispatcher.dispatch_preprocess(torch.randn(2, 96), rmap, rmap.float())
        with pytest.raises(ValueError, match="routing_map"):
            fp8_dispatcher.dispatch_preprocess(torch.randn(3, 96), rmap, rmap.float())
        with pytest.raises(ValueError, match="routing_map"):
            routing_map_to_topk(rmap.float(), rmap.float(), TOPK)
        with pytest.raises(ValueError, match="probs"):
            routing_map_to_topk(rmap, rmap.float()[:1], TOPK)
        with pytest.raises(RuntimeError, match="dispatch_preprocess"):
            fp8_dispatcher.token_dispatch(torch.randn(2, 96), torch.ones(2, TOPK))
        # FP16: served on every transport; FP8 dispatch (which quantizes BF16 rows) is refused when the dispatcher is
        # built for an fp16 config
        fp16_config = dataclasses.replace(config, hidden_size=128, fp16=True)
        EPPluginTokenDispatcher(
            EXPERTS, list(range(EXPERTS)), fp16_config, pgc, options=PluginOptions(transport="nvlink")
        )
        with pytest.raises(ValueError, match="fp16: True with ep_plugin.fp8_dispatch"):
            EPPluginTokenDispatcher(
                EXPERTS,
                list(range(EXPERTS)),
                fp16_config,
                pgc,
                options=PluginOptions(transport="nvlink", fp8_dispatch=True),
            )
        # drop-and-pad: a capacity (ceil(2 x 3 / 8 x 4) = 3) beyond the 2 tokens a rank holds
        pad_config = TransformerConfig(
            num_layers=1,
            hidden_size=96,
            num_attention_heads=2,
            num_moe_experts=EXPERTS,
            moe_router_topk=TOPK,
            use_cpu_initialization=True,
            moe_expert_capacity_factor=4.0,
            moe_pad_expert_input_to_capacity=True,
        )
        dispatcher = EPPluginTokenDispatcher(
            EXPERTS, list(range(EXPERTS)), pad_config, pgc, options=PluginOptions(transport="torch")
        )
        h, p = dispatcher.dispatch_preprocess(torch.randn(2, 96), rmap, rmap.float())
        with pytest.raises(
            ValueError, match="moe_expert_capacity_factor: a capacity of 3 tokens per expert needs 1 to 2 tokens"
        ):
            dispatcher.token_dispatch(h, p)
        idx, w = routing_map_to_topk(rmap & torch.tensor([True, False]).unsqueeze(1), rmap.float(), TOPK)
        assert sorted(idx[0].tolist()) == [0, 1, 2] and idx[1].tolist() == [-1] * TOPK
        assert w[1].tolist() == [0.0] * TOPK and w.dtype == torch.float32
    finally:
        ps.destroy_model_parallel()


def test_bad_inputs_raise_clearly() -> None:
    spawn(_errors, 1, backend="gloo")


def _buffer_reuse() -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from moe_ep_plugin import Buffer
    from moe_ep_plugin.buffer_cache import destroy_buffers, get_buffer
    from moe_ep_plugin.config import combine_config, dispatch_config
    from moe_ep_plugin.megatron import EPPluginTokenDispatcher, PluginOptions

    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    try:
        config = TransformerConfig(
            num_layers=1,
            hidden_size=32,
            num_attention_heads=2,
            num_moe_experts=EXPERTS,
            moe_router_topk=TOPK,
            use_cpu_initialization=True,
        )
        d = EPPluginTokenDispatcher(
            EXPERTS, list(range(EXPERTS)), config, get_default_pg_collection(), options=PluginOptions(transport="torch")
        )
        probs, routing_map = _routing("random", 5, torch.Generator().manual_seed(0))

        def dispatched_buffer(hidden: int) -> Buffer:
            d.token_dispatch(*d.dispatch_preprocess(torch.randn(5, hidden), routing_map, probs))
            return d._buffer

        first = dispatched_buffer(32)
        assert first is get_buffer(d.ep_group, 32 * 4, "torch") and dispatched_buffer(32) is first
        # the tokens' device, which the dispatcher passes, names the group's default (a gloo group's: the CPU)
        assert first.device == torch.device("cpu") and get_buffer(d.ep_group, 32 * 4, "torch", device="cpu") is first
        destroy_buffers()  # a destroyed buffer is never handed out again
        second = dispatched_buffer(32)
        assert first.destroyed and second is not first and not second.destroyed
        Buffer.set_num_sms(Buffer.num_sms * 4)  # the size hint grows: the shared buffer is re-created
        third = dispatched_buffer(32)
        assert third is not second and third is get_buffer(d.ep_group, 32 * 4, "torch")
        assert dispatched_buffer(8) is third  # narrower rows fit the same shared buffer

        # ep_plugin.num_sms travels per call on the Configs; Buffer.num_sms (DeepEP's default) stays as it was
        default_sms = Buffer.num_sms
        d8 = EPPluginTokenDispatcher(
            EXPERTS,
            list(range(EXPERTS)),
            config,
            get_default_pg_collection(),
            options=PluginOptions(transport="torch", num_sms=8),
        )
        transport = d8._get_buffer(32 * 4).transport
        seen = []
        real_dispatch, real_combine = transport.dispatch_experts, transport.combine_experts
        transport.dispatch_experts = lambda args, align: (seen.append(args.config), real_dispatch(args, align))[1]
        transport.combine_experts = lambda y, handle, w, bias, cfg: (
            seen.append(cfg),
            real_combine(y, handle, w, bias, cfg),
        )[1]
        rows, _ = d8.token_dispatch(*d8.dispatch_preprocess(torch.randn(5, 32), routing_map, probs))
        d8.token_combine(rows)
        assert seen == [dispatch_config(8, 1), combine_config(8, 1)] and Buffer.num_sms == default_sms
        assert seen[0].num_sms == seen[1].num_sms == 8
    finally:
        ps.destroy_model_parallel()


def test_dispatcher_follows_the_shared_buffer() -> None:
    """The dispatcher keeps the shared buffer between calls, and fetches it again once it was destroyed or the
    SM count changed."""
    spawn(_buffer_reuse, 1, backend="gloo")
