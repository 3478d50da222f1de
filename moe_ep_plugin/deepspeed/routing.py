"""Routing for the plugin's DeepSpeed MoE layer: DeepSpeed's own top-k gates, or group-limited gating.

Both produce the sparse form dispatch takes (S = tokens on this rank, K = top-k, E = experts):
``topk_idx [S, K]`` int64 (-1 = route dropped), ``topk_weights [S, K]`` float32 (0 where dropped), plus
DeepSpeed's ``l_aux`` (0-d, differentiable) and ``exp_counts [E]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.moe.sharded_moe import (
    TopKGate,
    einsum,
    gumbel_rsample,
    multiplicative_jitter,
    top1gating,
    top2gating,
    topkgating,
)

from .. import gating
from .options import DeepSpeedOptions


@dataclass
class Routes:
    """One forward's routing decision for the ``S`` tokens of this rank."""

    topk_idx: torch.Tensor  # [S, K] int64, -1 = dropped by DeepSpeed's capacity limit
    topk_weights: torch.Tensor  # [S, K] float32, 0 where dropped
    l_aux: torch.Tensor  # 0-d float32 load-balancing loss
    exp_counts: torch.Tensor  # [E] routes chosen per expert, counted before any capacity drop


def topk_gate_routes(gate: TopKGate, x: torch.Tensor, used_token: torch.Tensor | None) -> Routes:
    """DeepSpeed's top-1/top-2/top-k gating of ``x [S, H]``, exactly as ``TopKGate.forward`` computes it.

    With ``drop_tokens=False`` the dropless functions below give DeepSpeed's numbers without its capacity: no
    host reads, no capacity locations, no ``[K, S]`` route blocks to transpose back, and no all-reduce of the
    largest expert load over the EP group (DeepSpeed sizes its padded ``[E, C, H]`` buffer with it; variable-split
    dispatch builds none). With ``drop_tokens=True`` DeepSpeed's own gating functions run (``ep_group=None``: the
    capacity there does not depend on the group either).
    """
    x32 = x.float()
    if gate.noisy_gate_policy == "Jitter" and gate.training:
        x32 = multiplicative_jitter(x32, device=x.device)
    logits = F.linear(x32, weight=gate.wg.weight.float(), bias=None)
    noisy = gate.noisy_gate_policy if gate.training else None
    if not gate.drop_tokens:
        if gate.k == 1:
            return _top1_dropless(logits, used_token, noisy, gate.use_rts)
        if gate.k == 2:
            return _top2_dropless(logits, gate.top2_2nd_expert_sampling)
        return _topk_dropless(logits, gate.k)
    capacity_factor = gate.capacity_factor if gate.training else gate.eval_capacity_factor
    if gate.k == 1:
        out = top1gating(
            logits,
            capacity_factor,
            gate.min_capacity,
            used_token,
            noisy,
            gate.drop_tokens,
            gate.use_rts,
            None,
            sparse_routes=True,
        )
    elif gate.k == 2:
        out = top2gating(
            logits,
            capacity_factor,
            gate.min_capacity,
            gate.drop_tokens,
            None,
            gate.top2_2nd_expert_sampling,
            sparse_routes=True,
        )
    else:
        out = topkgating(logits, gate.k, capacity_factor, gate.min_capacity, gate.drop_tokens, None, sparse_routes=True)
    l_aux, _capacity, _num_experts, indices, _locations, gates, exp_counts = out
    return Routes(_token_major(indices, torch.int64), _token_major(gates, torch.float32), l_aux, exp_counts)


