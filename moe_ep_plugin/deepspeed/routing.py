"""Routing for the plugin's DeepSpeed MoE layer: DeepSpeed's own top-k gates, or group-limited gating.

Both produce the sparse form dispatch takes (S = tokens on this rank, K = top-k, E = experts):
``topk_idx [S, K]`` int64 (-1 = route dropped), ``topk_weights [S, K]`` float32 (0 where dropped), plus
DeepSpeed's ``l_aux`` (0-d, differentiable) and ``exp_counts [E]``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.moe.sharded_moe import TopKGate, multiplicative_jitter, top1gating, top2gating, topkgating

from .. import gating
from .options import DeepSpeedOptions


@dataclass
class Routes:
    """One forward's routing decision for the ``S`` tokens of this rank."""

    topk_idx: torch.Tensor      # [S, K] int64, -1 = dropped by DeepSpeed's capacity limit
    topk_weights: torch.Tensor  # [S, K] float32, 0 where dropped
    l_aux: torch.Tensor         # 0-d float32 load-balancing loss
    exp_counts: torch.Tensor    # [E] routes chosen per expert, counted before any capacity drop


def topk_gate_routes(gate: TopKGate, x: torch.Tensor, used_token: Optional[torch.Tensor]) -> Routes:
    """DeepSpeed's top-1/top-2/top-k gating of ``x [S, H]``, exactly as ``TopKGate.forward`` computes it.

    The gating functions get ``ep_group=None``: with ``drop_tokens=False`` DeepSpeed all-reduces the largest
    expert load over the EP group only to size its padded ``[E, C, H]`` buffer, which variable-split dispatch
    never builds; the routes themselves do not depend on it, so the collective (and its host sync) is skipped.
    """
    x32 = x.float()
    if gate.noisy_gate_policy == "Jitter" and gate.training:
        x32 = multiplicative_jitter(x32, device=x.device)
    logits = F.linear(x32, weight=gate.wg.weight.float(), bias=None)
    capacity_factor = gate.capacity_factor if gate.training else gate.eval_capacity_factor
    if gate.k == 1:
        noisy = gate.noisy_gate_policy if gate.training else None
        out = top1gating(logits, capacity_factor, gate.min_capacity, used_token, noisy, gate.drop_tokens,
                         gate.use_rts, None, sparse_routes=True)
    elif gate.k == 2:
        out = top2gating(logits, capacity_factor, gate.min_capacity, gate.drop_tokens, None,
                         gate.top2_2nd_expert_sampling, sparse_routes=True)
    else:
        out = topkgating(logits, gate.k, capacity_factor, gate.min_capacity, gate.drop_tokens, None,
                         sparse_routes=True)
    l_aux, _capacity, _num_experts, indices, _locations, gates, exp_counts = out
    return Routes(_token_major(indices, torch.int64), _token_major(gates, torch.float32), l_aux, exp_counts)


def _token_major(routes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """DeepSpeed's ``[K, S]`` → ``[S, K]``, built fresh so even K = 1 gets row-major strides."""
    return torch.empty(routes.shape[::-1], dtype=dtype, device=routes.device).copy_(routes.t())


class GroupLimitedGate(torch.nn.Module):
    """Group-limited top-k router (DeepSeek-V3 / Megatron-Core semantics via ``moe_ep_plugin.gating``).

    Holds a DeepSpeed-style ``wg`` (``Linear(H, E, bias=False)``, the same parameter name as ``TopKGate``, so
    optimizer groups and checkpoints treat it like DeepSpeed's gate) and takes the EP group the same way
    (``_set_ep_group``). Always dropless. ``l_aux`` is the switch load-balancing loss
    on the unlimited scores (Megatron's ``switch_load_balancing_loss_func``). With ``options.expert_bias_rate > 0``
    an aux-loss-free bias ``expert_bias [E]`` (a buffer, saved in checkpoints) steers selection; call
    :meth:`update_expert_bias` after each optimizer step.
    """

    def __init__(self, model_dim: int, num_experts: int, k: int, options: DeepSpeedOptions,
                 wg: Optional[torch.nn.Linear] = None) -> None:
        super().__init__()
        self.wg = wg if wg is not None else torch.nn.Linear(model_dim, num_experts, bias=False)
        self.k = k
        self.ep_group: Optional[dist.ProcessGroup] = None
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
            logits, self.k, score_function=o.score_function, use_pre_softmax=o.use_pre_softmax,
            num_groups=o.num_groups, group_topk=o.group_topk, scaling_factor=o.scaling_factor,
            expert_bias=self.expert_bias)
        scores, routing_map = gating.aux_loss_scores(logits, self.k, score_function=o.score_function)
        # a rank without tokens contributes a zero loss (the switch loss averages over its tokens)
        l_aux = gating.switch_aux_loss(scores, routing_map.sum(dim=0), topk=self.k,
                                       total_num_tokens=max(x.shape[0], 1))
        exp_counts = gating.tokens_per_expert(idx, self.num_experts)
        if self.expert_bias is not None and self.training:
            self._pending_counts += exp_counts.float()
        return Routes(idx, weights, l_aux, exp_counts)

    @torch.no_grad()
    def update_expert_bias(self, group: Optional[dist.ProcessGroup] = None) -> None:
        """Aux-loss-free step: sum the loads counted since the last call over ``group`` (default: all ranks,
        so every data-parallel replica applies the same step), move the bias towards balance, reset."""
        if self.expert_bias is None:
            raise ValueError("expert_bias_rate: this gate was built without an expert bias (rate 0)")
        counts = self._pending_counts.clone()
        if dist.is_initialized():
            dist.all_reduce(counts, group=group)
        gating.update_expert_bias(self.expert_bias, counts, self.options.expert_bias_rate)
        self._pending_counts.zero_()


def route(gate: torch.nn.Module, x: torch.Tensor, used_token: Optional[torch.Tensor]) -> Routes:
    """Routes of ``x [S, H]`` from either gate kind; ``used_token`` ([S] 0/1 mask) only for DeepSpeed's k=1."""
    if isinstance(gate, GroupLimitedGate):
        if used_token is not None:
            raise ValueError("used_token: not supported with router='group_limited'")
        return gate(x)
    if isinstance(gate, TopKGate):
        return topk_gate_routes(gate, x, used_token)
    raise TypeError(f"gate: expected a deepspeed TopKGate or GroupLimitedGate, got {type(gate).__name__}")
