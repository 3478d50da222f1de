"""The plugin's dispatcher inside DeepSpeed's legacy MoE: a drop-in ``MoE`` and a converter for built models.

DeepSpeed's ``MOELayer`` pads every expert to a capacity ``C`` and moves the whole ``[E, C, H]`` buffer with two
equal-split all-to-alls, sending a token once per chosen expert. :class:`PluginMOELayer` keeps DeepSpeed's gate,
``Experts`` and EP group but moves each token once per destination rank with variable splits
(``moe_ep_plugin.Buffer`` through ``moe_ep_plugin.autograd.dispatch_experts``) straight into the expert-major
layout, runs the local experts on their contiguous rows (two-layer FFN experts as one grouped matmul per
projection over their stacked weights, others one by one) and combines the expert outputs back
(``combine_experts``), differentiably. Module names and parameters are unchanged, so
``is_moe_param`` tagging, ``split_params_into_different_moe_groups_for_optimizer``, ZeRO 1/2 and DeepSpeed's
(expert-sharded) checkpoints work as for the stock layer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from deepspeed.moe.layer import MoE as DeepSpeedMoE
from deepspeed.moe.sharded_moe import FIRST_ALLTOALL_TIMER, MOE_TIMER, SECOND_ALLTOALL_TIMER, MOELayer
from deepspeed.utils import groups
from deepspeed.utils.bwc import bwc_tensor_model_parallel_world_size

from .. import autograd as ep_autograd
from ..buffer_cache import get_buffer, sm_configs
from ..config import DEFAULT_TIMEOUT_S
from .ffn import GroupedFFN
from .options import DeepSpeedOptions, check_moe_args, check_world
from .routing import GroupLimitedGate, route


def _first(out: object) -> torch.Tensor:
    # DeepSpeed's Experts drop an expert's bias output the same way
    return out[0] if isinstance(out, tuple) else out


class PluginMOELayer(MOELayer):
    """``MOELayer`` with dropless variable-split dispatch; sets ``l_aux``/``exp_counts`` like the original.

    ``gate``: DeepSpeed's ``TopKGate`` (its exact routes, including ``drop_tokens=True`` capacity drops, RTS and
    noisy gating) or a :class:`GroupLimitedGate`. ``experts``: DeepSpeed's ``Experts`` (``num_local_experts``
    copies, tagged ``allreduce=False``).
    """

    def __init__(
        self,
        gate: torch.nn.Module,
        experts: torch.nn.Module,
        ep_group_name: str,
        ep_size: int,
        num_local_experts: int,
        options: DeepSpeedOptions,
    ) -> None:
        super().__init__(gate, experts, ep_group_name, ep_size, num_local_experts, use_tutel=False)
        self.options = options
        self.num_experts = ep_size * num_local_experts
        self._grouped = GroupedFFN.of(experts.deepspeed_experts)
        if self._grouped is None and options.expert_compute == "grouped":
            raise ValueError(
                f"expert_compute: 'grouped' needs experts whose forward is Linear → elementwise "
                f"activation → Linear; {type(experts.deepspeed_experts[0]).__name__} is not (use "
                "'auto' or 'loop')"
            )

    @classmethod
    def from_stock(
        cls, layer: MOELayer, options: DeepSpeedOptions, gate: torch.nn.Module | None = None
    ) -> PluginMOELayer:
        """The plugin layer over ``layer``'s gate (or ``gate``), experts and EP group (if already set)."""
        plugin = cls(
            gate if gate is not None else layer.gate,
            layer.experts,
            layer.ep_group_name,
            layer.ep_size,
            layer.num_local_experts,
            options,
        )
        if layer.ep_group is not None:
            plugin.ep_group = layer.ep_group
            if gate is not None:
                gate._set_ep_group(layer.ep_group)
        plugin.wall_clock_breakdown = layer.wall_clock_breakdown
        return plugin

    def _time(self, name: str, start: bool) -> None:
        """DeepSpeed's per-layer timers, when the engine turned on ``wall_clock_breakdown``."""
        if not self.wall_clock_breakdown:
            return
        if start:
            self.timers(name).start()
        else:
            self.timers(name).stop()

    def run_experts(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``rows [M, H]`` expert-major (``counts[l]`` rows of local expert ``l``) → expert outputs ``[M, H]``:
        one grouped FFN over the stacked weights, or DeepSpeed's expert modules one by one."""
        grouped = self._grouped
        if (
            grouped is not None
            and self.options.expert_compute != "loop"
            and grouped.resolve(self.options.expert_compute, rows) == "grouped"
        ):
            return grouped(rows, counts)
        # every local expert runs, also on zero rows, so each one's parameters get a (zero) gradient
        return torch.cat(
            [
                _first(expert(chunk))
                for chunk, expert in zip(rows.split(counts), self.experts.deepspeed_experts, strict=False)
            ]
        )

    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None) -> torch.Tensor:
        """``hidden_states [..., H]`` (BF16/FP32) → same shape; ``used_token`` as DeepSpeed's (k=1 only)."""
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"hidden_states: expected a tensor, got {type(hidden_states).__name__}")
        if hidden_states.dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"hidden_states: the plugin dispatches BF16 or FP32, got {hidden_states.dtype}")
        if self.options.fp8_dispatch and hidden_states.dtype != torch.bfloat16:
            raise TypeError(f"hidden_states: fp8_dispatch quantizes BF16 activations, got {hidden_states.dtype}")
        if self.ep_group is None:
            raise ValueError("ep_group: not set; run deepspeed.initialize (or MoE.set_deepspeed_parallelism) first")
        tp = bwc_tensor_model_parallel_world_size(groups.mpu)
        if tp > 1:
            raise ValueError(
                f"groups.mpu: tensor parallelism (size {tp}) around the MoE layer is not supported by the plugin layer"
            )
        self._time(MOE_TIMER, True)
        hidden = hidden_states.shape[-1]
        x = hidden_states.reshape(-1, hidden)
        routes = route(self.gate, x, used_token)
        self.l_aux, self.exp_counts = routes.l_aux, routes.exp_counts

        options = self.options
        buffer = get_buffer(
            self.ep_group,
            hidden * max(x.element_size(), 2),
            options.transport,
            options.timeout_s,
            options.num_sms,
            options.ranks_per_node,
            x.device,
        )
        configs = sm_configs(options.num_sms, buffer.group_size)
        self._time(FIRST_ALLTOALL_TIMER, True)
        rows, probs, counts, handle = ep_autograd.dispatch_experts(
            buffer,
            x,
            routes.topk_idx,
            routes.topk_weights,
            self.num_experts,
            fp8_dispatch=options.fp8_dispatch,
            round_scale=options.round_scale,
            configs=configs,
        )
        self._time(FIRST_ALLTOALL_TIMER, False)

        # gate weights applied in fp32 like DeepSpeed's decode, then the activations' dtype for the wire;
        # combine_experts sums each received row's routes in fp32
        weighted = (self.run_experts(rows, counts) * probs.unsqueeze(1)).to(x.dtype)

        self._time(SECOND_ALLTOALL_TIMER, True)
        out = ep_autograd.combine_experts(buffer, weighted, handle, configs=configs)
        self._time(SECOND_ALLTOALL_TIMER, False)
        self._time(MOE_TIMER, False)
        if self.wall_clock_breakdown:
            self.time_falltoall = self.timers(FIRST_ALLTOALL_TIMER).elapsed(reset=False)
            self.time_salltoall = self.timers(SECOND_ALLTOALL_TIMER).elapsed(reset=False)
            self.time_moe = self.timers(MOE_TIMER).elapsed(reset=False)
        return out.reshape(hidden_states.shape)


