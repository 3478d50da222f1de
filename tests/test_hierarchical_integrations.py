"""The trainer and the Megatron-Core dispatcher on 2 emulated nodes x 2 ranks (gloo): ``transport: hierarchical``
gives the same loss, outputs and gradients as ``transport: torch``. FP32 compute: the two differ only in the
grouping of combine's fp32 sums (per node first), so rtol 1e-5 / atol 1e-6."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from test_train_equivalence import _config, _step

from moe_ep_plugin import launch
from moe_ep_plugin.buffer_cache import sm_configs
from moe_ep_plugin.plugin_options import PluginOptions
from moe_ep_plugin.recipes.train.trainer import Trainer, _format

TOL = dict(rtol=1e-5, atol=1e-6)


def _trainer_steps() -> None:
    base = _config(4, False)  # FP32 on the CPU, 8 experts, 4 groups (a multiple of the 2 nodes)
    hier = dataclasses.replace(
        base, parallel=dataclasses.replace(base.parallel, transport="hierarchical", ranks_per_node=2)
    )
    bias = torch.linspace(-0.05, 0.05, 8).roll(3)
    results = []
    for cfg in (base, hier):
        trainer = Trainer(cfg)
        assert trainer.buffer.transport_name == cfg.parallel.transport
        results.append(_step(trainer, bias))
        trainer.buffer.destroy()
    (r_flat, g_flat, n_flat, b_flat), (r_hier, g_hier, n_hier, b_hier) = results
    assert torch.equal(r_hier.counts, r_flat.counts)
    torch.testing.assert_close(r_hier.lm_loss, r_flat.lm_loss, **TOL)
    torch.testing.assert_close(r_hier.aux_loss, r_flat.aux_loss, **TOL)
    torch.testing.assert_close(n_hier, n_flat, **TOL)
    torch.testing.assert_close(b_hier, b_flat, rtol=0, atol=0)
    assert g_hier.keys() == g_flat.keys()
    for name, grad in g_hier.items():
        torch.testing.assert_close(grad, g_flat[name], **TOL, msg=lambda m: f"{name}: {m}")
    # node statistics: only across nodes; the counts of the same routing under either transport agree
    assert r_flat.nodes is None
    nodes = r_hier.nodes
    assert 1.0 <= nodes.nodes_per_token_mean <= nodes.nodes_per_token_max <= 2
    assert 0 < nodes.inter_node_bytes <= nodes.flat_inter_node_bytes
    line = _format(
        {
            "step": 1,
            "loss": 1.0,
            "aux_loss": 0.0,
            "lr": 1e-3,
            "grad_norm": 1.0,
            "tokens_per_s": 1.0,
            "load_max_over_mean": 1.0,
            "load_max_over_mean_worst_layer": 1.0,
            "eval_loss": None,
            "mfu": None,
            "nodes_per_token_mean": nodes.nodes_per_token_mean,
            "nodes_per_token_max": nodes.nodes_per_token_max,
            "inter_node_mb": 0.5,
            "flat_inter_node_mb": 0.9,
        },
        10,
    )
    assert f"nodes/token {nodes.nodes_per_token_mean:.2f} (max {nodes.nodes_per_token_max})" in line
    assert "inter-node 0.50 MB/step (flat all-to-all 0.90)" in line


def test_trainer_hierarchical_step_equals_torch_step() -> None:
    launch.spawn(_trainer_steps, 4, backend="gloo", timeout_s=300)


def _dispatcher_pass(options, hidden: int, experts: int, topk: int, seed: int):
    """One dispatch → identity expert (times probs) → combine → backward; returns outputs and gradients."""
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from moe_ep_plugin.megatron import EPPluginTokenDispatcher

    rank, world = dist.get_rank(), dist.get_world_size()
    local = experts // world
    config = TransformerConfig(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=2,
        num_moe_experts=experts,
        moe_router_topk=topk,
        expert_model_parallel_size=world,
        use_cpu_initialization=True,
        moe_token_dispatcher_type="ep_plugin",
    )
    dispatcher = EPPluginTokenDispatcher(
        local, list(range(rank * local, (rank + 1) * local)), config, get_default_pg_collection(), options=options
    )
    gen = torch.Generator().manual_seed(seed * 10 + rank)
    n = 0 if rank == 2 else 5 + rank  # a rank with no tokens
    x = torch.randn(n, 1, hidden, generator=gen).requires_grad_(True)
    scores = torch.rand(n, experts, generator=gen)
    routing_map = torch.zeros(n, experts, dtype=torch.bool).scatter_(1, scores.topk(topk, 1).indices, True)
    probs = torch.where(routing_map, scores, 0.0).requires_grad_(True)
    h, p = dispatcher.dispatch_preprocess(x, routing_map, probs)
    h, p = dispatcher.token_dispatch(h, p)
    permuted, tokens_per_expert, permuted_probs = dispatcher.dispatch_postprocess(h, p)
    out = dispatcher.combine_postprocess(
        dispatcher.token_combine(dispatcher.combine_preprocess(permuted * permuted_probs.unsqueeze(-1)))
    )
    out.backward(torch.randn(out.shape, generator=gen))
    return out.detach(), permuted.detach(), tokens_per_expert, x.grad, probs.grad


def _dispatcher_equal() -> None:
    from megatron.core import parallel_state as ps

    from moe_ep_plugin.megatron import PluginOptions

    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=dist.get_world_size())
    try:
        flat = _dispatcher_pass(PluginOptions(transport="torch"), 32, 8, 3, seed=5)
        hier = _dispatcher_pass(PluginOptions(transport="hierarchical", ranks_per_node=2), 32, 8, 3, seed=5)
    finally:
        ps.destroy_model_parallel()
    assert torch.equal(hier[1], flat[1]) and torch.equal(hier[2], flat[2])  # the expert-major rows: identical
    for name, a, b in zip(("out", "x.grad", "probs.grad"), (hier[0],) + hier[3:], (flat[0],) + flat[3:], strict=False):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{name}: {m}")


def test_megatron_dispatcher_hierarchical_equals_torch() -> None:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    launch.spawn(_dispatcher_equal, 4, backend="gloo", timeout_s=300)


def test_integration_options_set_only_the_sm_count() -> None:
    """The integrations' options reach the per-call Configs as an SM count only: chunking and kernel modes are
    ``Config`` fields a caller sets on its own calls, not YAML keys."""
    opts = PluginOptions.from_dict({"transport": "hierarchical", "num_sms": 16}, "ep_plugin")
    configs = sm_configs(opts.num_sms, 4)
    assert configs is not None and [c.num_sms for c in configs] == [16, 16]
    assert [c.hierarchical_chunks for c in configs] == [1, 1]
    assert sm_configs(None, 4) is None
    for key in ("hierarchical_chunks", "fused_dispatch", "fused_combine", "fused_dispatch_sms"):
        with pytest.raises(ValueError, match=f"ep_plugin.{key}: unknown option"):
            PluginOptions.from_dict({key: 1}, "ep_plugin")
