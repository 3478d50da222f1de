"""What the plugin adds to ``deepspeed.moe.layer.MoE``'s constructor, and the checks on the combination."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import gating
from ..config import positive_int
from ..experts import EXPERT_COMPUTE
from ..ops import fp8
from ..plugin_options import PluginOptions

ROUTERS = ("deepspeed", "group_limited")
SCORE_FUNCTIONS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class DeepSpeedOptions(PluginOptions):
    """The plugin's options of one MoE layer: the shared :class:`~moe_ep_plugin.plugin_options.PluginOptions`
    (``transport``, ``fp8_dispatch``, ``round_scale``, ``num_sms``, ``timeout_s``) plus the router and the
    experts' compute.

    - ``router``: ``"deepspeed"`` keeps DeepSpeed's ``TopKGate`` (softmax top-1/top-2/top-k, capacity, RTS,
      noisy gates, ``l_aux``) bit for bit; ``"group_limited"`` routes with ``moe_ep_plugin.gating``
      (``score_function``, ``num_groups``/``group_topk`` group limit, ``scaling_factor``, ``use_pre_softmax``,
      aux-loss-free ``expert_bias_rate``), always dropless.
    - ``expert_compute``: ``"grouped"`` runs two-layer FFN experts (Linear → elementwise activation → Linear)
      as one grouped matmul per projection over their stacked weights (``moe_ep_plugin.experts.ffn_experts``),
      ``"loop"`` runs DeepSpeed's expert modules one by one, ``"auto"`` groups where the experts are such FFNs
      and torch's grouped matmul takes the operands without a host sync (CPU, or BF16 on SM90+ GPUs).
    """

    router: str = "deepspeed"
    score_function: str = "softmax"
    use_pre_softmax: bool = False
    num_groups: int | None = None
    group_topk: int | None = None
    scaling_factor: float | None = None
    expert_bias_rate: float = 0.0
    expert_compute: str = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, allowed in (
            ("router", ROUTERS),
            ("score_function", SCORE_FUNCTIONS),
            ("expert_compute", EXPERT_COMPUTE),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}: expected one of {allowed}, got {getattr(self, name)!r}")
        if not isinstance(self.use_pre_softmax, bool):
            raise TypeError(f"use_pre_softmax: expected a bool, got {type(self.use_pre_softmax).__name__}")
        if (
            isinstance(self.expert_bias_rate, bool)
            or not isinstance(self.expert_bias_rate, (int, float))
            or self.expert_bias_rate < 0
        ):
            raise ValueError(f"expert_bias_rate: expected a number >= 0, got {self.expert_bias_rate!r}")
        if self.router == "deepspeed":
            plugin_only = {
                "score_function": self.score_function != "softmax",
                "use_pre_softmax": self.use_pre_softmax,
                "num_groups": self.num_groups is not None,
                "group_topk": self.group_topk is not None,
                "scaling_factor": self.scaling_factor is not None,
                "expert_bias_rate": self.expert_bias_rate != 0,
            }
            for name, is_set in plugin_only.items():
                if is_set:
                    raise ValueError(
                        f"{name}: only used by router='group_limited' (DeepSpeed's TopKGate is softmax "
                        "top-k without groups)"
                    )
        if self.expert_bias_rate and self.score_function != "sigmoid":
            raise ValueError("expert_bias_rate: the aux-loss-free expert bias needs score_function='sigmoid'")


def check_moe_args(
    hidden_size: int,
    num_experts: int,
    ep_size: int,
    k: int,
    drop_tokens: bool,
    use_tutel: bool,
    enable_expert_tensor_parallelism: bool,
    options: DeepSpeedOptions,
) -> None:
    """Reject settings the layer cannot run, naming the argument, before DeepSpeed builds anything."""
    positive_int(hidden_size, "hidden_size")
    positive_int(num_experts, "num_experts")
    positive_int(ep_size, "ep_size")
    positive_int(k, "k")
    if num_experts % ep_size:
        raise ValueError(f"num_experts: {num_experts} experts cannot be split evenly over ep_size={ep_size} ranks")
    if k > num_experts:
        raise ValueError(f"k: top-{k} needs at least {k} experts, got num_experts={num_experts}")
    check_world(ep_size)
    if use_tutel:
        raise ValueError("use_tutel: the plugin's dispatch replaces Tutel's encode/decode; set use_tutel=False")
    if enable_expert_tensor_parallelism:
        raise ValueError(
            "enable_expert_tensor_parallelism: tensor-parallel experts are not supported by the "
            "plugin layer; use deepspeed.moe.layer.MoE for expert TP"
        )
    if drop_tokens and options.router == "group_limited":
        raise ValueError("drop_tokens: router='group_limited' is dropless; set drop_tokens=False")
    if options.fp8_dispatch:
        fp8.check_fp8_hidden(hidden_size, "hidden_size")
    if options.router == "group_limited":
        # gating validates num_groups/group_topk/scaling_factor against E and k; one dummy token runs it now
        bias = torch.zeros(num_experts, device="cpu") if options.expert_bias_rate else None
        gating.group_limited_topk(
            torch.zeros(1, num_experts, device="cpu"),
            k,
            score_function=options.score_function,
            use_pre_softmax=options.use_pre_softmax,
            num_groups=options.num_groups,
            group_topk=options.group_topk,
            scaling_factor=options.scaling_factor,
            expert_bias=bias,
        )


def check_world(ep_size: int) -> None:
    """``ep_size`` must divide the world (DeepSpeed tiles expert-parallel groups over it)."""
    if dist.is_initialized() and dist.get_world_size() % ep_size:
        raise ValueError(f"ep_size: {ep_size} does not divide the world size {dist.get_world_size()}")
