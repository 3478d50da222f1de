"""``EPPluginTokenDispatcher``: Megatron-Core's six dispatcher methods on the plugin's Buffer.

Data flow for one MoE layer (T local tokens, E experts, K = top-k, L = E / EP local experts, H hidden,
M = expert-major rows on this rank):

    dispatch_preprocess  routing_map [T, E] bool, probs [T, E]  ->  tokens [T, H], probs [T, E] (the routing map is
                         kept for token_dispatch)
    token_dispatch       ``autograd.dispatch_experts_from_routing_map``: each token's selected experts (top-k ids,
                         -1 = dropped, and their probs) from the map, then every token crosses once per
                         destination rank and lands in the expert-major layout -> rows [M, H], probs [M] fp32 (0
                         on padding rows)
    dispatch_postprocess the same rows and probs, tokens_per_expert [L] int64 (CPU; on the device when budgeted)
    (experts apply the probs)
    combine_preprocess   identity: combine_experts takes the expert outputs [M, H] as they are
    token_combine        ``autograd.combine_experts``: each received row's local-expert outputs summed (fp32),
                         then the sum over destination ranks -> [T, H]
    combine_postprocess  reshape to the input's shape (+ the shared expert's output when it is overlapped)

Gradients reach the tokens and the router probs through the same path in reverse. This module adds no host
sync: the per-expert counts come back from the Buffer's dispatch as a host list (its one host read).
Budgeted (``ep_plugin.recv_capacity_factor``, or a CUDA graph holding the dispatch): ``budget.py`` instead, a
dropless dispatch into a fixed number of expert-major rows with the counts on the device and nothing read on the
host on ``nvlink``/``local``; pairs past the budget are counted on the device and :meth:`check_over_budget` raises.

Expert TP (TP > 1): the group is Megatron's TP x EP group and ``[T, E]`` becomes ``[T, EP * TP * L]`` (each expert's
column repeated for the TP ranks of its EP rank), so K and E scale by TP; the combine sums the TP partial outputs.
Drop-and-pad: ``drop_and_pad.py`` instead: each expert's ``capacity`` tokens as ``alltoall`` takes them, every pair a
row of its own, ``capacity * TP * EP`` rows per local expert, no host read (CUDA-graph capturable on ``nvlink``).
FP16: rows travel as fp16 on every transport and the combine sums them in fp32, as BF16 rows.

Megatron's 1F1B EP-overlap schedule (``overlap_moe_expert_parallel_comm``) calls these methods from separate nodes
whose inputs are detached: tokens and probs reach the autograd functions only through the arguments, and what this
object keeps between calls (routing map, counts, handle) carries no graph, so each node's backward stays inside it.
"""

from __future__ import annotations

import array
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_utils import get_capacity
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher
from megatron.core.utils import get_pg_rank

from .. import Buffer
from .. import autograd as ep_autograd
from ..buffer_cache import get_buffer, sm_configs
from . import budget, drop_and_pad, ncclep_shim
from .options import (
    PluginOptions,
    captured_dispatch,
    check_fp16,
    get_plugin_options,
    row_budget,
)


