"""moe_ep_plugin.deepspeed's MoE layer against stock DeepSpeed MoE and a plain-loop reference (CPU, gloo).

Stock side: ``deepspeed.moe.layer.MoE`` (DeepSpeed 0.19.8), whose ``MOELayer`` pads every expert to a capacity
and exchanges ``[E, C, H]`` with equal-split all-to-alls. With ``drop_tokens=False`` it is dropless for every k
(top1gating, top2gating and, for k > 2, topkgating set the capacity to the largest expert load), so outputs and
all gradients must agree with the plugin's variable-split path up to fp32 summation order; ``l_aux`` and
``exp_counts`` come from the same gating code and must agree exactly. Random gate noise (top-2 Gumbel sampling,
random token selection) is replayed by seeding both forwards alike.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os

import pytest
import torch
import torch.distributed as dist

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed picks its accelerator at import; no GPU in these tests
deepspeed = pytest.importorskip("deepspeed")

from moe_ep_plugin import launch  # noqa: E402

H = 16
TOL = 1e-6  # fp32, only the summation order differs: relative to each tensor's largest entry


def ds_init() -> None:
    """Join DeepSpeed's comm to the process group :func:`launch.spawn` made (no shared-memory op compiled)."""
    from moe_ep_plugin.recipes.deepspeed.train import init_deepspeed_comm

    init_deepspeed_comm()


def ds_finish(*engines) -> None:
    """Free engines and the plugin's buffers while the process group is alive (a C++ thread outliving it can
    abort the process at exit: 'terminate called without an active exception')."""
    from moe_ep_plugin.deepspeed import destroy_buffers

    for engine in engines:
        engine.destroy()
    destroy_buffers()
    gc.collect()
    dist.barrier()


