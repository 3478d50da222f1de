"""What the plugin adds to ``deepspeed.moe.layer.MoE``'s constructor, and the checks on the combination."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .. import gating
from ..ops import fp8

ROUTERS = ("deepspeed", "group_limited")
TRANSPORTS = ("auto", "torch", "nvlink")
SCORE_FUNCTIONS = ("softmax", "sigmoid")


def _int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class PluginOptions:
    """The plugin's options of one MoE layer.

    - ``router``: ``"deepspeed"`` keeps DeepSpeed's ``TopKGate`` (softmax top-1/top-2/top-k, capacity, RTS,
      noisy gates, ``l_aux``) bit for bit; ``"group_limited"`` routes with ``moe_ep_plugin.gating``
      (``score_function``, ``num_groups``/``group_topk`` group limit, ``scaling_factor``, ``use_pre_softmax``,
      aux-loss-free ``expert_bias_rate``), always dropless.
    - ``fp8_dispatch``: BF16 tokens travel as FP8 (1x128 blocks, ``round_scale``: power-of-two scales) and
      arrive as BF16; combine and all gradients stay BF16. Needs ``hidden_size % 128 == 0``.
    - ``transport``: the ``moe_ep_plugin.Buffer`` transport (``auto`` picks the NVLink kernels when usable).
    """

    router: str = "deepspeed"
    score_function: str = "softmax"
    use_pre_softmax: bool = False
    num_groups: Optional[int] = None
    group_topk: Optional[int] = None
    scaling_factor: Optional[float] = None
    expert_bias_rate: float = 0.0
    fp8_dispatch: bool = False
    round_scale: bool = False
    transport: str = "auto"

    def __post_init__(self) -> None:
        for name, allowed in (("router", ROUTERS), ("transport", TRANSPORTS), ("score_function", SCORE_FUNCTIONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}: expected one of {allowed}, got {getattr(self, name)!r}")
        for name in ("use_pre_softmax", "fp8_dispatch", "round_scale"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: expected a bool, got {type(getattr(self, name)).__name__}")
        if self.round_scale and not self.fp8_dispatch:
            raise ValueError("round_scale: only meaningful with fp8_dispatch=True")
        if isinstance(self.expert_bias_rate, bool) or not isinstance(self.expert_bias_rate, (int, float)) \
                or self.expert_bias_rate < 0:
            raise ValueError(f"expert_bias_rate: expected a number >= 0, got {self.expert_bias_rate!r}")
        if self.router == "deepspeed":
            plugin_only = {"score_function": self.score_function != "softmax", "use_pre_softmax": self.use_pre_softmax,
                           "num_groups": self.num_groups is not None, "group_topk": self.group_topk is not None,
                           "scaling_factor": self.scaling_factor is not None,
                           "expert_bias_rate": self.expert_bias_rate != 0}
            for name, is_set in plugin_only.items():
                if is_set:
                    raise ValueError(f"{name}: only used by router='group_limited' (DeepSpeed's TopKGate is softmax "
                                     "top-k without groups)")
        if self.expert_bias_rate and self.score_function != "sigmoid":
            raise ValueError("expert_bias_rate: the aux-loss-free expert bias needs score_function='sigmoid'")


def check_moe_args(hidden_size: int, num_experts: int, ep_size: int, k: int, drop_tokens: bool, use_tutel: bool,
                   enable_expert_tensor_parallelism: bool, options: PluginOptions) -> None:
    """Reject settings the layer cannot run, naming the argument, before DeepSpeed builds anything."""
    _int("hidden_size", hidden_size, 1)
    _int("num_experts", num_experts, 1)
    _int("ep_size", ep_size, 1)
    _int("k", k, 1)
    if num_experts % ep_size:
        raise ValueError(f"num_experts: {num_experts} experts cannot be split evenly over ep_size={ep_size} ranks")
    if k > num_experts:
        raise ValueError(f"k: top-{k} needs at least {k} experts, got num_experts={num_experts}")
    check_world(ep_size)
    if use_tutel:
        raise ValueError("use_tutel: the plugin's dispatch replaces Tutel's encode/decode; set use_tutel=False")
    if enable_expert_tensor_parallelism:
        raise ValueError("enable_expert_tensor_parallelism: tensor-parallel experts are not supported by the "
                         "plugin layer; use deepspeed.moe.layer.MoE for expert TP")
    if drop_tokens and options.router == "group_limited":
        raise ValueError("drop_tokens: router='group_limited' is dropless; set drop_tokens=False")
    if options.fp8_dispatch:
        fp8.check_fp8_hidden(hidden_size, "hidden_size")
    if options.router == "group_limited":
        # gating validates num_groups/group_topk/scaling_factor against E and k; one dummy token runs it now
        bias = torch.zeros(num_experts) if options.expert_bias_rate else None
        gating.group_limited_topk(torch.zeros(1, num_experts), k, score_function=options.score_function,
                                  use_pre_softmax=options.use_pre_softmax, num_groups=options.num_groups,
                                  group_topk=options.group_topk, scaling_factor=options.scaling_factor,
                                  expert_bias=bias)


def check_world(ep_size: int) -> None:
    """``ep_size`` must divide the world (DeepSpeed tiles expert-parallel groups over it)."""
    if dist.is_initialized() and dist.get_world_size() % ep_size:
        raise ValueError(f"ep_size: {ep_size} does not divide the world size {dist.get_world_size()}")
