"""``EPPluginTokenDispatcher``: Megatron-Core's six dispatcher methods on the plugin's Buffer.

Data flow for one MoE layer (T local tokens, E experts, K = top-k, L = E / EP local experts, H hidden):

    dispatch_preprocess  routing_map [T, E] bool, probs [T, E]  ->  tokens [T, H], top-k weights [T, K] fp32
                         (the top-k expert ids [T, K] int64, -1 = dropped, are kept for token_dispatch)
    token_dispatch       one row per (token, destination rank) through ``autograd.dispatch``; the weights travel
                         with their rows -> recv [R, H], recv weights [R, K] (local expert ids kept)
    dispatch_postprocess expert-major rows [M, H], tokens_per_expert [L] int64 (CPU), permuted probs [M] fp32
    (experts apply the probs)
    combine_preprocess   sum each received row's local-expert outputs -> [R, H]
    token_combine        ``autograd.combine``: unweighted sum over destination ranks -> [T, H]
    combine_postprocess  reshape to the input's shape (+ the shared expert's output when it is overlapped)

Gradients reach the tokens and the router probs through the same path in reverse. The only host sync is the
received-count read inside the Buffer's dispatch.
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from .. import Buffer
from .. import autograd as ep_autograd
from .. import permute as ep_permute
from ..buffer_cache import get_buffer
from .options import PLUGIN_DISPATCHER_TYPE, PluginOptions, get_plugin_options


def routing_map_to_topk(routing_map: torch.Tensor, probs: torch.Tensor, topk: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-hot ``routing_map`` ``[T, E]`` bool and ``probs`` ``[T, E]`` → ``(topk_idx [T, K] int64,
    topk_weights [T, K] float32)``; slots beyond a token's selected experts (dropped tokens) hold -1 and weight 0.

    Experts are taken from ``routing_map``, not from the largest probs, so dense or tied probs cannot change
    which experts a token reaches. Differentiable in ``probs``.
    """
    if routing_map.dtype != torch.bool or routing_map.dim() != 2:
        raise ValueError(f"routing_map: expected a 2-D bool [tokens, experts] tensor, got {routing_map.dtype} "
                         f"{tuple(routing_map.shape)}")
    if probs.shape != routing_map.shape:
        raise ValueError(f"probs: expected shape {tuple(routing_map.shape)}, got {tuple(probs.shape)}")
    if not 1 <= topk <= routing_map.shape[1]:
        raise ValueError(f"topk must be in [1, {routing_map.shape[1]}], got {topk}")
    selected, idx = torch.topk(routing_map.to(torch.int8), topk, dim=1, sorted=False)
    valid = selected > 0
    weights = torch.where(valid, probs.gather(1, idx).float(), 0.0)
    return idx.masked_fill(~valid, -1), weights