def _token_major(routes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """DeepSpeed's ``[K, S]`` → ``[S, K]``, built fresh so even K = 1 gets row-major strides."""
    return torch.empty(routes.shape[::-1], dtype=dtype, device=routes.device).copy_(routes.t())


def _top1_dropless(logits: torch.Tensor, used_token: torch.Tensor | None, noisy: str | None, use_rts: bool) -> Routes:
    """``top1gating(drop_tokens=False)`` of fp32 ``logits [S, E]``: the same routes, weights, ``l_aux`` and
    ``exp_counts`` and the same random draws, without its capacity (DeepSpeed reads it on the host three times).

    Without a capacity limit the random token selection keeps every routed token; its uniform draw still happens,
    so the RNG stream (later gates' noise, dropout) stays DeepSpeed's. One difference: a routed token whose draw
    is exactly 0 (probability 2^-24) ties with the unrouted ones in DeepSpeed's ``topk`` and may be dropped there;
    here it is kept. ``used_token [S]`` (0/1) masks tokens out (route -1, weight 0), as in DeepSpeed, which
    instead fails on it when dropless (its capacity becomes a float tensor).
    """
    gates = F.softmax(logits, dim=1)
    selection = logits + gumbel_rsample(logits.shape, device=logits.device) if noisy == "RSample" else gates
    idx = torch.argmax(selection, dim=1, keepdim=True)
    num_experts = gates.shape[1]
    mask = F.one_hot(idx.squeeze(1), num_classes=num_experts)
    if used_token is not None:
        mask = einsum("s,se->se", used_token, mask)  # DeepSpeed's own masking, float counts included
    exp_counts = torch.sum(mask, dim=0).detach()
    l_aux = torch.sum(torch.mean(gates, dim=0) * torch.mean(mask.float(), dim=0)) * num_experts
    if use_rts:
        torch.rand(mask.shape, device=logits.device)  # DeepSpeed's RTS draw: Uniform(0, 1).rsample is torch.rand
    weights = gates.gather(1, idx)
    if used_token is not None:
        kept = used_token.reshape(-1, 1) != 0
        idx = torch.where(kept, idx, -1)
        weights = torch.where(kept, weights, 0.0)
    return Routes(idx, weights, l_aux, exp_counts)


def _top2_dropless(logits: torch.Tensor, second_expert_sampling: bool) -> Routes:
    """``top2gating(drop_tokens=False)`` of fp32 ``logits [S, E]`` without capacity and locations: the same
    Gumbel-sampled second expert, normalised weights, ``l_aux`` and ``exp_counts``."""
    gates = F.softmax(logits, dim=1)
    first = torch.argmax(gates, dim=1, keepdim=True)
    num_experts = gates.shape[1]
    mask1 = F.one_hot(first.squeeze(1), num_classes=num_experts)
    if second_expert_sampling:
        logits = logits + gumbel_rsample(logits.shape, device=logits.device)
    second = torch.argmax(logits.masked_fill(mask1.bool(), float("-inf")), dim=1, keepdim=True)
    mask2 = F.one_hot(second.squeeze(1), num_classes=num_experts)
    l_aux = torch.mean(torch.mean(gates, dim=0) * torch.mean(mask1.float(), dim=0)) * num_experts * num_experts
    exp_counts = torch.sum(mask1 + mask2, dim=0).detach()
    idx = torch.cat((first, second), dim=1)
    # DeepSpeed's masked row sums hold one nonzero term each, so they equal these gathers bit for bit
    weights = gates.gather(1, idx)
    denom = torch.clamp(weights[:, :1] + weights[:, 1:], min=torch.finfo(weights.dtype).eps)
    return Routes(idx, weights / denom, l_aux, exp_counts)


def _topk_dropless(logits: torch.Tensor, k: int) -> Routes:
    """``topkgating(drop_tokens=False)`` of fp32 ``logits [S, E]`` without capacity and locations: the same
    top-k routes, normalised weights, ``l_aux`` and ``exp_counts``."""
    gates = F.softmax(logits, dim=1)
    num_experts = gates.shape[1]
    top_gates, idx = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, idx, 1)
    exp_counts = torch.sum(mask, dim=0).detach()
    l_aux = torch.mean(torch.mean(gates, dim=0) * torch.mean(mask.float(), dim=0)) * num_experts * num_experts / k
    # the normaliser is DeepSpeed's sum over the whole masked row (its summation order), not over the k values
    denom = torch.clamp(torch.sum(gates * mask, dim=-1, keepdim=True), min=torch.finfo(gates.dtype).eps)
    return Routes(idx, top_gates / denom, l_aux, exp_counts)


