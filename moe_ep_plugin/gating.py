"""Router gating: (group-limited) top-k with Megatron-Core semantics, the DeepSeek-V3 gate, load balancing.

T = tokens, E = experts, K = top-k, G = expert groups (``num_groups``), g = groups kept per token
(``group_topk``). Experts are grouped contiguously: group ``j`` holds experts ``[j*E/G, (j+1)*E/G)``, so with
G equal to the EP size (or the node count) a group is one rank's (one node's) experts.

``topk_routing`` equals Megatron-Core 0.16.1's unfused ``topk_routing_with_score_function`` bit for bit: the same
sequence of rounding steps (scores rounded to the logits dtype, sums over the top-k in descending-score order,
``+ 1e-20`` in the sigmoid normalisation) and the same ``torch.topk`` calls, so ties break identically too.
Later Megatron releases keep sigmoid scores in fp32 until the end; for fp32 logits that changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import positive_int

SCORE_FUNCTIONS = ("softmax", "sigmoid")


# --------------------------------------------------------------------------------------------------- validation


def _check_2d_float(t: object, name: str) -> tuple[int, int]:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got {t.dtype}")
    if t.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D [tokens, experts] tensor, got shape {tuple(t.shape)}")
    return t.shape[0], t.shape[1]


def _check_router_inputs(logits: object, topk: object, score_function: object) -> int:
    """Checks shared by every router entry point; returns E."""
    _, num_experts = _check_2d_float(logits, "logits")
    positive_int(topk, "topk")
    if topk > num_experts:
        raise ValueError(f"topk: must be <= the expert count {num_experts}, got {topk}")
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(f"score_function: expected one of {SCORE_FUNCTIONS}, got {score_function!r}")
    return num_experts


def _check_groups(num_experts: int, topk: int, num_groups: int | None, group_topk: int | None) -> None:
    """Group limiting is on when ``group_topk`` is set (Megatron ignores ``num_groups`` alone)."""
    if num_groups is not None:
        positive_int(num_groups, "num_groups")
        if num_experts % num_groups != 0:
            raise ValueError(f"num_groups: the expert count {num_experts} is not divisible by num_groups={num_groups}")
    if group_topk is None:
        return
    positive_int(group_topk, "group_topk")
    if num_groups is None:
        raise ValueError("group_topk: group-limited routing needs num_groups as well")
    if group_topk > num_groups:
        raise ValueError(f"group_topk: must be <= num_groups={num_groups}, got {group_topk}")
    if topk < group_topk:
        # Groups are scored by their top-(topk // group_topk) experts; 0 experts would make every group tie.
        raise ValueError(f"group_topk: must be <= topk={topk}, got {group_topk}")
    allowed = group_topk * (num_experts // num_groups)
    if topk > allowed:
        raise ValueError(
            f"topk: {topk} exceeds the {allowed} experts in group_topk={group_topk} of num_groups={num_groups} groups"
        )


def _check_bias(expert_bias: object, logits: torch.Tensor, num_experts: int) -> None:
    if not isinstance(expert_bias, torch.Tensor):
        raise TypeError(f"expert_bias: expected a torch.Tensor, got {type(expert_bias).__name__}")
    if not expert_bias.is_floating_point():
        raise TypeError(f"expert_bias: expected a floating-point tensor, got {expert_bias.dtype}")
    if tuple(expert_bias.shape) != (num_experts,):
        raise ValueError(f"expert_bias: expected shape ({num_experts},), got {tuple(expert_bias.shape)}")
    if expert_bias.device != logits.device:
        raise ValueError(f"expert_bias: on {expert_bias.device}, logits on {logits.device}")


def _validate_routing(
    logits: torch.Tensor,
    topk: int,
    score_function: str,
    use_pre_softmax: bool,
    num_groups: int | None,
    group_topk: int | None,
    scaling_factor: float | None,
    expert_bias: torch.Tensor | None,
) -> None:
    num_experts = _check_router_inputs(logits, topk, score_function)
    if not isinstance(use_pre_softmax, bool):
        raise TypeError(f"use_pre_softmax: expected a bool, got {type(use_pre_softmax).__name__}")
    if score_function == "softmax" and topk == 1 and not use_pre_softmax:
        # A softmax over a single selected logit is constant 1: the router would get no gradient.
        raise ValueError("use_pre_softmax: topk=1 with the softmax score function needs use_pre_softmax=True")
    _check_groups(num_experts, topk, num_groups, group_topk)
    if scaling_factor is not None:
        if isinstance(scaling_factor, bool) or not isinstance(scaling_factor, (int, float)):
            raise TypeError(f"scaling_factor: expected a float, got {type(scaling_factor).__name__}")
        if not scaling_factor > 0:
            raise ValueError(f"scaling_factor: must be > 0, got {scaling_factor}")
    if expert_bias is not None:
        if score_function != "sigmoid":
            raise ValueError("expert_bias: the aux-loss-free expert bias needs score_function='sigmoid'")
        _check_bias(expert_bias, logits, num_experts)


# --------------------------------------------------------------------------------------------------- routing


def _topk(
    scores: torch.Tensor, topk: int, num_groups: int | None, group_topk: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of ``scores [T, E]`` (values descending, indices int64), limited to the ``group_topk`` groups
    whose top-(topk // group_topk) scores sum highest when ``group_topk`` is set."""
    if group_topk is None:
        return torch.topk(scores, k=topk, dim=1)
    tokens, experts = scores.shape
    grouped = scores.reshape(tokens, num_groups, experts // num_groups)
    group_score = grouped.topk(topk // group_topk, dim=-1).values.sum(dim=-1)
    kept = torch.topk(group_score, k=group_topk, dim=-1, sorted=False).indices
    keep = torch.zeros(tokens, num_groups, dtype=torch.bool, device=scores.device).scatter_(1, kept, True)
    limited = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, experts)
    return torch.topk(limited, k=topk, dim=1)


def _route(
    logits: torch.Tensor,
    topk: int,
    score_function: str,
    use_pre_softmax: bool,
    num_groups: int | None,
    group_topk: int | None,
    scaling_factor: float | None,
    expert_bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """→ ``(weights [T, K] in the logits dtype, topk_idx [T, K] int64)``; inputs already validated."""
    dtype = logits.dtype
    if score_function == "softmax":
        if use_pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32).to(dtype)
            weights, idx = _topk(scores, topk, num_groups, group_topk)
        else:
            top_logits, idx = _topk(logits, topk, num_groups, group_topk)
            weights = torch.softmax(top_logits, dim=-1, dtype=torch.float32).to(dtype)
    else:
        scores = torch.sigmoid(logits.float()).to(dtype)
        if expert_bias is None:
            weights, idx = _topk(scores, topk, num_groups, group_topk)
        else:
            # The bias steers selection only; the weights are the unbiased scores of the chosen experts.
            _, idx = _topk(scores + expert_bias, topk, num_groups, group_topk)
            weights = scores.gather(1, idx)
        if topk > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling_factor is not None:
        weights = weights * scaling_factor
    return weights, idx


def topk_routing(
    logits: torch.Tensor,
    topk: int,
    *,
    score_function: str = "softmax",
    use_pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float | None = None,
    expert_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron-Core router top-k, dense form.

    ``logits [T, E]`` (any float dtype) → ``(probs [T, E] logits dtype, 0 off the top-k; routing_map [T, E] bool)``.
    softmax: with ``use_pre_softmax`` the weights are the full-softmax scores of the chosen experts (not
    renormalised), otherwise a softmax over the K chosen logits. sigmoid: weights normalised to sum 1 (K > 1);
    ``expert_bias [E]`` is added for selection only. ``scaling_factor`` multiplies the weights. Differentiable
    in ``logits``.
    """
    _validate_routing(
        logits, topk, score_function, use_pre_softmax, num_groups, group_topk, scaling_factor, expert_bias
    )
    weights, idx = _route(
        logits, topk, score_function, use_pre_softmax, num_groups, group_topk, scaling_factor, expert_bias
    )
    probs = torch.zeros_like(logits).scatter(1, idx, weights)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, idx, True)
    return probs, routing_map


def group_limited_topk(
    logits: torch.Tensor,
    topk: int,
    *,
    score_function: str = "softmax",
    use_pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float | None = None,
    expert_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk_routing`` in the sparse form dispatch takes: ``(topk_weights [T, K] float32, topk_idx [T, K] int64)``.

    Same experts and weights as ``topk_routing`` (weights computed in the logits dtype, then cast to float32),
    ordered by descending selection score. Differentiable in ``logits``.
    """
    _validate_routing(
        logits, topk, score_function, use_pre_softmax, num_groups, group_topk, scaling_factor, expert_bias
    )
    weights, idx = _route(
        logits, topk, score_function, use_pre_softmax, num_groups, group_topk, scaling_factor, expert_bias
    )
    return weights.float(), idx


def deepseek_v3_gate(
    logits: torch.Tensor,
    topk: int,
    *,
    num_groups: int | None = None,
    group_topk: int | None = None,
    route_scale: float = 1.0,
    expert_bias: torch.Tensor | None = None,
    score_function: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The DeepSeek-V3 reference gate → ``(topk_weights [T, K] float32, topk_idx [T, K] int64)``.

    Scores: sigmoid (rounded to the logits dtype) or an fp32 softmax. ``expert_bias`` is added for selection.
    A group scores as its maximum (no bias) or the sum of its top 2 (with bias); the ``group_topk`` best groups
    stay. Weights are the unbiased scores of the chosen experts, normalised to sum 1 for sigmoid, times
    ``route_scale``. With a bias and ``topk // group_topk == 2`` this equals ``topk_routing`` (sigmoid).
    """
    num_experts = _check_router_inputs(logits, topk, score_function)
    _check_groups(num_experts, topk, num_groups, group_topk)
    if isinstance(route_scale, bool) or not isinstance(route_scale, (int, float)) or not route_scale > 0:
        raise ValueError(f"route_scale: expected a number > 0, got {route_scale!r}")
    if expert_bias is not None:
        _check_bias(expert_bias, logits, num_experts)
        if group_topk is not None and num_experts // num_groups < 2:
            raise ValueError("num_groups: with expert_bias a group is scored by its top 2, so it needs >= 2 experts")

    if score_function == "sigmoid":
        scores = torch.sigmoid(logits.float()).to(logits.dtype)
    else:
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    selection = scores if expert_bias is None else scores + expert_bias
    if group_topk is not None:
        tokens = logits.shape[0]
        grouped = selection.reshape(tokens, num_groups, num_experts // num_groups)
        if expert_bias is None:
            group_score = grouped.amax(dim=-1)
        else:
            group_score = grouped.topk(2, dim=-1).values.sum(dim=-1)
        kept = group_score.topk(group_topk, dim=-1).indices
        keep = torch.zeros(tokens, num_groups, dtype=torch.bool, device=logits.device).scatter_(1, kept, True)
        selection = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, num_experts)
    idx = selection.topk(topk, dim=-1).indices
    weights = scores.gather(1, idx)
    if score_function == "sigmoid":
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights * route_scale).float(), idx


# --------------------------------------------------------------------------------------------------- load balance


def tokens_per_expert(routing: torch.Tensor, num_experts: int, check_ids: bool = True) -> torch.Tensor:
    """Tokens per expert, int64 ``[E]``, from a ``routing_map [T, E]`` bool or a ``topk_idx [T, K]`` integer
    tensor (``-1`` = no expert, skipped). The count never waits for the GPU; checking the ids' range does (one
    host read): ``check_ids=False`` skips it for ids a router just made, which lie in ``[-1, E)`` by construction."""
    if not isinstance(routing, torch.Tensor):
        raise TypeError(f"routing: expected a torch.Tensor, got {type(routing).__name__}")
    positive_int(num_experts, "num_experts")
    if routing.dim() != 2:
        raise ValueError(f"routing: expected a 2-D tensor, got shape {tuple(routing.shape)}")
    if routing.dtype == torch.bool:
        if routing.shape[1] != num_experts:
            raise ValueError(f"routing: a routing map needs {num_experts} columns, got {routing.shape[1]}")
        return routing.sum(dim=0, dtype=torch.int64)
    if routing.is_floating_point() or routing.is_complex():
        raise TypeError(f"routing: expected a bool routing map or integer topk_idx, got {routing.dtype}")
    if check_ids and routing.numel():
        low, high = torch.stack(torch.aminmax(routing.reshape(-1).long())).tolist()
        if low < -1 or high >= num_experts:
            raise ValueError(f"routing: expert ids must lie in [-1, {num_experts}), got [{low}, {high}]")
    ids = routing.reshape(-1).long()
    valid = ids >= 0
    # a scatter-add of 0/1 (not bincount, which reads the largest id on the host): -1 entries add 0 to expert 0
    return torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(
        0, torch.where(valid, ids, 0), valid.long()
    )


def update_expert_bias(expert_bias: torch.Tensor, tokens_per_expert: torch.Tensor, rate: float) -> torch.Tensor:
    """Aux-loss-free balancing step, in place: ``bias += rate * sign(mean_load - load)`` (Megatron's
    ``get_updated_expert_bias`` after its all-reduce: pass the globally summed ``tokens_per_expert``).

    ``expert_bias [..., E]`` float32; ``tokens_per_expert`` of the same shape (counts, any real dtype); the mean
    runs over the last dimension. Returns ``expert_bias``.
    """
    if not isinstance(expert_bias, torch.Tensor) or expert_bias.dtype != torch.float32:
        raise TypeError(
            f"expert_bias: expected a float32 tensor, got {getattr(expert_bias, 'dtype', type(expert_bias).__name__)}"
        )
    if (
        not isinstance(tokens_per_expert, torch.Tensor)
        or tokens_per_expert.dtype == torch.bool
        or tokens_per_expert.is_complex()
    ):
        raise TypeError(
            f"tokens_per_expert: expected an integer or float tensor, got "
            f"{getattr(tokens_per_expert, 'dtype', type(tokens_per_expert).__name__)}"
        )
    if tokens_per_expert.shape != expert_bias.shape or expert_bias.dim() == 0:
        raise ValueError(
            f"tokens_per_expert: shape {tuple(tokens_per_expert.shape)} must equal the expert_bias "
            f"shape {tuple(expert_bias.shape)} (at least 1-D)"
        )
    if tokens_per_expert.device != expert_bias.device:
        raise ValueError(f"tokens_per_expert: on {tokens_per_expert.device}, expert_bias on {expert_bias.device}")
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or rate < 0:
        raise ValueError(f"rate: expected a number >= 0, got {rate!r}")
    with torch.no_grad():
        mean_load = tokens_per_expert.sum(dim=-1, keepdim=True) / tokens_per_expert.shape[-1]
        expert_bias.add_(torch.sign(mean_load - tokens_per_expert) * rate)
    return expert_bias


def aux_loss_scores(
    logits: torch.Tensor, topk: int, *, score_function: str = "softmax"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores and routing map the load-balancing losses use (Megatron's ``compute_routing_scores_for_aux_loss``):
    softmax in fp32, or sigmoid (logits dtype) normalised over all E experts; a plain top-k, no group limit,
    no bias. → ``(scores [T, E], routing_map [T, E] bool)``."""
    _check_router_inputs(logits, topk, score_function)
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    idx = torch.topk(scores, k=topk, dim=1).indices
    return scores, torch.zeros_like(scores, dtype=torch.bool).scatter(1, idx, True)


def _check_aux_inputs(scores: torch.Tensor, topk: int, coeff: float) -> tuple[int, int]:
    shape = _check_2d_float(scores, "scores")
    positive_int(topk, "topk")
    if isinstance(coeff, bool) or not isinstance(coeff, (int, float)):
        raise TypeError(f"coeff: expected a float, got {type(coeff).__name__}")
    return shape


def switch_aux_loss(
    scores: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    *,
    topk: int,
    coeff: float = 1.0,
    total_num_tokens: int | None = None,
) -> torch.Tensor:
    """Switch-Transformer load-balancing loss ``coeff * E * Σ_i f_i P_i`` (Megatron's
    ``switch_load_balancing_loss_func``), a 0-d tensor differentiable in ``scores``.

    ``scores [T, E]`` local scores (``aux_loss_scores``); ``tokens_per_expert [E]`` counts at the level the loss
    balances (this micro-batch, or summed over DP and averaged over accumulation steps for the global loss);
    ``total_num_tokens`` the token count at that level (default T). f_i = count_i / (K * total),
    P_i = Σ_t scores[t, i] / total.
    """
    tokens, num_experts = _check_aux_inputs(scores, topk, coeff)
    if not isinstance(tokens_per_expert, torch.Tensor) or tuple(tokens_per_expert.shape) != (num_experts,):
        raise ValueError(f"tokens_per_expert: expected a tensor of shape ({num_experts},)")
    total = tokens if total_num_tokens is None else positive_int(total_num_tokens, "total_num_tokens")
    return (scores.sum(dim=0) * tokens_per_expert).sum() * (num_experts * coeff / (topk * total * total))


def sequence_aux_loss(
    scores: torch.Tensor, routing_map: torch.Tensor, *, topk: int, batch_size: int, coeff: float = 1.0
) -> torch.Tensor:
    """Sequence-level balancing loss (Megatron's ``seq_aux_loss``): the switch loss of each sequence on its
    own, averaged over the batch. A 0-d tensor differentiable in ``scores``.

    ``scores``/``routing_map`` ``[T, E]`` from ``aux_loss_scores``, T = S * B tokens laid out sequence-major as
    Megatron's ``[S, B]`` flattened (token ``s * B + b`` is position ``s`` of sequence ``b``).
    """
    tokens, num_experts = _check_aux_inputs(scores, topk, coeff)
    positive_int(batch_size, "batch_size")
    if (
        not isinstance(routing_map, torch.Tensor)
        or routing_map.dtype != torch.bool
        or routing_map.shape != scores.shape
    ):
        raise ValueError(f"routing_map: expected a bool tensor of shape {tuple(scores.shape)}")
    if tokens % batch_size != 0:
        raise ValueError(f"batch_size: {tokens} tokens are not a whole number of {batch_size} sequences")
    seq_len = tokens // batch_size
    # Columns (b, e): each sequence's experts become separate "experts" of one switch loss over S tokens.
    per_seq_scores = scores.reshape(seq_len, batch_size * num_experts)
    per_seq_counts = routing_map.reshape(seq_len, batch_size * num_experts).sum(dim=0)
    loss = (per_seq_scores.sum(dim=0) * per_seq_counts).sum() * (num_experts * coeff / (topk * seq_len * seq_len))
    return loss / batch_size


# --------------------------------------------------------------------------------------------------- traffic


def rank_reach(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> torch.Tensor:
    """Distinct ranks each token is sent to, int64 ``[T]``: experts sit contiguously, E / R per rank; ``-1``
    entries are skipped. Pass the node count as ``num_ranks`` to count nodes (a node's ranks are contiguous)."""
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.is_floating_point() or topk_idx.dtype == torch.bool:
        raise TypeError("topk_idx: expected an integer tensor")
    if topk_idx.dim() != 2:
        raise ValueError(f"topk_idx: expected a 2-D [tokens, topk] tensor, got shape {tuple(topk_idx.shape)}")
    positive_int(num_experts, "num_experts")
    positive_int(num_ranks, "num_ranks")
    if num_experts % num_ranks != 0:
        raise ValueError(f"num_ranks: the expert count {num_experts} is not divisible by num_ranks={num_ranks}")
    if topk_idx.numel() and (int(topk_idx.min()) < -1 or int(topk_idx.max()) >= num_experts):
        raise ValueError(f"topk_idx: expert ids must lie in [-1, {num_experts})")
    idx = topk_idx.long()
    # Column num_ranks collects the -1 entries and is dropped.
    rank = torch.where(idx >= 0, idx // (num_experts // num_ranks), num_ranks)
    hit = torch.zeros(idx.shape[0], num_ranks + 1, dtype=torch.bool, device=idx.device).scatter_(1, rank, True)
    return hit[:, :num_ranks].sum(dim=1)


@dataclass(frozen=True)
class TrafficSaving:
    """Dispatch rows (one per token and destination) with and without the group limit."""

    rows_sent: int  # Σ_t ranks reached by token t under the group limit
    rows_unlimited: int  # the same routing with a plain top-k over all experts
    max_reach: int  # most ranks any token reaches under the limit
    saving: float  # 1 - rows_sent / rows_unlimited (0.0 for no tokens)


def traffic_saving(
    logits: torch.Tensor,
    topk: int,
    num_ranks: int,
    *,
    score_function: str = "softmax",
    use_pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    expert_bias: torch.Tensor | None = None,
) -> TrafficSaving:
    """Rows dispatch sends for ``logits [T, E]`` routed with the group limit vs. without it, counting
    destinations among ``num_ranks`` ranks (or nodes). With ``num_groups == num_ranks`` each token reaches
    at most ``group_topk`` of them."""
    common = dict(score_function=score_function, use_pre_softmax=use_pre_softmax, expert_bias=expert_bias)
    with torch.no_grad():
        _, limited = group_limited_topk(logits, topk, num_groups=num_groups, group_topk=group_topk, **common)
        _, unlimited = group_limited_topk(logits, topk, **common)
    num_experts = logits.shape[1]
    reach = rank_reach(limited, num_experts, num_ranks)
    sent = int(reach.sum())
    plain = int(rank_reach(unlimited, num_experts, num_ranks).sum())
    return TrafficSaving(
        rows_sent=sent,
        rows_unlimited=plain,
        max_reach=int(reach.max()) if reach.numel() else 0,
        saving=1.0 - sent / plain if plain else 0.0,
    )
