"""Megatron's ``batch_invariant_mode`` with ``moe_token_dispatcher_type: ep_plugin`` (accepted by ``install()`` for
dropless routing), on 1-4 gloo ranks: the same probe tokens, put inside different batches (other tokens before and
after them, in varying numbers, other routings, and every other rank's batch changing too, down to a rank that
sends nothing), come out of dispatch -> experts -> combine with the same bits, and so do their input gradients.

The experts are row-wise (each row times its probability and a per-expert factor, rounded to BF16), so any
difference could only come from the dispatcher: the rows it delivers, and the order its combine sums a token's
rows in (top-k order on each rank, then over ranks). Capacity dropping and drop-and-pad are refused naming the key.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from moe_ep_plugin.launch import spawn  # noqa: E402

HIDDEN, EXPERTS, TOPK = 64, 12, 3


def _config(world: int, **extra):
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    if "flash_attention_version" in TransformerConfig.__dataclass_fields__:
        # megatron-core 0.19's batch_invariant_mode asks for a pinned FlashAttention (3 or 4) and no attention
        # dropout; nothing here runs attention
        extra.update(flash_attention_version=3, attention_dropout=0.0)
    return TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=2,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOPK,
        expert_model_parallel_size=world,
        use_cpu_initialization=True,
        moe_token_dispatcher_type="ep_plugin",
        batch_invariant_mode=True,
        attention_backend=AttnBackend.flash,
        bf16=True,
        params_dtype=torch.bfloat16,
        **extra,
    )


def _tokens(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``n`` BF16 tokens with a dense ``probs [n, E]`` and ``routing_map [n, E]`` (top-k of random scores)."""
    x = torch.randn(n, 1, HIDDEN, generator=gen).bfloat16()
    scores = torch.rand(n, EXPERTS, generator=gen)
    routing_map = torch.zeros(n, EXPERTS, dtype=torch.bool).scatter_(1, scores.topk(TOPK, dim=1).indices, True)
    return x, torch.where(routing_map, scores, 0.0), routing_map


def _run(dispatcher, x, probs, routing_map, grad, num_local: int):
    """dispatch -> row-wise experts -> combine, forward and backward → (output, input gradient)."""
    x = x.clone().requires_grad_(True)
    h, p = dispatcher.dispatch_preprocess(x, routing_map, probs)
    h, p = dispatcher.token_dispatch(h, p)
    rows, tokens_per_expert, row_probs = dispatcher.dispatch_postprocess(h, p)
    factor = torch.repeat_interleave(torch.arange(num_local) + 1 + dist.get_rank() * num_local, tokens_per_expert)
    expert_out = (rows.float() * (row_probs * factor).unsqueeze(-1)).bfloat16()
    out = dispatcher.combine_postprocess(dispatcher.token_combine(dispatcher.combine_preprocess(expert_out)))
    out.backward(grad)
    return out.detach(), x.grad


def _suite(seed: int) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    import moe_ep_plugin.megatron as ep_megatron

    rank, world = dist.get_rank(), dist.get_world_size()
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    ep_megatron.install(ep_megatron.PluginOptions(transport="torch"))
    try:
        num_local = EXPERTS // world
        dispatcher = ep_megatron.EPPluginTokenDispatcher(
            num_local,
            list(range(rank * num_local, (rank + 1) * num_local)),
            _config(world),
            get_default_pg_collection(),
        )
        gen = torch.Generator().manual_seed(seed * 31 + rank)
        probe_n = 0 if rank == world - 1 and world > 1 else 5 + rank  # the last rank has no probe tokens
        probe = _tokens(probe_n, gen)
        probe_grad = torch.randn(probe_n, 1, HIDDEN, generator=gen).bfloat16()
        seen = []
        for batch in range(4):
            # other tokens around the probe: none, before, after, both; the last batch of rank 0 is empty
            before = (0, 3 + rank, 0, 7)[batch]
            after = (0, 0, 2 * rank + 1, 4)[batch]
            if batch == 3 and rank == 0 and world > 1:
                before = after = 0
            parts = [_tokens(before, gen), probe, _tokens(after, gen)]
            x, probs, routing_map = (torch.cat([part[i] for part in parts]) for i in range(3))
            grad = torch.cat(
                [
                    torch.randn(before, 1, HIDDEN, generator=gen).bfloat16(),
                    probe_grad,
                    torch.randn(after, 1, HIDDEN, generator=gen).bfloat16(),
                ]
            )
            out, dx = _run(dispatcher, x, probs, routing_map, grad, num_local)
            seen.append((out[before : before + probe_n], dx[before : before + probe_n]))
        for batch, (out, dx) in enumerate(seen[1:], 1):
            assert torch.equal(out.view(torch.int16), seen[0][0].view(torch.int16)), (rank, batch)
            assert torch.equal(dx.view(torch.int16), seen[0][1].view(torch.int16)), (rank, batch)
        # token dropping decides by the whole batch: refused at config time
        with pytest.raises(
            ValueError,
            match="moe_expert_capacity_factor: batch_invariant_mode with "
            "moe_token_dispatcher_type: ep_plugin serves dropless routing only",
        ):
            _config(world, moe_expert_capacity_factor=1.0)
    finally:
        ep_megatron.uninstall()
        ps.destroy_model_parallel()


def _has_batch_invariant_mode() -> bool:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return "batch_invariant_mode" in TransformerConfig.__dataclass_fields__


@pytest.mark.skipif(not _has_batch_invariant_mode(), reason="the installed megatron-core has no batch_invariant_mode")
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ep_plugin_is_batch_invariant(world: int) -> None:
    spawn(_suite, world, args=(int(time.time()) % 1000,), backend="gloo", timeout_s=300)
