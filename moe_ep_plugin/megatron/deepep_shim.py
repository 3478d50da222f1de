"""DeepEP-compatible ``fused_dispatch`` / ``fused_combine`` / ``set_deepep_num_sms`` on the plugin's Buffer.

Megatron-Core's ``flex`` dispatcher with ``moe_flex_dispatcher_backend: deepep`` resolves these three names
from ``megatron.core.transformer.moe.token_dispatcher`` at call time; :func:`moe_ep_plugin.megatron.install`
binds them there (and in ``fused_a2a``), so configs written for DeepEP run unchanged on this library.
The signatures and results are those of ``megatron.core.transformer.moe.fused_a2a``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .. import Buffer
from .. import autograd as ep_autograd
from ..buffer_cache import get_buffer
from .options import PluginOptions

_options = PluginOptions()


def configure(options: PluginOptions) -> None:
    """Options used by the shim (transport, FP8 dispatch, timeout); set by ``install``."""
    global _options
    if not isinstance(options, PluginOptions):
        raise TypeError(f"options: expected PluginOptions, got {type(options).__name__}")
    _options = options


def current_options() -> PluginOptions:
    return _options


def _hidden_bytes(x: torch.Tensor) -> int:
    return x.size(1) * max(x.element_size(), 2)


def fused_dispatch(
    x: torch.Tensor,
    token_indices: torch.Tensor,
    token_probs: torch.Tensor,
    num_experts: int,
    group: dist.ProcessGroup,
    async_finish: bool = False,
    allocate_on_comm_stream: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Any]:
    """``x`` ``[T, H]`` BF16/FP16/FP32, ``token_indices`` ``[T, K]``
    int64 global expert ids (-1 = none), ``token_probs`` ``[T, K]`` float32 → ``(recv_x [R, H] x.dtype, recv_indices
    [R, K] local ids / -1, recv_probs [R, K] float32, tokens_per_expert [L] int64 on CPU, handle)``. Differentiable in
    ``x`` and ``token_probs``.

    The work runs on the current stream, so ``async_finish``/``allocate_on_comm_stream`` need no event: the
    results are ready for the next kernel on that stream.
    """
    if x.dim() != 2:
        raise ValueError(f"x: expected [tokens, hidden], got shape {tuple(x.shape)}")
    if token_probs.dtype != torch.float32:
        raise TypeError(f"token_probs: expected float32 (as DeepEP), got {token_probs.dtype}")
    buffer = get_buffer(group, _hidden_bytes(x), _options.transport, _options.timeout_s, device=x.device)
    recv_x, recv_idx, recv_probs, counts, handle = ep_autograd.dispatch(
        buffer,
        x.contiguous(),
        token_indices,
        token_probs,
        num_experts,
        fp8_dispatch=_options.fp8_dispatch,
        round_scale=_options.round_scale,
    )
    counts = torch.tensor(list(counts), dtype=torch.long, device="cpu")
    return recv_x, recv_idx, recv_probs, counts, (group, buffer, handle)


def fused_combine(
    x: torch.Tensor,
    group: dist.ProcessGroup,
    handle: Any,
    async_finish: bool = False,
    allocate_on_comm_stream: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` ``[R, H]`` → ``(combined [T, H] x.dtype, None)``: each token's rows summed over the ranks it went to
    (in fp32)."""
    handle_group, buffer, dispatch_handle = handle
    if handle_group is not group:
        raise ValueError("group: differs from the group of the dispatch that made this handle")
    combined = ep_autograd.combine(buffer, x.contiguous(), dispatch_handle)
    return combined, None


def set_deepep_num_sms(num_sms: int | None) -> None:
    """Megatron's SM budget for the communication kernels (``moe_flex_dispatcher_num_sms``/``moe_deepep_num_sms``)."""
    if num_sms is not None:
        Buffer.set_num_sms(num_sms)
