"""DeepSpeed 0.19.8 AutoEP's ``comm_backend: "deepep"`` transport (``deepspeed.module_inject.auto_ep_comm``) on this
library after ``moe_ep_plugin.install_deep_ep()``, on gloo ranks.

AutoEP replaces Hugging Face MoE blocks, so a whole-model run needs ``transformers``, which this environment and CI
do not install; the test drives the exact calls ``AutoEPMoELayer._deepep_route`` makes instead:
``shared_exchange`` (DeepEP's ``ElasticBuffer`` with AutoEP's arguments), ``deepep_dispatch`` (expanded layout,
``expert_alignment=1``, weights carried and differentiable), per-expert counts from
``handle.psum_num_recv_tokens_per_expert``, experts on the received rows, the routing weights applied after them,
``deepep_combine``, and backward (combine with weight gradients, cached dispatch), with and without activation
checkpointing (non-reentrant: the recompute replays the forward's handle; reentrant). The result and the
gradients of tokens, routing weights and expert weights equal the dense plain-loop reference (the ``comm``
backend's math: ``out[t] = Σ_k w[t, k] · expert_{idx[t, k]}(x[t])``) within fp32 rounding (1e-5).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("deepspeed", reason="deepspeed is not installed")

from support.reference import dense_reference, routing  # noqa: E402

from moe_ep_plugin.launch import spawn  # noqa: E402

HIDDEN, TOPK, LOCAL, MAX_TOKENS = 16, 2, 2, 12


def _route(exchange, replay, x, idx, w, experts):
    """``AutoEPMoELayer._deepep_route``'s steps, with ``experts[e]`` ``[H, H]`` as expert ``e``'s GEMM."""
    from deepspeed.module_inject.auto_ep_comm import deepep_combine, deepep_dispatch

    received, recv_weights, exchange = deepep_dispatch(exchange, x, idx, w, replay=replay)
    handle = exchange.last_handle
    arrived = handle.num_expanded_tokens
    received, recv_weights = received[:arrived], recv_weights[:arrived]
    prefix = handle.psum_num_recv_tokens_per_expert
    counts = torch.diff(prefix, prepend=prefix.new_zeros(1)).tolist()
    rank = dist.get_rank()
    outs = [rows @ experts[rank * LOCAL + e] for e, rows in enumerate(received.split(counts))]
    expert_out = torch.cat(outs) * recv_weights.reshape(-1, 1)
    return deepep_combine(exchange, expert_out, handle)


def _suite(seed: int) -> None:
    import moe_ep_plugin

    moe_ep_plugin.install_deep_ep()
    from deepspeed.module_inject import auto_ep_comm

    rank, world = dist.get_rank(), dist.get_world_size()
    num_experts = LOCAL * world
    exchange = auto_ep_comm.shared_exchange(
        scope=auto_ep_comm.new_exchange_scope(),
        ep_group=dist.group.WORLD,
        num_experts=num_experts,
        top_k=TOPK,
        hidden_size=HIDDEN,
        num_max_tokens_per_rank=MAX_TOKENS,
    )
    assert type(exchange.buffer).__module__ == "moe_ep_plugin.deep_ep.elastic"
    replay = auto_ep_comm.DeepEPCheckpointReplay()
    experts_all = torch.randn(num_experts, HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(seed)) * 0.3
    for step, checkpoint in enumerate((None, "non_reentrant", "reentrant", None)):
        gen = torch.Generator().manual_seed(seed * 7 + step * 101 + rank)
        n = (3 + step + 2 * rank) % (MAX_TOKENS + 1)
        x = torch.randn(n, HIDDEN, generator=gen)
        idx = routing("random" if step % 2 == 0 else "one_expert", n, TOPK, num_experts, gen)
        w = torch.rand(n, TOPK, generator=gen).masked_fill(idx < 0, 0.0)
        g = torch.randn(n, HIDDEN, generator=gen)
        experts = experts_all.clone().requires_grad_(True)
        xp, wp = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        if checkpoint is None:
            out = _route(exchange, replay, xp, idx, wp, experts)
        else:
            out = torch.utils.checkpoint.checkpoint(
                _route, exchange, replay, xp, idx, wp, experts, use_reentrant=checkpoint == "reentrant"
            )
        (out * g).sum().backward()
        ref_out, ref_gx, ref_gw, ref_ge = dense_reference(x, idx, w, g, experts_all, False)
        tol = {"rtol": 1e-5, "atol": 1e-5}
        torch.testing.assert_close(out.detach(), ref_out, **tol, msg=lambda m, step=step: f"step {step} out: {m}")
        torch.testing.assert_close(xp.grad, ref_gx, **tol, msg=lambda m, step=step: f"step {step} grad x: {m}")
        torch.testing.assert_close(wp.grad, ref_gw, **tol, msg=lambda m, step=step: f"step {step} grad w: {m}")
        grad_e = experts.grad.clone()
        dist.all_reduce(grad_e)  # each rank's expert gradients are its local experts' share of the tokens
        mine = slice(rank * LOCAL, (rank + 1) * LOCAL)
        torch.testing.assert_close(experts.grad[mine], grad_e[mine], **tol)
        torch.testing.assert_close(
            grad_e[mine], ref_ge[mine], **tol, msg=lambda m, step=step: f"step {step} grad e: {m}"
        )
    exchange.destroy()


@pytest.mark.parametrize("world", [2, 3])
def test_autoep_deepep_exchange_on_this_library(world: int) -> None:
    spawn(_suite, world, args=(int(time.time()) % 1000,), backend="gloo")