class EPPluginTokenDispatcher(MoETokenDispatcher):
    """Megatron-Core ``MoETokenDispatcher`` over ``moe_ep_plugin.Buffer`` (built by ``MoELayer`` for
    ``moe_token_dispatcher_type: ep_plugin`` once :func:`moe_ep_plugin.megatron.install` ran)."""

    def __init__(
        self,
        num_local_experts: int,
        local_expert_indices: list[int],
        config: Any,
        pg_collection: Any | None = None,
        options: PluginOptions | None = None,
    ) -> None:
        if pg_collection is None:
            from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

            pg_collection = get_default_pg_collection()
        super().__init__(config=config, pg_collection=pg_collection)
        self.options = options if options is not None else get_plugin_options(config)
        if not isinstance(self.options, PluginOptions):
            raise TypeError(f"options: expected PluginOptions, got {type(self.options).__name__}")
        check_fp16(config, self.options)
        if num_local_experts <= 0 or len(local_expert_indices) != num_local_experts:
            raise ValueError(
                f"num_local_experts={num_local_experts} does not match local_expert_indices {local_expert_indices}"
            )
        if config.num_moe_experts != num_local_experts * self.ep_size:
            raise ValueError(
                f"num_moe_experts={config.num_moe_experts} != num_local_experts {num_local_experts} x EP {self.ep_size}"
            )
        self.num_local_experts = num_local_experts
        self.local_expert_indices = local_expert_indices
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        self.alignment = 1
        # Expert TP as Megatron's flex dispatcher does it: the dispatch group is the TP x EP group and every
        # token goes to each TP rank of its experts' EP rank (the routing map replicated over TP), whose partial
        # expert outputs the combine sums. Group rank r must be (EP rank r // TP, TP rank r % TP).
        self.group = self.ep_group if self.tp_size == 1 else self.tp_ep_group
        group_rank = get_pg_rank(self.group)
        ep_rank = get_pg_rank(self.ep_group)
        if group_rank != ep_rank * self.tp_size + self.tp_rank:
            raise ValueError(
                f"pg_collection.tp_ep: rank {group_rank} is not EP rank {ep_rank} x TP "
                f"{self.tp_size} + TP rank {self.tp_rank} (expert TP must be the fastest dimension)"
            )
        self.drop_and_pad = bool(config.moe_pad_expert_input_to_capacity)
        if self.drop_and_pad and config.moe_expert_capacity_factor is None:
            raise ValueError("moe_pad_expert_input_to_capacity needs moe_expert_capacity_factor")
        # Dropless with a device-side row budget (budget.py; no host read) where the options give one or a CUDA
        # graph holds the dispatch (then the worst case); otherwise the counted dispatch, whose layout is exact.
        self.budget_key, self.budget_factor, self.budget_drops = row_budget(config, self.options)
        self.budgeted = not self.drop_and_pad and (
            self.budget_factor is not None or captured_dispatch(config) is not None
        )
        self._excess: torch.Tensor | None = None  # budgeted: the most pairs past the budget since the last check
        if getattr(config, "moe_router_padding_for_quantization", False):
            from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization

            self.alignment = max(1, get_align_size_for_quantization(config))
        self.shared_experts = None
        # The shared buffer of the last token_dispatch and what get_buffer was asked for it: reused while the key
        # matches and the buffer is alive (get_buffer destroys a buffer before replacing it), which saves
        # get_buffer's size computation on every call.
        self._shared_buffer: Buffer | None = None
        self._shared_buffer_key: tuple | None = None
        self._configs: ep_autograd.Configs = None  # per-call (dispatch, combine) Configs; see _get_buffer
        self._clear_state()

    def _clear_state(self) -> None:
        self._routing_map: torch.Tensor | None = None
        self._capacity: int | None = None  # drop-and-pad: every expert's tokens on each rank
        self._pad: drop_and_pad.PadLayout | None = None  # drop-and-pad: this dispatch's pairs
        self._tokens_per_expert: list[int] | torch.Tensor | None = None  # a device tensor when budgeted
        self._handle = None
        self._buffer = None

    def set_shared_experts(self, shared_experts: Any) -> None:
        """Run the shared expert on Megatron's side stream while tokens travel (``moe_shared_expert_overlap``)."""
        if not self.config.moe_shared_expert_overlap:
            raise ValueError("set_shared_experts needs config.moe_shared_expert_overlap=True")
        self.shared_experts = shared_experts

    def dispatch_preprocess(self, tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """``tokens`` ``[S, B, H]`` (or ``[T, H]``), ``routing_map``/``probs`` ``[T, E]`` → ``(tokens [T, H],
        probs [T, E])``; token_dispatch takes the experts from ``routing_map`` (and checks it with ``probs``)."""
        self.hidden_shape = tokens.shape
        hidden = tokens.reshape(-1, self.hidden_shape[-1])
        if routing_map.shape != (hidden.shape[0], self.num_experts):
            raise ValueError(
                f"routing_map: expected shape {(hidden.shape[0], self.num_experts)}, got {tuple(routing_map.shape)}"
            )
        if self.options.fp8_dispatch and hidden.shape[1] % 128:
            raise ValueError(f"fp8_dispatch needs hidden % 128 == 0, got hidden {hidden.shape[1]}")
        if self.drop_and_pad:  # the capacity of Megatron's router and alltoall, from this rank's token count
            self._capacity = get_capacity(
                num_tokens=hidden.shape[0] * self.topk,
                num_experts=self.num_experts,
                capacity_factor=self.config.moe_expert_capacity_factor,
            )
        if self.tp_size > 1:
            routing_map, probs = self._replicate_over_tp(routing_map), self._replicate_over_tp(probs)
        self._routing_map = routing_map  # the rest of the routing map's checks: token_dispatch, before any transfer
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(tokens.view(self.hidden_shape))
        return hidden, probs

    def _replicate_over_tp(self, per_expert: torch.Tensor) -> torch.Tensor:
        """``[T, E]`` → ``[T, EP * TP * L]``: expert ``(p, l)``'s column repeated for each TP rank of EP rank ``p``
        (the TP x EP group's ranks ``p * TP + t``); differentiable (the gradient sums the TP copies)."""
        tokens = per_expert.shape[0]
        return (
            per_expert.reshape(tokens, self.ep_size, 1, self.num_local_experts)
            .expand(tokens, self.ep_size, self.tp_size, self.num_local_experts)
            .reshape(tokens, self.ep_size * self.tp_size * self.num_local_experts)
        )

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Send every token once to each rank holding one of its experts, straight into that rank's expert-major
        layout; each token's selected probs (``probs`` ``[T, E]``) travel with its rows. → ``(rows [M, H], probs [M]
        float32)``, expert ``l`` owning rows ``[sum(tpe[:l]), sum(tpe[:l+1]))``, each block padded with zero rows
        (prob 0) to the quantization alignment when ``moe_router_padding_for_quantization`` is set."""
        if self._routing_map is None or self._routing_map.shape[0] != hidden_states.shape[0]:
            raise RuntimeError("token_dispatch called without a matching dispatch_preprocess")
        hidden_bytes = hidden_states.shape[1] * max(hidden_states.element_size(), 2)
        if self.drop_and_pad:
            expert_x, expert_probs, tokens_per_expert, handle = self._dispatch_padded(
                hidden_states, probs, hidden_bytes
            )
        elif self.budgeted:
            expert_x, expert_probs, tokens_per_expert, handle = self._dispatch_budgeted(
                hidden_states, probs, hidden_bytes
            )
        else:
            self._buffer = self._get_buffer(hidden_bytes, hidden_states.device)
            expert_x, expert_probs, tokens_per_expert, handle = ep_autograd.dispatch_experts_from_routing_map(
                self._buffer, hidden_states, *self._routed(probs), expert_alignment=self.alignment, **self._wire()
            )
        self._tokens_per_expert, self._handle = tokens_per_expert, handle
        self._routing_map = None
        if self.shared_experts is not None:
            self.shared_experts.linear_fc1_forward_and_act(expert_x)
        return expert_x, expert_probs

    def _routed(self, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """``(routing_map, probs, top-k, experts)`` of a dispatch from the kept routing map (TP-folded)."""
        return self._routing_map, probs, self.topk * self.tp_size, self.num_experts * self.tp_size

    def _wire(self) -> dict[str, Any]:
        """How rows cross: the FP8 options and the per-call Configs (every dispatch takes them by these names)."""
        return {
            "fp8_dispatch": self.options.fp8_dispatch,
            "round_scale": self.options.round_scale,
            "configs": self._configs,
        }

    def _dispatch_padded(
        self, hidden_states: torch.Tensor, probs: torch.Tensor, hidden_bytes: int
    ) -> tuple[torch.Tensor, torch.Tensor, list[int], Any]:
        """Drop-and-pad's dispatch (``drop_and_pad.dispatch``): every local expert gets its fixed rows."""
        layout = drop_and_pad.pad_layout(self._routing_map, self._capacity, self.ep_size * self.tp_size, self.alignment)
        self._buffer = self._get_buffer(hidden_bytes, hidden_states.device, layout.num_pairs)
        expert_x, expert_probs, handle = drop_and_pad.dispatch(
            self._buffer, hidden_states, probs, layout, **self._wire()
        )
        self._pad = layout
        return expert_x, expert_probs, [layout.block] * layout.num_local, handle

    def _dispatch_budgeted(
        self, hidden_states: torch.Tensor, probs: torch.Tensor, hidden_bytes: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, budget.BudgetHandle]:
        """The dropless dispatch sized from the row budget (``budget.dispatch``): the pairs past it are counted on
        the device for :meth:`check_over_budget`."""
        group_size = self.ep_size * self.tp_size
        rows = budget.row_budget(
            hidden_states.shape[0],
            group_size,
            self.topk * self.tp_size,
            self.num_local_experts,
            self.alignment,
            self.budget_factor,
        )
        self._buffer = self._get_buffer(hidden_bytes, hidden_states.device)
        expert_x, expert_probs, tokens_per_expert, handle, excess = budget.dispatch(
            self._buffer, rows, hidden_states, *self._routed(probs), alignment=self.alignment, **self._wire()
        )
        if self._excess is None or self._excess.device != excess.device:
            self._excess = torch.zeros((), dtype=torch.int64, device=excess.device)
        torch.maximum(self._excess, excess, out=self._excess)  # in place: a graph's replays accumulate too
        return expert_x, expert_probs, tokens_per_expert, handle

    def check_over_budget(self) -> None:
        """Raise on every rank of the group, naming the key to raise, when a budgeted dispatch since the last call
        had more expert rows than its row budget gives (``self.budget_key``; those pairs were dropped), unless the
        config asks for the drop (``ep_plugin.drop_on_overflow``, or Megatron's ``moe_expert_rank_capacity_factor``,
        a budget that drops); then reset the count. Collective over the group (one all-reduce) and one host read:
        call it where the host waits anyway (after the optimizer step), on every rank. A no-op for the other
        dispatches."""
        if not self.budgeted:
            return None
        # NCCL reduces on the current GPU, gloo on the host (its ranks may share a GPU)
        nccl = dist.get_backend(self.group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        excess = self._excess if self._excess is not None else torch.zeros((), dtype=torch.int64)
        words = excess.reshape(1).to(device, copy=True)
        dist.all_reduce(words, op=dist.ReduceOp.MAX, group=self.group)
        if self._excess is not None:
            self._excess.zero_()
        most = int(words[0])
        if most and not self.budget_drops:
            raise ValueError(
                f"{self.budget_key}: a rank's experts received up to {most} rows more than the budget of "
                f"{self.budget_factor} (those pairs were dropped); raise {self.budget_key}, or set "
                f"ep_plugin.drop_on_overflow: true to accept the drops"
            )
        return None

    def _get_buffer(self, hidden_bytes: int, device: torch.device | None = None, rows: int = 0) -> Buffer:
        """The shared Buffer of the EP group on the tokens' ``device`` (None: the group's default, see ``Buffer``;
        a gloo group's ranks sharing one GPU pass it) for rows of ``hidden_bytes`` (``rows`` of them from every rank
        at once, see ``get_buffer``) at this dispatcher's SM count (its ``num_sms``, else ``Buffer.num_sms``), which
        also sets ``self._configs``, the per-call Configs of that SM count (None: the Buffer's defaults). Nothing
        global changes."""
        options = self.options
        num_sms = Buffer.num_sms if options.num_sms is None else options.num_sms
        key = (hidden_bytes, num_sms, options, device, rows)
        buffer = self._shared_buffer
        if buffer is None or buffer.destroyed or key != self._shared_buffer_key:
            buffer = get_buffer(
                self.group,
                hidden_bytes,
                options.transport,
                options.timeout_s,
                num_sms,
                options.ranks_per_node,
                device,
                rows,
            )
            self._shared_buffer, self._shared_buffer_key = buffer, key
            self._configs = sm_configs(options.num_sms, buffer.group_size)
        return buffer

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """The expert-major rows as token_dispatch returned them → ``(tokens [M, H], tokens_per_expert [L] int64
        on CPU (on the rows' device when budgeted), probs [M])`` (float64 probs when ``moe_router_dtype`` is
        ``fp64``)."""
        if self._tokens_per_expert is None:
            raise RuntimeError("dispatch_postprocess called before token_dispatch")
        tokens_per_expert = self._tokens_per_expert
        if isinstance(tokens_per_expert, list):
            # A host list: no sync. Through an int64 array (the tensor keeps it alive): a third of torch.tensor's
            # host time on CPU.
            tokens_per_expert = torch.frombuffer(array.array("q", tokens_per_expert), dtype=torch.long)
        self._tokens_per_expert = None
        if self.config.moe_router_dtype == "fp64":
            probs = probs.to(torch.float64)
        return hidden_states, tokens_per_expert, probs

    def combine_preprocess(self, hidden_states: torch.Tensor):
        """Expert outputs ``[M, H]`` unchanged: ``token_combine``'s ``combine_experts`` reads the expert-major
        rows itself and sums each received row's local-expert outputs inside the combine (in fp32, in top-k
        order), so no separate unpermute runs here."""
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor):
        """Expert outputs ``[M, H]`` → ``[T, H]``: each row's local experts summed, sent back to its source rank
        and summed over ranks per token."""
        if self._handle is None and self._pad is None:  # drop-and-pad in a group of one rank has no handle
            raise RuntimeError("token_combine called before token_dispatch")
        if self.shared_experts is not None and hasattr(self.shared_experts, "wait_current_stream"):
            self.shared_experts.wait_current_stream()
        if self._pad is not None:
            out = drop_and_pad.combine(self._buffer, hidden_states, self._handle, self._pad, configs=self._configs)
        elif isinstance(self._handle, budget.BudgetHandle):
            out = budget.combine(self._buffer, hidden_states, self._handle, configs=self._configs)
        else:
            out = ep_autograd.combine_experts(self._buffer, hidden_states, self._handle, configs=self._configs)
        if self.shared_experts is not None:
            self.shared_experts.linear_fc2_forward(out)
            self.shared_experts.post_forward_comm()
        self._handle = self._pad = None
        return out

    def combine_postprocess(self, hidden_states: torch.Tensor):
        """``[T, H]`` → the input's original shape, plus the overlapped shared expert's output."""
        hidden_states = hidden_states.view(self.hidden_shape)
        if self.shared_experts is not None:  # its output has the input's [S, B, H] shape: add after the reshape
            hidden_states = hidden_states + self.shared_experts.get_output().view(self.hidden_shape)
        self._buffer = None
        return hidden_states


def check_over_budget(model: torch.nn.Module) -> None:
    """:meth:`EPPluginTokenDispatcher.check_over_budget` of every MoE layer of ``model`` (each a module holding an
    ``EPPluginTokenDispatcher`` as ``token_dispatcher``), in module order: collective, so every rank calls it at the
    same point (the launcher: after each optimizer step); then the ``flex`` + ``ncclep`` shim's capacity check
    (``ncclep_shim.check_over_budget``, a no-op unless bootstrapped)."""
    for module in model.modules():
        dispatcher = getattr(module, "token_dispatcher", None)
        if isinstance(dispatcher, EPPluginTokenDispatcher):
            dispatcher.check_over_budget()
    ncclep_shim.check_over_budget()