class Expert(torch.nn.Module):
    """A small two-layer MLP expert with biases (DeepSpeed deep-copies it per local expert)."""

    def __init__(self, hidden: int, ffn: int = 24) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(hidden, ffn)
        self.fc2 = torch.nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def make_modules(num_experts: int, ep_size: int, k: int, stock_overrides: dict | None = None, **ds_kwargs):
    """Stock DeepSpeed MoE, the plugin MoE (``expert_compute='grouped'``), and a stock MoE converted with
    ``convert_moe`` (``expert_compute='loop'``) after its groups were set, all with identical weights (gate shared
    by all ranks, experts different on every rank). ``stock_overrides``: DeepSpeed arguments of the stock layer
    alone (an equivalent stock setting where DeepSpeed fails on the plugin's)."""
    from moe_ep_plugin.deepspeed import MoE, PluginMOELayer, convert_moe

    torch.manual_seed(0)
    stock = deepspeed.moe.layer.MoE(H, Expert(H), num_experts, ep_size, k, **{**ds_kwargs, **(stock_overrides or {})})
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    with torch.no_grad():
        for p in stock.deepspeed_moe.experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        stock.deepspeed_moe.gate.wg.weight.mul_(4.0)  # sharper gate: distinct top-k, uneven loads
    plugin = MoE(H, Expert(H), num_experts, ep_size, k, **ds_kwargs, expert_compute="grouped")
    converted = deepspeed.moe.layer.MoE(H, Expert(H), num_experts, ep_size, k, **ds_kwargs)
    for moe in (plugin, converted):
        moe.load_state_dict(stock.state_dict())
    for moe in (stock, plugin, converted):
        moe.set_deepspeed_parallelism()
    old_layer = converted.deepspeed_moe
    assert convert_moe(converted, expert_compute="loop") == [""]
    layer = converted.deepspeed_moe
    assert isinstance(layer, PluginMOELayer) and isinstance(plugin.deepspeed_moe, PluginMOELayer)
    assert layer.gate is old_layer.gate and layer.experts is old_layer.experts and layer.ep_group is old_layer.ep_group
    for moe in (plugin, converted):  # the checkpoint layout: DeepSpeed's names, shapes and dtypes
        assert {n: (t.shape, t.dtype) for n, t in moe.state_dict().items()} == {
            n: (t.shape, t.dtype) for n, t in stock.state_dict().items()
        }
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


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal up to fp32 summation order: ``|a - e| <= TOL * max|e|`` (sums of many terms cancel in places)."""
    scale = max(float(expected.abs().max()), 1.0) if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, atol=TOL * scale, rtol=0, msg=lambda m: f"{what}: {m}")


def assert_same(stock_res, plugin_res, what: str) -> None:
    out_s, laux_s, cnt_s, dx_s, g_s = stock_res
    out_p, laux_p, cnt_p, dx_p, g_p = plugin_res
    assert_close(out_p, out_s, f"{what} output")
    assert_close(dx_p, dx_s, f"{what} x.grad")
    assert torch.equal(laux_p, laux_s), f"{what}: l_aux {laux_p} != {laux_s}"
    assert torch.equal(cnt_p, cnt_s), f"{what}: exp_counts {cnt_p} != {cnt_s}"
    assert g_p.keys() == g_s.keys()
    for name in g_s:
        assert_close(g_p[name], g_s[name], f"{what} {name}")


@contextlib.contextmanager
def count_grouped_calls():
    """How often the layers ran their experts as one grouped FFN."""
    from moe_ep_plugin.deepspeed.ffn import GroupedFFN

    original, calls = GroupedFFN.__call__, {"grouped": 0}

    def counting(self, rows, counts):
        calls["grouped"] += 1
        return original(self, rows, counts)

    GroupedFFN.__call__ = counting
    try:
        yield calls
    finally:
        GroupedFFN.__call__ = original


@contextlib.contextmanager
def count_dispatched_rows():
    """Rows the plugin's dispatch carries to this rank, and the rows it should: one per (token of any rank,
    this rank) pair where the token chose at least one (kept) expert of this rank — no copy per expert on the
    wire (the expert-major layout copies rows per expert only on the receiving rank)."""
    import moe_ep_plugin.autograd as ep_autograd

    original, rows = ep_autograd.dispatch_experts, {"received": 0, "expected": 0}

    def counting(buffer, x, topk_idx, topk_weights, num_experts, **kwargs):
        out = original(buffer, x, topk_idx, topk_weights, num_experts, **kwargs)
        ranks = buffer.group_size
        dest = torch.where(topk_idx >= 0, topk_idx // (num_experts // ranks), ranks)
        hits = torch.zeros(x.shape[0], ranks + 1, dtype=torch.int64).scatter_(1, dest, 1)[:, :ranks].sum(0)
        dist.all_reduce(hits, group=buffer.group)
        rows["received"] += out[3].num_recv_tokens
        rows["expected"] += int(hits[buffer.rank])
        return out

    ep_autograd.dispatch_experts = counting
    try:
        yield rows
    finally:
        ep_autograd.dispatch_experts = original


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
            rng = torch.get_rng_state()  # the random draws after the layer: later gates' noise, dropout
            with count_dispatched_rows() as rows, count_grouped_calls() as calls:
                assert_same(expected, run_step(plugin, x, grad_out, 7 + step, used), f"rank {rank} {case} step {step}")
            assert torch.equal(torch.get_rng_state(), rng), f"rank {rank} {case}: other random draws than DeepSpeed's"
            assert rows["received"] == rows["expected"], f"rank {rank} {case}: {rows}"
            assert calls["grouped"] == 1, f"rank {rank} {case}: the grouped experts did not run"
            with count_grouped_calls() as calls:
                assert_same(expected, run_step(converted, x, grad_out, 7 + step, used), f"rank {rank} {case} converted")
            assert calls["grouped"] == 0, f"rank {rank} {case}: expert_compute='loop' ran the grouped experts"
    ds_finish()


DROPLESS_CASES = [
    # k=1: top1gating, random token selection on (it cannot drop without a capacity limit), Gumbel-noisy argmax
    dict(num_experts=8, ep_size=2, k=1, drop_tokens=False, min_capacity=0, noisy_gate_policy="RSample", tokens=24),
    # used_token masks tokens out (k=1 only), with capacity drops
    dict(
        num_experts=8,
        ep_size=2,
        k=1,
        drop_tokens=True,
        capacity_factor=1.0,
        min_capacity=0,
        tokens=24,
        noisy_gate_policy="Jitter",
        used_token=True,
    ),
    # used_token without drops: DeepSpeed fails on it, so the stock side keeps every token by a capacity of all
    # tokens (capacity_factor = E) instead
    dict(
        num_experts=8,
        ep_size=2,
        k=1,
        drop_tokens=False,
        min_capacity=0,
        tokens=24,
        noisy_gate_policy="RSample",
        used_token=True,
        stock_overrides=dict(drop_tokens=True, capacity_factor=8.0),
    ),
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
    cases = [
        dict(num_experts=4, ep_size=1, k=2, drop_tokens=False, use_residual=True, tokens=12),  # PR-MoE
        dict(num_experts=8, ep_size=2, k=2, drop_tokens=False, tokens=12),  # 2 EP groups x 2 data-parallel
        dict(num_experts=8, ep_size=4, k=3, drop_tokens=False, tokens=12),
    ]
    launch.spawn(_worker_matches_stock, 4, (cases,))


def gather_experts(moe) -> list[torch.nn.Module]:
    """Every rank's local experts, in global expert order, as fresh fp32 copies on this rank."""
    local = [{n: t.float() for n, t in e.state_dict().items()} for e in moe.deepspeed_moe.experts.deepspeed_experts]
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, local)
    experts = []
    for state in (s for rank_states in per_rank for s in rank_states):
        expert = Expert(state["fc1.weight"].shape[1], state["fc1.weight"].shape[0])
        expert.load_state_dict(state)
        experts.append(expert)
    return experts