class EPPluginTokenDispatcher(MoETokenDispatcher):
    """Megatron-Core ``MoETokenDispatcher`` over ``moe_ep_plugin.Buffer`` (built by ``MoELayer`` for
    ``moe_token_dispatcher_type: ep_plugin`` once :func:`moe_ep_plugin.megatron.install` ran)."""

    def __init__(self, num_local_experts: int, local_expert_indices: List[int], config: Any,
                 pg_collection: Optional[Any] = None, options: Optional[PluginOptions] = None) -> None:
        if pg_collection is None:
            from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
            pg_collection = get_default_pg_collection()
        super().__init__(config=config, pg_collection=pg_collection)
        self.options = options if options is not None else get_plugin_options(config)
        if not isinstance(self.options, PluginOptions):
            raise TypeError(f"options: expected PluginOptions, got {type(self.options).__name__}")
        if self.tp_size > 1:
            raise ValueError(
                f"{PLUGIN_DISPATCHER_TYPE}: expert tensor parallelism is not supported (expert TP size "
                f"{self.tp_size}); set expert_tensor_parallel_size: 1 (attention TP with sequence parallelism "
                f"is fine)")
        if config.moe_pad_expert_input_to_capacity:
            raise ValueError(f"{PLUGIN_DISPATCHER_TYPE}: moe_pad_expert_input_to_capacity (drop-and-pad) is not "
                             f"supported; capacity dropping without padding is")
        if getattr(config, "overlap_moe_expert_parallel_comm", False):
            raise ValueError(f"{PLUGIN_DISPATCHER_TYPE}: overlap_moe_expert_parallel_comm is not supported "
                             f"(Megatron's 1F1B overlap schedule only knows its own dispatchers)")
        if num_local_experts <= 0 or len(local_expert_indices) != num_local_experts:
            raise ValueError(f"num_local_experts={num_local_experts} does not match local_expert_indices "
                             f"{local_expert_indices}")
        if config.num_moe_experts != num_local_experts * self.ep_size:
            raise ValueError(f"num_moe_experts={config.num_moe_experts} != num_local_experts "
                             f"{num_local_experts} x EP {self.ep_size}")
        self.num_local_experts = num_local_experts
        self.local_expert_indices = local_expert_indices
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        self.alignment = 1
        if getattr(config, "moe_router_padding_for_quantization", False):
            from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization
            self.alignment = max(1, get_align_size_for_quantization(config))
        self.shared_experts = None
        self._clear_state()

    def _clear_state(self) -> None:
        self._topk_idx: Optional[torch.Tensor] = None
        self._recv_idx: Optional[torch.Tensor] = None
        self._counts: Optional[list[int]] = None
        self._handle = None
        self._row_map = None
        self._buffer = None

    def set_shared_experts(self, shared_experts: Any) -> None:
        """Run the shared expert on Megatron's side stream while tokens travel (``moe_shared_expert_overlap``)."""
        if not self.config.moe_shared_expert_overlap:
            raise ValueError("set_shared_experts needs config.moe_shared_expert_overlap=True")
        self.shared_experts = shared_experts

    def dispatch_preprocess(self, tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """``tokens`` ``[S, B, H]`` (or ``[T, H]``), ``routing_map``/``probs`` ``[T, E]`` →
        ``(tokens [T, H], topk_weights [T, K] float32)``."""
        self.hidden_shape = tokens.shape
        hidden = tokens.reshape(-1, self.hidden_shape[-1])
        if routing_map.shape != (hidden.shape[0], self.num_experts):
            raise ValueError(f"routing_map: expected shape {(hidden.shape[0], self.num_experts)}, got "
                             f"{tuple(routing_map.shape)}")
        if self.options.fp8_dispatch and hidden.shape[1] % 128:
            raise ValueError(f"fp8_dispatch needs hidden % 128 == 0, got hidden {hidden.shape[1]}")
        self._topk_idx, weights = routing_map_to_topk(routing_map, probs, self.topk)
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(tokens.view(self.hidden_shape))
        return hidden, weights

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Send every token once to each rank holding one of its experts; ``probs`` (the ``[T, K]`` weights)
        travel with the rows. → ``(recv [R, H], recv_weights [R, K] float32)``."""
        if self._topk_idx is None or self._topk_idx.shape[0] != hidden_states.shape[0]:
            raise RuntimeError("token_dispatch called without a matching dispatch_preprocess")
        if self.options.num_sms is not None:  # before sizing: the buffer size hint grows with the SM count
            Buffer.set_num_sms(self.options.num_sms)
        self._buffer = get_buffer(self.ep_group, hidden_states.shape[1] * max(hidden_states.element_size(), 2),
                                  self.options.transport, self.options.timeout_s)
        recv_x, recv_idx, recv_weights, counts, handle = ep_autograd.dispatch(
            self._buffer, hidden_states, self._topk_idx, probs, self.num_experts,
            fp8_dispatch=self.options.fp8_dispatch, expert_alignment=self.alignment)
        self._recv_idx, self._counts, self._handle = recv_idx, list(counts), handle
        self._topk_idx = None
        if self.shared_experts is not None:
            self.shared_experts.linear_fc1_forward_and_act(recv_x)
        return recv_x, recv_weights

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Received rows → expert-major ``(tokens [M, H], tokens_per_expert [L] int64 on CPU, probs [M])``;
        expert ``l`` owns rows ``[sum(tpe[:l]), sum(tpe[:l+1]))``, each padded to the quantization alignment
        when ``moe_router_padding_for_quantization`` is set."""
        if self._recv_idx is None:
            raise RuntimeError("dispatch_postprocess called before token_dispatch")
        permuted, permuted_probs, _, self._row_map = ep_permute.permute(
            hidden_states, self._recv_idx, probs, self.num_local_experts, self._counts, self.alignment)
        self._recv_idx = None
        tokens_per_expert = torch.tensor(self._counts, dtype=torch.long)
        if self.config.moe_router_dtype == "fp64":
            permuted_probs = permuted_probs.to(torch.float64)
        return permuted, tokens_per_expert, permuted_probs

    def combine_preprocess(self, hidden_states: torch.Tensor):
        """Expert outputs ``[M, H]`` → ``[R, H]``: each received row's local-expert outputs summed."""
        if self._row_map is None:
            raise RuntimeError("combine_preprocess called before dispatch_postprocess")
        # Summed in the experts' dtype, as Megatron-Core's own unpermute does: an fp32 copy of every permuted
        # row cost 2.4 of 5.8 ms of the forward at DeepSeek-V3 shape on 2 x H200 (benchmarks/RESULTS.md).
        out = ep_permute.unpermute(hidden_states, self._row_map, fp32_accumulation=False)
        self._row_map = None
        return out

    def token_combine(self, hidden_states: torch.Tensor):
        """Send each row back to its source rank and sum per token → ``[T, H]``."""
        if self._handle is None:
            raise RuntimeError("token_combine called before token_dispatch")
        if self.shared_experts is not None and hasattr(self.shared_experts, "wait_current_stream"):
            self.shared_experts.wait_current_stream()
        out = ep_autograd.combine(self._buffer, hidden_states, self._handle)
        if self.shared_experts is not None:
            self.shared_experts.linear_fc2_forward(out)
            self.shared_experts.post_forward_comm()
        self._handle = None
        return out

    def combine_postprocess(self, hidden_states: torch.Tensor):
        """``[T, H]`` → the input's original shape, plus the overlapped shared expert's output."""
        hidden_states = hidden_states.view(self.hidden_shape)
        if self.shared_experts is not None:  # its output has the input's [S, B, H] shape: add after the reshape
            hidden_states = hidden_states + self.shared_experts.get_output().view(self.hidden_shape)
        self._buffer = None
        return hidden_states