class MoE(DeepSpeedMoE):
    """``deepspeed.moe.layer.MoE`` with the plugin's dispatcher. Same constructor, plus the plugin's options
    (keyword-only, see :class:`DeepSpeedOptions`); ``forward`` returns ``(output, l_aux, exp_counts)``.

    Differences: dropless by default (``drop_tokens=False``; ``True`` keeps DeepSpeed's capacity drops);
    ``use_tutel`` and ``enable_expert_tensor_parallelism`` are refused. It is a subclass of DeepSpeed's ``MoE``,
    so ``deepspeed.initialize`` creates its expert groups and checkpoints its experts per rank as usual.
    """

    def __init__(
        self,
        hidden_size: int,
        expert: torch.nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = False,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
        *,
        router: str = "deepspeed",
        score_function: str = "softmax",
        use_pre_softmax: bool = False,
        num_groups: int | None = None,
        group_topk: int | None = None,
        scaling_factor: float | None = None,
        expert_bias_rate: float = 0.0,
        fp8_dispatch: bool = False,
        round_scale: bool = False,
        transport: str = "auto",
        num_sms: int | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        ranks_per_node: int | None = None,
        expert_compute: str = "auto",
    ) -> None:
        options = DeepSpeedOptions(
            router=router,
            score_function=score_function,
            use_pre_softmax=use_pre_softmax,
            num_groups=num_groups,
            group_topk=group_topk,
            scaling_factor=scaling_factor,
            expert_bias_rate=expert_bias_rate,
            fp8_dispatch=fp8_dispatch,
            round_scale=round_scale,
            transport=transport,
            num_sms=num_sms,
            timeout_s=timeout_s,
            ranks_per_node=ranks_per_node,
            expert_compute=expert_compute,
        )
        if not isinstance(expert, torch.nn.Module):
            raise TypeError(f"expert: expected a torch.nn.Module, got {type(expert).__name__}")
        if noisy_gate_policy not in (None, "None", "Jitter", "RSample"):
            raise ValueError(f"noisy_gate_policy: expected None, 'Jitter' or 'RSample', got {noisy_gate_policy!r}")
        check_moe_args(
            hidden_size, num_experts, ep_size, k, drop_tokens, use_tutel, enable_expert_tensor_parallelism, options
        )
        super().__init__(
            hidden_size,
            expert,
            num_experts,
            ep_size,
            k,
            capacity_factor,
            eval_capacity_factor,
            min_capacity,
            use_residual,
            noisy_gate_policy,
            drop_tokens,
            use_rts,
            False,
            False,
            top2_2nd_expert_sampling,
        )
        stock = self.deepspeed_moe
        gate = (
            GroupLimitedGate(hidden_size, num_experts, k, options, wg=stock.gate.wg)
            if options.router == "group_limited"
            else None
        )
        self.deepspeed_moe = PluginMOELayer.from_stock(stock, options, gate)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        check_world(self.ep_size)
        super().set_deepspeed_parallelism(use_data_before_expert_parallel_)


