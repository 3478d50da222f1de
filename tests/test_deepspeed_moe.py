"""moe_ep_plugin.deepspeed's MoE layer against stock DeepSpeed MoE and a plain-loop reference (CPU, gloo).

Stock side: ``deepspeed.moe.layer.MoE`` (DeepSpeed 0.19.8), whose ``MOELayer`` pads every expert to a capacity
and exchanges ``[E, C, H]`` with equal-split all-to-alls. With ``drop_tokens=False`` it is dropless for every k
(top1gating, top2gating and, for k > 2, topkgating set the capacity to the largest expert load), so outputs and
all gradients must agree with the plugin's variable-split path up to fp32 summation order; ``l_aux`` and
``exp_counts`` come from the same gating code and must agree exactly. Random gate noise (top-2 Gumbel sampling,
random token selection) is replayed by seeding both forwards alike.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed picks its accelerator at import; no GPU in these tests
deepspeed = pytest.importorskip("deepspeed")

from moe_ep_plugin import launch  # noqa: E402

H = 16
ATOL, RTOL = 1e-6, 2e-6  # fp32, only the summation order differs


def ds_init() -> None:
    """Join DeepSpeed's comm to the process group :func:`launch.spawn` made.

    DeepSpeed's CPU accelerator JIT-compiles a shared-memory allreduce op on its first init (about 30 s and a
    C++ compiler); gloo serves these small tests, so the op is marked unavailable in DeepSpeed's own table.
    """
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")


class Expert(torch.nn.Module):
    """A small two-layer MLP expert with biases (DeepSpeed deep-copies it per local expert)."""

    def __init__(self, hidden: int, ffn: int = 24) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(hidden, ffn)
        self.fc2 = torch.nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def make_modules(num_experts: int, ep_size: int, k: int, **ds_kwargs):
    """Stock DeepSpeed MoE, the plugin MoE, and a stock MoE converted with ``convert_moe`` after its groups were
    set, all with identical weights (gate shared by all ranks, experts different on every rank)."""
    from moe_ep_plugin.deepspeed import MoE, PluginMOELayer, convert_moe
    torch.manual_seed(0)
    stock = deepspeed.moe.layer.MoE(H, Expert(H), num_experts, ep_size, k, **ds_kwargs)
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    with torch.no_grad():
        for p in stock.deepspeed_moe.experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        stock.deepspeed_moe.gate.wg.weight.mul_(4.0)  # sharper gate: distinct top-k, uneven loads
    plugin = MoE(H, Expert(H), num_experts, ep_size, k, **ds_kwargs)
    converted = deepspeed.moe.layer.MoE(H, Expert(H), num_experts, ep_size, k, **ds_kwargs)
    for moe in (plugin, converted):
        moe.load_state_dict(stock.state_dict())
    for moe in (stock, plugin, converted):
        moe.set_deepspeed_parallelism()
    old_layer = converted.deepspeed_moe
    assert convert_moe(converted) == [""]
    layer = converted.deepspeed_moe
    assert isinstance(layer, PluginMOELayer) and isinstance(plugin.deepspeed_moe, PluginMOELayer)
    assert layer.gate is old_layer.gate and layer.experts is old_layer.experts and layer.ep_group is old_layer.ep_group
    return stock, plugin, converted


def run_step(moe: torch.nn.Module, x: torch.Tensor, grad_out: torch.Tensor, seed: int, used_token=None):
    """Forward + backward of ``sum(out * grad_out) + l_aux``; → (out, l_aux, exp_counts, x.grad, {name: grad})."""
    moe.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    torch.manual_seed(seed)  # same gate noise draws on both sides
    out, l_aux, exp_counts = moe(x, used_token)
    ((out * grad_out).sum() + l_aux).backward()
    grads = {n: p.grad.clone() for n, p in moe.named_parameters()}
    return out.detach(), l_aux.detach(), exp_counts, x.grad, grads


def assert_same(stock_res, plugin_res, what: str) -> None:
    out_s, laux_s, cnt_s, dx_s, g_s = stock_res
    out_p, laux_p, cnt_p, dx_p, g_p = plugin_res
    torch.testing.assert_close(out_p, out_s, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what} output: {m}")
    torch.testing.assert_close(dx_p, dx_s, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what} x.grad: {m}")
    assert torch.equal(laux_p, laux_s), f"{what}: l_aux {laux_p} != {laux_s}"
    assert torch.equal(cnt_p, cnt_s), f"{what}: exp_counts {cnt_p} != {cnt_s}"
    assert g_p.keys() == g_s.keys()
    for name in g_s:
        torch.testing.assert_close(g_p[name], g_s[name], atol=ATOL, rtol=RTOL, msg=lambda m: f"{what} {name}: {m}")


def _worker_matches_stock(cases: list[dict]) -> None:
    ds_init()
    rank = dist.get_rank()
    for i, case in enumerate(cases):
        case = dict(case)
        tokens = case.pop("tokens")
        use_mask = case.pop("used_token", False)
        stock, plugin, converted = make_modules(**case)
        gen = torch.Generator().manual_seed(1000 * i + rank)
        x = torch.randn(2, tokens // 2, H, generator=gen)  # [batch, seq, H]: the layer flattens leading dims
        grad_out = torch.randn(x.shape, generator=gen)
        used = (torch.rand(tokens, generator=gen) > 0.3).float() if use_mask else None
        for step in range(2):  # a second step: cached buffer, gate noise redrawn
            expected = run_step(stock, x, grad_out, 7 + step, used)
            assert_same(expected, run_step(plugin, x, grad_out, 7 + step, used), f"rank {rank} {case} step {step}")
            assert_same(expected, run_step(converted, x, grad_out, 7 + step, used), f"rank {rank} {case} converted")


DROPLESS_CASES = [
    # k=1: top1gating, random token selection on (it cannot drop without a capacity limit)
    dict(num_experts=8, ep_size=2, k=1, drop_tokens=False, min_capacity=0, tokens=24),
    # used_token masks tokens out (k=1 only). DeepSpeed 0.19.8's top1gating fails on it without a capacity
    # limit (the float mask makes the capacity a float tensor: 'topk(): argument k must be int'), so with drops
    dict(num_experts=8, ep_size=2, k=1, drop_tokens=True, capacity_factor=1.0, min_capacity=0, tokens=24,
         used_token=True),
    # k=2: top2gating with its Gumbel-sampled second expert (DeepSpeed's default)
    dict(num_experts=8, ep_size=2, k=2, drop_tokens=False, tokens=24),
    # k=8: topkgating (DeepSpeed uses it for every k > 2)
    dict(num_experts=16, ep_size=2, k=8, drop_tokens=False, tokens=20),
    # drop_tokens=True: DeepSpeed's capacity drops are honoured (-1 routes are not sent)
    dict(num_experts=8, ep_size=2, k=2, drop_tokens=True, capacity_factor=0.5, min_capacity=1, tokens=24),
]


def test_matches_stock_deepspeed_ep2():
    launch.spawn(_worker_matches_stock, 2, (DROPLESS_CASES,))


def test_matches_stock_deepspeed_ep1_ep2_ep4_on_4_ranks():
    cases = [dict(num_experts=4, ep_size=1, k=2, drop_tokens=False, tokens=12),
             dict(num_experts=8, ep_size=2, k=2, drop_tokens=False, tokens=12),  # 2 EP groups x 2 data-parallel
             dict(num_experts=8, ep_size=4, k=3, drop_tokens=False, tokens=12)]
    launch.spawn(_worker_matches_stock, 4, (cases,))
