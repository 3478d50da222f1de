"""Gating: Megatron-Core equality, plain-loop references, load-balancing helpers, traffic report, errors."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from moe_ep_plugin import gating

try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer.moe import moe_utils as mc_utils
    MC_SKIP = ""
except Exception as exc:  # noqa: BLE001 - any import failure means "not available here"
    mc_utils = None
    MC_SKIP = f"megatron-core not importable: {type(exc).__name__}: {exc}"

needs_mc = pytest.mark.skipif(mc_utils is None, reason=MC_SKIP or "megatron-core available")


def _logits(seed: int, tokens: int, experts: int, dtype: torch.dtype, ties: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if ties:  # few distinct values: exercises tie-breaking in every top-k
        return torch.randint(-3, 3, (tokens, experts), generator=g).to(dtype)
    return (torch.randn(tokens, experts, generator=g) * 2).to(dtype)


def _bias(seed: int, experts: int) -> torch.Tensor:
    return torch.randn(experts, generator=torch.Generator().manual_seed(seed + 1000)) * 0.1


# (experts, num_groups, group_topk, topk)
GROUP_CONFIGS = [
    (16, None, None, 1),
    (16, None, None, 4),
    (8, None, None, 8),
    (16, 8, 3, 4),
    (16, 4, 2, 4),
    (64, 8, 4, 8),
    (32, 8, 2, 6),
    (64, 8, 1, 2),
    (32, 4, 4, 5),
]
ROUTERS = [("softmax", False, False), ("softmax", True, False), ("sigmoid", False, False), ("sigmoid", False, True)]


def _router_cases():
    for experts, groups, group_topk, topk in GROUP_CONFIGS:
        for score_function, pre, bias in ROUTERS:
            if score_function == "softmax" and topk == 1 and not pre:
                continue
            yield experts, groups, group_topk, topk, score_function, pre, bias


@needs_mc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(_router_cases()), ids=lambda c: "-".join(map(str, c)))
def test_topk_routing_equals_megatron(case, dtype):
    experts, groups, group_topk, topk, score_function, pre, bias = case
    for seed, scale, ties in [(0, None, False), (1, 2.5, False), (2, None, True), (3, 16.0, True)]:
        logits = _logits(seed, 41, experts, dtype, ties)
        kw = dict(
            score_function=score_function,
            use_pre_softmax=pre,
            num_groups=groups,
            group_topk=group_topk,
            scaling_factor=scale,
            expert_bias=_bias(seed, experts) if bias else None,
        )
        want_probs, want_map = mc_utils.topk_routing_with_score_function(logits, topk, **kw)
        probs, routing_map = gating.topk_routing(logits, topk, **kw)
        assert probs.dtype == dtype and routing_map.dtype == torch.bool
        assert torch.equal(probs, want_probs) and torch.equal(routing_map, want_map), (seed, scale, ties)
        # The sparse form names the same experts with the same weights.
        weights, idx = gating.group_limited_topk(logits, topk, **kw)
        assert weights.dtype == torch.float32 and idx.dtype == torch.int64 and idx.shape == (41, topk)
        assert torch.equal(torch.zeros_like(routing_map).scatter(1, idx, True), routing_map)
        assert torch.equal(weights, probs.gather(1, idx).float())


@needs_mc
def test_gradients_equal_megatron():
    logits = _logits(7, 33, 32, torch.float32).requires_grad_()
    upstream = torch.randn(33, 32, generator=torch.Generator().manual_seed(8))
    for kw in [
        dict(score_function="sigmoid", num_groups=4, group_topk=2, expert_bias=_bias(7, 32), scaling_factor=2.5),
        dict(score_function="softmax", use_pre_softmax=False, num_groups=8, group_topk=4),
    ]:
        (ours,) = torch.autograd.grad((gating.topk_routing(logits, 8, **kw)[0] * upstream).sum(), logits)
        (theirs,) = torch.autograd.grad(
            (mc_utils.topk_routing_with_score_function(logits, 8, **kw)[0] * upstream).sum(), logits
        )
        assert torch.equal(ours, theirs)


def _plain_route_row(
    row: list[float], topk: int, score_function: str, pre: bool, groups, group_topk, scale, bias
) -> dict[int, float]:
    """One token of Megatron's router in plain Python floats: {expert: weight}."""
    experts = len(row)
    if score_function == "softmax" and pre:
        z = sum(math.exp(v) for v in row)
        scores = [math.exp(v) / z for v in row]
    elif score_function == "softmax":
        scores = list(row)
    else:
        scores = [1 / (1 + math.exp(-v)) for v in row]
    select = [s + (bias[e] if bias is not None else 0.0) for e, s in enumerate(scores)]
    allowed = list(range(experts))
    if group_topk is not None:
        size = experts // groups
        group_score = [
            sum(sorted(select[j * size : (j + 1) * size], reverse=True)[: topk // group_topk]) for j in range(groups)
        ]
        kept = sorted(range(groups), key=lambda j: -group_score[j])[:group_topk]
        allowed = [e for e in allowed if e // size in kept]
    chosen = sorted(allowed, key=lambda e: -select[e])[:topk]
    if score_function == "softmax" and not pre:
        z = sum(math.exp(row[e]) for e in chosen)
        weights = {e: math.exp(row[e]) / z for e in chosen}
    else:
        weights = {e: scores[e] for e in chosen}
        if score_function == "sigmoid" and topk > 1:
            total = sum(weights.values())
            weights = {e: w / total for e, w in weights.items()}
    return {e: w * (scale or 1.0) for e, w in weights.items()}


@pytest.mark.parametrize("case", list(_router_cases()), ids=lambda c: "-".join(map(str, c)))
def test_topk_routing_matches_plain_loop(case):
    experts, groups, group_topk, topk, score_function, pre, bias = case
    logits = _logits(11, 23, experts, torch.float64)  # continuous values: no ties
    b = _bias(11, experts).double() if bias else None
    probs, routing_map = gating.topk_routing(
        logits,
        topk,
        score_function=score_function,
        use_pre_softmax=pre,
        num_groups=groups,
        group_topk=group_topk,
        scaling_factor=1.5,
        expert_bias=b,
    )
    for t in range(logits.shape[0]):
        want = _plain_route_row(
            logits[t].tolist(), topk, score_function, pre, groups, group_topk, 1.5, None if b is None else b.tolist()
        )
        assert set(routing_map[t].nonzero().flatten().tolist()) == set(want)
        for e, w in want.items():
            assert probs[t, e].item() == pytest.approx(w, rel=1e-6)  # Megatron computes scores in fp32
        if group_topk is not None:  # the group limit holds
            assert int(routing_map[t].view(groups, -1).any(dim=1).sum()) <= group_topk


def test_zero_tokens_and_one_hot_expert():
    empty = torch.zeros(0, 16)
    probs, routing_map = gating.topk_routing(empty, 4, score_function="sigmoid", num_groups=4, group_topk=2)
    assert probs.shape == (0, 16) and routing_map.shape == (0, 16)
    weights, idx = gating.group_limited_topk(empty, 4, score_function="sigmoid", num_groups=4, group_topk=2)
    assert weights.shape == (0, 4) and idx.shape == (0, 4)
    # Every token prefers expert 5 by far: it gets all 9 tokens.
    logits = _logits(3, 9, 16, torch.float32)
    logits[:, 5] = 50.0
    _, idx = gating.group_limited_topk(logits, 2, use_pre_softmax=True, num_groups=4, group_topk=1)
    counts = gating.tokens_per_expert(idx, 16)
    assert counts[5] == 9 and counts.sum() == 18 and bool((idx // 4 == 1).all())


def _plain_dsv3_row(row: list[float], topk: int, groups, group_topk, scale: float, bias, score_function: str):
    if score_function == "sigmoid":
        scores = [1 / (1 + math.exp(-v)) for v in row]
    else:
        z = sum(math.exp(v) for v in row)
        scores = [math.exp(v) / z for v in row]
    select = [s + (bias[e] if bias is not None else 0.0) for e, s in enumerate(scores)]
    allowed = list(range(len(row)))
    if group_topk is not None:
        size = len(row) // groups
        members = [select[j * size : (j + 1) * size] for j in range(groups)]
        group_score = [max(m) if bias is None else sum(sorted(m, reverse=True)[:2]) for m in members]
        kept = sorted(range(groups), key=lambda j: -group_score[j])[:group_topk]
        allowed = [e for e in allowed if e // size in kept]
    chosen = sorted(allowed, key=lambda e: -select[e])[:topk]
    total = sum(scores[e] for e in chosen) if score_function == "sigmoid" else 1.0
    return [(e, scores[e] / total * scale) for e in chosen]


@pytest.mark.parametrize("score_function", ["sigmoid", "softmax"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("experts,groups,group_topk,topk", [(64, 8, 4, 8), (32, 4, 2, 3), (16, None, None, 4)])
def test_deepseek_v3_gate_matches_plain_loop(score_function, bias, experts, groups, group_topk, topk):
    logits = _logits(21, 19, experts, torch.float64)
    b = _bias(21, experts).double() if bias else None
    weights, idx = gating.deepseek_v3_gate(
        logits,
        topk,
        num_groups=groups,
        group_topk=group_topk,
        route_scale=2.5,
        expert_bias=b,
        score_function=score_function,
    )
    assert weights.dtype == torch.float32 and idx.dtype == torch.int64
    for t in range(logits.shape[0]):
        want = _plain_dsv3_row(
            logits[t].tolist(), topk, groups, group_topk, 2.5, None if b is None else b.tolist(), score_function
        )
        assert idx[t].tolist() == [e for e, _ in want]  # ordered by descending selection score
        assert weights[t].tolist() == pytest.approx([w for _, w in want], rel=1e-6)


@needs_mc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("experts,groups,group_topk,topk", [(256, 8, 4, 8), (64, 8, 2, 4), (32, 4, 3, 6)])
def test_deepseek_v3_gate_equals_megatron_with_bias(dtype, experts, groups, group_topk, topk):
    for seed in range(3):
        logits = _logits(seed, 64, experts, dtype)
        bias = _bias(seed, experts)
        weights, idx = gating.deepseek_v3_gate(
            logits, topk, num_groups=groups, group_topk=group_topk, route_scale=2.5, expert_bias=bias
        )
        want, _ = mc_utils.topk_routing_with_score_function(
            logits,
            topk,
            num_groups=groups,
            group_topk=group_topk,
            scaling_factor=2.5,
            score_function="sigmoid",
            expert_bias=bias,
        )
        assert torch.equal(torch.zeros_like(want).scatter(1, idx, weights.to(dtype)), want)


def test_deepseek_v3_group_score_is_max_without_bias():
    # Group 0 has the single best expert, group 1 the best pair: DeepSeek-V3 (max) keeps group 0,
    # Megatron's rule (sum of the top topk // group_topk = 2) keeps group 1.
    logits = torch.tensor([[3.0, -4.0, 2.0, 2.0]])
    _, idx = gating.deepseek_v3_gate(logits, 2, num_groups=2, group_topk=1)
    assert sorted(idx[0].tolist()) == [0, 1]
    _, idx = gating.group_limited_topk(logits, 2, score_function="sigmoid", num_groups=2, group_topk=1)
    assert sorted(idx[0].tolist()) == [2, 3]


def test_update_expert_bias_by_hand():
    bias = torch.tensor([0.0, 0.1, -0.2, 0.3])
    before = bias.data_ptr()
    out = gating.update_expert_bias(bias, torch.tensor([5, 1, 3, 3]), 1e-3)  # mean load 3
    assert out is bias and bias.data_ptr() == before
    assert torch.equal(bias, torch.tensor([0.0 - 1e-3, 0.1 + 1e-3, -0.2, 0.3]))
    # Per-layer rows [layers, E], float counts (e.g. averaged over steps): the mean runs per row.
    stacked = torch.zeros(2, 3)
    gating.update_expert_bias(stacked, torch.tensor([[1.0, 2.0, 3.0], [4.0, 4.0, 4.0]]), 0.5)
    assert torch.equal(stacked, torch.tensor([[0.5, 0.0, -0.5], [0.0, 0.0, 0.0]]))


def _plain_switch(scores: torch.Tensor, routing_map: torch.Tensor, topk: int, coeff: float) -> float:
    tokens, experts = scores.shape
    loss = 0.0
    for e in range(experts):
        f = sum(bool(routing_map[t, e]) for t in range(tokens)) / (tokens * topk)
        p = sum(float(scores[t, e]) for t in range(tokens)) / tokens
        loss += f * p
    return loss * experts * coeff


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_aux_losses_match_plain_loop(score_function):
    seq_len, batch, experts, topk = 12, 3, 8, 2
    logits = _logits(31, seq_len * batch, experts, torch.float32)
    scores, routing_map = gating.aux_loss_scores(logits, topk, score_function=score_function)
    assert torch.equal(routing_map.sum(dim=1), torch.full((seq_len * batch,), topk))
    loss = gating.switch_aux_loss(scores, gating.tokens_per_expert(routing_map, experts), topk=topk, coeff=0.01)
    assert loss.item() == pytest.approx(_plain_switch(scores, routing_map, topk, 0.01), rel=1e-5)
    seq = gating.sequence_aux_loss(scores, routing_map, topk=topk, batch_size=batch, coeff=0.01)
    # Sequence b holds tokens s * batch + b; the loss is the mean of the per-sequence switch losses.
    want = sum(_plain_switch(scores[b::batch], routing_map[b::batch], topk, 0.01) for b in range(batch)) / batch
    assert seq.item() == pytest.approx(want, rel=1e-5)
    # Differentiable in the scores.
    logits.requires_grad_()
    scores, routing_map = gating.aux_loss_scores(logits, topk, score_function=score_function)
    gating.sequence_aux_loss(scores, routing_map, topk=topk, batch_size=batch).backward()
    assert logits.grad is not None and bool(logits.grad.abs().sum() > 0)


@needs_mc
@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_aux_losses_equal_megatron(score_function):
    seq_len, batch, experts, topk = 16, 4, 32, 4
    logits = _logits(41, seq_len * batch, experts, torch.float32)
    scores, routing_map = gating.aux_loss_scores(logits, topk, score_function=score_function)
    want_map, want_scores = mc_utils.compute_routing_scores_for_aux_loss(logits, topk, score_function)
    assert torch.equal(scores, want_scores) and torch.equal(routing_map, want_map)
    counts = routing_map.sum(dim=0)
    want = mc_utils.switch_load_balancing_loss_func(scores, counts, seq_len * batch, topk, experts, 0.01)
    assert torch.equal(gating.switch_aux_loss(scores, counts, topk=topk, coeff=0.01), want)
    # Megatron's _apply_seq_aux_loss on one rank: columns (b, e), S tokens, divided by the batch size.
    want_seq = (
        mc_utils.switch_load_balancing_loss_func(
            scores.reshape(seq_len, -1), routing_map.reshape(seq_len, -1).sum(dim=0), seq_len, topk, experts, 0.01
        )
        / batch
    )
    assert torch.equal(gating.sequence_aux_loss(scores, routing_map, topk=topk, batch_size=batch, coeff=0.01), want_seq)


def test_tokens_per_expert_matches_plain_loop():
    g = torch.Generator().manual_seed(51)
    idx = torch.randint(-1, 12, (30, 3), generator=g)
    want = [sum(int(v == e) for v in idx.flatten().tolist()) for e in range(12)]
    assert gating.tokens_per_expert(idx, 12).tolist() == want
    assert gating.tokens_per_expert(idx.int(), 12).tolist() == want
    routing_map = torch.rand(30, 12, generator=g) > 0.7
    assert gating.tokens_per_expert(routing_map, 12).tolist() == [int(routing_map[:, e].sum()) for e in range(12)]
    assert gating.tokens_per_expert(torch.zeros(0, 3, dtype=torch.long), 12).tolist() == [0] * 12


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4])
def test_rank_reach_matches_plain_loop(num_ranks):
    experts = 12
    idx = torch.randint(-1, experts, (40, 5), generator=torch.Generator().manual_seed(61 + num_ranks))
    idx[0] = -1  # a token going nowhere
    per_rank = experts // num_ranks
    want = [len({e // per_rank for e in row if e >= 0}) for row in idx.tolist()]
    assert gating.rank_reach(idx, experts, num_ranks).tolist() == want
    assert want[0] == 0


def test_traffic_saving_reports_rows():
    # DeepSeek-V3 shape: 256 experts on 8 nodes, 4 nodes per token, top-8.
    logits = _logits(71, 512, 256, torch.float32)
    bias = _bias(71, 256)
    report = gating.traffic_saving(logits, 8, 8, score_function="sigmoid", num_groups=8, group_topk=4, expert_bias=bias)
    _, limited = gating.group_limited_topk(
        logits, 8, score_function="sigmoid", num_groups=8, group_topk=4, expert_bias=bias
    )
    _, plain = gating.group_limited_topk(logits, 8, score_function="sigmoid", expert_bias=bias)
    assert report.rows_sent == int(gating.rank_reach(limited, 256, 8).sum())
    assert report.rows_unlimited == int(gating.rank_reach(plain, 256, 8).sum())
    assert report.max_reach <= 4 < int(gating.rank_reach(plain, 256, 8).max())
    assert report.saving == pytest.approx(1 - report.rows_sent / report.rows_unlimited)
    assert 0 < report.saving < 1
    # No group limit: nothing saved.
    same = gating.traffic_saving(logits, 8, 8, score_function="sigmoid")
    assert same.rows_sent == same.rows_unlimited and same.saving == 0.0


E16 = torch.zeros(4, 16)
ERROR_CASES = [
    (lambda: gating.topk_routing([[1.0]], 1), TypeError, "logits"),
    (lambda: gating.topk_routing(torch.zeros(4, 16, dtype=torch.long), 2), TypeError, "logits"),
    (lambda: gating.topk_routing(torch.zeros(16), 2), ValueError, "logits"),
    (lambda: gating.topk_routing(E16, 0), ValueError, "topk"),
    (lambda: gating.topk_routing(E16, 17), ValueError, "topk"),
    (lambda: gating.topk_routing(E16, 2.0), TypeError, "topk"),
    (lambda: gating.topk_routing(E16, 2, score_function="relu"), ValueError, "score_function"),
    (lambda: gating.topk_routing(E16, 1), ValueError, "use_pre_softmax"),
    (lambda: gating.topk_routing(E16, 4, num_groups=5, group_topk=2), ValueError, "num_groups"),
    (lambda: gating.topk_routing(E16, 4, group_topk=2), ValueError, "group_topk"),
    (lambda: gating.topk_routing(E16, 4, num_groups=4, group_topk=5), ValueError, "group_topk"),
    (lambda: gating.topk_routing(E16, 2, num_groups=4, group_topk=3), ValueError, "group_topk"),
    (lambda: gating.topk_routing(E16, 9, num_groups=4, group_topk=2), ValueError, "topk"),
    (lambda: gating.topk_routing(E16, 2, expert_bias=torch.zeros(16)), ValueError, "expert_bias"),
    (
        lambda: gating.topk_routing(E16, 2, score_function="sigmoid", expert_bias=torch.zeros(15)),
        ValueError,
        "expert_bias",
    ),
    (
        lambda: gating.topk_routing(E16, 2, score_function="sigmoid", expert_bias=torch.zeros(16, dtype=torch.long)),
        TypeError,
        "expert_bias",
    ),
    (lambda: gating.topk_routing(E16, 2, scaling_factor=-1.0), ValueError, "scaling_factor"),
    (lambda: gating.group_limited_topk(E16, 2, use_pre_softmax=1), TypeError, "use_pre_softmax"),
    (lambda: gating.deepseek_v3_gate(E16, 2, route_scale=0), ValueError, "route_scale"),
    (
        lambda: gating.deepseek_v3_gate(E16, 2, num_groups=16, group_topk=2, expert_bias=torch.zeros(16)),
        ValueError,
        "num_groups",
    ),
    (
        lambda: gating.update_expert_bias(torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4), 0.1),
        TypeError,
        "expert_bias",
    ),
    (lambda: gating.update_expert_bias(torch.zeros(4), torch.zeros(5), 0.1), ValueError, "tokens_per_expert"),
    (
        lambda: gating.update_expert_bias(torch.zeros(4), torch.zeros(4, dtype=torch.bool), 0.1),
        TypeError,
        "tokens_per_expert",
    ),
    (lambda: gating.update_expert_bias(torch.zeros(4), torch.zeros(4), -0.1), ValueError, "rate"),
    (lambda: gating.tokens_per_expert(torch.tensor([[0, 16]]), 16), ValueError, "routing"),
    (lambda: gating.tokens_per_expert(torch.zeros(2, 15, dtype=torch.bool), 16), ValueError, "routing"),
    (lambda: gating.tokens_per_expert(torch.zeros(2, 2), 16), TypeError, "routing"),
    (lambda: gating.rank_reach(torch.zeros(2, 2, dtype=torch.long), 16, 3), ValueError, "num_ranks"),
    (lambda: gating.rank_reach(torch.tensor([[-2, 0]]), 16, 4), ValueError, "topk_idx"),
    (lambda: gating.rank_reach(torch.zeros(2, 2), 16, 4), TypeError, "topk_idx"),
    (lambda: gating.aux_loss_scores(E16, 2, score_function="tanh"), ValueError, "score_function"),
    (lambda: gating.switch_aux_loss(E16, torch.zeros(15), topk=2), ValueError, "tokens_per_expert"),
    (
        lambda: gating.sequence_aux_loss(E16, torch.zeros(4, 16, dtype=torch.bool), topk=2, batch_size=3),
        ValueError,
        "batch_size",
    ),
    (lambda: gating.sequence_aux_loss(E16, torch.zeros(4, 16), topk=2, batch_size=2), ValueError, "routing_map"),
]


@pytest.mark.parametrize("call,error,name", ERROR_CASES, ids=[f"{i}-{c[2]}" for i, c in enumerate(ERROR_CASES)])
def test_bad_inputs_raise_naming_the_argument(call, error, name):
    with pytest.raises(error, match=rf"^{name}:"):
        call()