def convert_moe(model: torch.nn.Module, *, router: str = "deepspeed", **options) -> list[str]:
    """Swap the dispatcher of every stock ``deepspeed.moe.layer.MoE`` in ``model`` for :class:`PluginMOELayer`,
    reusing its gate, experts and EP group (call before or after ``deepspeed.initialize``; before keeps
    DeepSpeed's timers pointing at the new layers). ``options``: :class:`DeepSpeedOptions` fields. With
    ``router='group_limited'`` the new gate reuses the old gate's ``wg`` parameter. Returns the converted
    modules' names.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    opts = DeepSpeedOptions(router=router, **options)
    converted = []
    for name, module in model.named_modules():
        if not isinstance(module, DeepSpeedMoE) or isinstance(module.deepspeed_moe, PluginMOELayer):
            continue
        stock = module.deepspeed_moe
        gate = stock.gate
        check_moe_args(
            gate.wg.in_features,
            module.num_experts,
            module.ep_size,
            gate.k,
            gate.drop_tokens,
            False,
            module.enable_expert_tensor_parallelism,
            opts,
        )
        new_gate = (
            GroupLimitedGate(gate.wg.in_features, module.num_experts, gate.k, opts, wg=gate.wg)
            if opts.router == "group_limited"
            else None
        )
        module.deepspeed_moe = PluginMOELayer.from_stock(stock, opts, new_gate)
        converted.append(name)
    if not converted:
        raise ValueError("model: no deepspeed.moe.layer.MoE layer to convert")
    return converted


def update_expert_biases(model: torch.nn.Module, group: dist.ProcessGroup | None = None) -> int:
    """Apply the aux-loss-free bias step of every :class:`GroupLimitedGate` with a bias in ``model`` (call on all
    ranks after ``engine.step()``). Returns how many gates were updated."""
    gates = [m for m in model.modules() if isinstance(m, GroupLimitedGate) and m.expert_bias is not None]
    for gate in gates:
        gate.update_expert_bias(group)
    return len(gates)