class GroupLimitedGate(torch.nn.Module):
    """Group-limited top-k router (DeepSeek-V3 / Megatron-Core semantics via ``moe_ep_plugin.gating``).

    Holds a DeepSpeed-style ``wg`` (``Linear(H, E, bias=False)``, the same parameter name as ``TopKGate``, so
    optimizer groups and checkpoints treat it like DeepSpeed's gate) and takes the EP group the same way
    (``_set_ep_group``). Always dropless. ``l_aux`` is the switch load-balancing loss
    on the unlimited scores (Megatron's ``switch_load_balancing_loss_func``). With ``options.expert_bias_rate > 0``
    an aux-loss-free bias ``expert_bias [E]`` (a buffer, saved in checkpoints) steers selection; call
    :meth:`update_expert_bias` after each optimizer step.
    """

    def __init__(
        self, model_dim: int, num_experts: int, k: int, options: DeepSpeedOptions, wg: torch.nn.Linear | None = None
    ) -> None:
        super().__init__()
        self.wg = wg if wg is not None else torch.nn.Linear(model_dim, num_experts, bias=False)
        self.k = k
        self.ep_group: dist.ProcessGroup | None = None
        self.options = options
        self.num_experts = num_experts
        if options.expert_bias_rate > 0:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
            self.register_buffer("_pending_counts", torch.zeros(num_experts, dtype=torch.float32), persistent=False)
        else:
            self.expert_bias = None

    def _set_ep_group(self, ep_group: dist.ProcessGroup) -> None:
        self.ep_group = ep_group

    def forward(self, x: torch.Tensor) -> Routes:
        """``x [S, H]`` → :class:`Routes` (logits in fp32, like DeepSpeed's gate)."""
        o = self.options
        logits = F.linear(x.float(), self.wg.weight.float())
        weights, idx = gating.group_limited_topk(
            logits,
            self.k,
            score_function=o.score_function,
            use_pre_softmax=o.use_pre_softmax,
            num_groups=o.num_groups,
            group_topk=o.group_topk,
            scaling_factor=o.scaling_factor,
            expert_bias=self.expert_bias,
        )
        scores, routing_map = gating.aux_loss_scores(logits, self.k, score_function=o.score_function)
        # a rank without tokens contributes a zero loss (the switch loss averages over its tokens)
        l_aux = gating.switch_aux_loss(scores, routing_map.sum(dim=0), topk=self.k, total_num_tokens=max(x.shape[0], 1))
        exp_counts = gating.tokens_per_expert(idx, self.num_experts, check_ids=False)
        if self.expert_bias is not None and self.training:
            self._pending_counts += exp_counts.float()
        return Routes(idx, weights, l_aux, exp_counts)

    @torch.no_grad()
    def update_expert_bias(self, group: dist.ProcessGroup | None = None) -> None:
        """Aux-loss-free step: sum the loads counted since the last call over ``group`` (default: all ranks,
        so every data-parallel replica applies the same step), move the bias towards balance, reset."""
        if self.expert_bias is None:
            raise ValueError("expert_bias_rate: this gate was built without an expert bias (rate 0)")
        counts = self._pending_counts.clone()
        if dist.is_initialized():
            dist.all_reduce(counts, group=group)
        gating.update_expert_bias(self.expert_bias, counts, self.options.expert_bias_rate)
        self._pending_counts.zero_()


def route(gate: torch.nn.Module, x: torch.Tensor, used_token: torch.Tensor | None) -> Routes:
    """Routes of ``x [S, H]`` from either gate kind; ``used_token`` ([S] 0/1 mask) only for DeepSpeed's k=1."""
    if isinstance(gate, GroupLimitedGate):
        if used_token is not None:
            raise ValueError("used_token: not supported with router='group_limited'")
        return gate(x)
    if isinstance(gate, TopKGate):
        return topk_gate_routes(gate, x, used_token)
    raise TypeError(f"gate: expected a deepspeed TopKGate or GroupLimitedGate, got {type(gate).__name__}")