def loop_reference(
    x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, experts: list[torch.nn.Module]
) -> torch.Tensor:
    """``y[s] = Σ_k w[s, k] · expert_{idx[s, k]}(x[s])``, one token and one route at a time (-1 skipped)."""
    rows = []
    for s in range(x.shape[0]):
        acc = torch.zeros(x.shape[1])
        for j in range(topk_idx.shape[1]):
            e = int(topk_idx[s, j])
            if e >= 0:
                acc = acc + topk_weights[s, j] * experts[e](x[s : s + 1].float())[0]
        rows.append(acc)
    if not rows:  # no tokens: an empty result still tied to x and the gate, so their gradients are zeros
        return x.float() * 0 + topk_weights.sum() * 0
    return torch.stack(rows)


def check_against_loop(moe, x: torch.Tensor, tol: float, what: str, fp8_wire: bool = False) -> None:
    """Output, x.grad, gate and expert gradients of the plugin layer vs. the loop on gathered fp32 expert copies.

    ``tol``: elementwise (atol = rtol) for fp32; with ``fp8_wire`` the experts see the FP8 round trip of ``x``
    and compute in BF16, so the bound is on the relative error norm ``|a - b| / |b|`` instead.
    """
    from moe_ep_plugin.deepspeed.routing import route
    from moe_ep_plugin.ops import fp8

    def close(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
        actual = actual.float()
        if fp8_wire:
            err = float((actual - expected).detach().norm() / expected.norm().clamp_min(1e-12))
            assert err < tol, f"{what} {name}: relative error {err:.3g} >= {tol}"
        else:
            torch.testing.assert_close(actual, expected, atol=tol, rtol=tol, msg=lambda m: f"{what} {name}: {m}")

    layer = moe.deepspeed_moe
    experts = gather_experts(moe)
    gate_ref = copy.deepcopy(layer.gate.wg).float()
    grad_out = torch.randn(x.shape)
    moe.zero_grad(set_to_none=True)
    xp = x.clone().requires_grad_(True)
    out, _, _ = moe(xp)
    (out.float() * grad_out).sum().backward()

    layer.gate.wg, live_wg = gate_ref, layer.gate.wg  # route the reference through the copied gate weight
    xr = x.float().requires_grad_(True)
    routes = route(layer.gate, xr, None)
    layer.gate.wg = live_wg
    x_expert = xr
    if fp8_wire:  # what the experts receive; the gradient passes straight through the quantizer
        x_expert = xr + (fp8.dequantize(*fp8.quantize(x), dtype=torch.float32) - xr).detach()
    ref = loop_reference(x_expert, routes.topk_idx, routes.topk_weights, experts)
    (ref * grad_out).sum().backward()
    close(out, ref, "output")
    close(xp.grad, xr.grad, "x.grad")
    close(live_wg.weight.grad, gate_ref.weight.grad, "gate grad")
    for ref_expert in experts:  # an expert's gradient gathers every rank's tokens (same order on all ranks)
        for p in ref_expert.parameters():
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad
            dist.all_reduce(p.grad)
    first = dist.get_rank() * layer.num_local_experts
    for i, expert in enumerate(layer.experts.deepspeed_experts):
        for (name, p), ref_p in zip(expert.named_parameters(), experts[first + i].parameters(), strict=False):
            close(p.grad, ref_p.grad, f"expert {first + i} {name}")


def _worker_edge_cases() -> None:
    from moe_ep_plugin.deepspeed import MoE

    ds_init()
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    with pytest.raises(ValueError, match="^ep_size: 4 does not divide the world size 2"):
        MoE(H, Expert(H), 8, 4, 2)

    # group-limited sigmoid routing with an expert bias; rank 1 has no tokens at all
    torch.manual_seed(0)
    moe = MoE(
        H,
        Expert(H),
        8,
        2,
        4,
        router="group_limited",
        score_function="sigmoid",
        num_groups=4,
        group_topk=2,
        scaling_factor=2.0,
        expert_bias_rate=1e-3,
    )
    moe.set_deepspeed_parallelism()
    with torch.no_grad():
        moe.deepspeed_moe.gate.expert_bias.copy_(torch.linspace(-0.2, 0.2, 8))
    check_against_loop(
        moe, torch.randn(10 if rank == 0 else 0, H, generator=gen), 1e-5, f"rank {rank} group-limited, rank 1 empty"
    )

    # every token to expert 0 (a zero gate: all logits tie, argmax takes the first), uneven token counts
    torch.manual_seed(1)
    moe = MoE(H, Expert(H), 4, 2, 1, min_capacity=0)
    moe.set_deepspeed_parallelism()
    with torch.no_grad():
        moe.deepspeed_moe.gate.wg.weight.zero_()
    x = torch.randn(5 + 4 * rank, H, generator=gen)
    _, _, counts = moe(x)
    assert counts.tolist() == [x.shape[0], 0, 0, 0]
    check_against_loop(moe, x, 1e-5, f"rank {rank} all to expert 0")

    # FP8 dispatch of BF16 activations (hidden 128): tokens arrive as dequantized FP8
    torch.manual_seed(2)
    moe = MoE(128, Expert(128, 32), 4, 2, 2, fp8_dispatch=True, top2_2nd_expert_sampling=False)
    with torch.no_grad():  # O(1) expert outputs: at default init the top-2 gate gradient is ~1e-6, BF16 noise
        for p in moe.deepspeed_moe.experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    moe.to(torch.bfloat16).set_deepspeed_parallelism()
    check_against_loop(
        moe, torch.randn(12, 128, generator=gen).to(torch.bfloat16), 2e-2, f"rank {rank} fp8 dispatch", fp8_wire=True
    )

    # the aux-loss-free bias step: the same step on every rank, towards the under-loaded experts
    torch.manual_seed(3)
    moe = MoE(H, Expert(H), 8, 2, 2, router="group_limited", score_function="sigmoid", expert_bias_rate=0.01)
    moe.set_deepspeed_parallelism()
    _, _, counts = moe(torch.randn(16, H, generator=gen))
    total = counts.float().clone()
    dist.all_reduce(total)
    from moe_ep_plugin.deepspeed import update_expert_biases

    assert update_expert_biases(moe) == 1
    bias = moe.deepspeed_moe.gate.expert_bias
    assert torch.equal(bias, 0.01 * torch.sign(total.mean() - total))
    ds_finish()


def test_edge_cases_against_loop_reference():
    launch.spawn(_worker_edge_cases, 2)
