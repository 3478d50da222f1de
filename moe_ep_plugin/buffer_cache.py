"""One shared ``Buffer`` per (process group, transport), grown when wider rows need more peer memory.

This is DeepEP's usage pattern (Megatron-Core keeps one global DeepEP buffer): the ``nvlink`` transport
pre-allocates peer-visible memory, so all MoE layers on a group share one buffer instead of one each.
The Megatron-Core dispatcher, the DeepSpeed layer and the example trainer all take their buffer from here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .buffer import Buffer, buffer_device
from .config import Config, combine_config, dispatch_config
from .transports.nvlink.plan import dispatch_slot_bytes, staging_bytes

_BUFFERS: dict[tuple[dist.ProcessGroup, str, int | None, torch.device], Buffer] = {}


def nvl_bytes_hint(num_ranks: int, hidden_bytes: int, num_sms: int | None = None, rows: int = 0) -> int:
    """Peer-buffer bytes for rows of ``hidden_bytes`` (FP8 rows sized as BF16), over the dispatch and combine
    configs at ``num_sms`` SMs (None: ``Buffer.num_sms``); with ``rows`` > 0 also room for every rank to stage
    that many rows of one top-k column at once (the ``nvlink`` staging holds a whole dispatch)."""
    if hidden_bytes <= 0:
        raise ValueError(f"hidden_bytes: expected a positive byte count, got {hidden_bytes}")
    sms = Buffer.num_sms if num_sms is None else num_sms
    staging = staging_bytes(num_ranks, rows, dispatch_slot_bytes(hidden_bytes, 1, False, 1)) if rows > 0 else 0
    return max(
        dispatch_config(sms, num_ranks).get_nvl_buffer_size_hint(hidden_bytes, num_ranks),
        combine_config(sms, num_ranks).get_nvl_buffer_size_hint(hidden_bytes, num_ranks),
        staging,
    )


def sm_configs(num_sms: int | None, num_ranks: int) -> tuple[Config, Config] | None:
    """The ``(dispatch, combine)`` Configs of ``num_sms`` SMs for a call; None (the Buffer's defaults) when
    ``num_sms`` is None."""
    if num_sms is None:
        return None
    return dispatch_config(num_sms, num_ranks), combine_config(num_sms, num_ranks)


def get_buffer(
    group: dist.ProcessGroup,
    hidden_bytes: int,
    transport: str = "auto",
    timeout_s: float | None = None,
    num_sms: int | None = None,
    ranks_per_node: int | None = None,
    device: torch.device | str | None = None,
    rows: int = 0,
) -> Buffer:
    """The shared Buffer of ``group``, ``transport``, ``ranks_per_node`` (None: the launcher's nodes) and
    ``device`` (None: the group's default, see ``Buffer``; a CUDA device with a gloo group serves ranks that share
    one GPU); re-created (collectively) when rows of ``hidden_bytes`` no longer fit at ``num_sms`` SMs (None:
    ``Buffer.num_sms``), or ``rows`` of them from every rank at once (see :func:`nvl_bytes_hint`). Collective on
    first use, so every rank passes the same sizes."""
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group: expected a torch.distributed.ProcessGroup, got {type(group).__name__}")
    need = nvl_bytes_hint(dist.get_world_size(group), hidden_bytes, num_sms, rows)
    device = buffer_device(group, device)
    key = (group, transport, ranks_per_node, device)
    buffer = _BUFFERS.get(key)
    if buffer is None or buffer.num_nvl_bytes < need:
        if buffer is not None:
            buffer.destroy()
        buffer = Buffer(
            group,
            num_nvl_bytes=need,
            transport=transport,
            timeout_s=timeout_s,
            ranks_per_node=ranks_per_node,
            device=device,
        )
        _BUFFERS[key] = buffer
    return buffer


def cached_transports() -> list[str]:
    """Transports the shared buffers resolved to (``auto`` becomes ``nvlink`` or ``torch``)."""
    return sorted({buffer.transport_name for buffer in _BUFFERS.values()})


def destroy_buffers() -> None:
    """Release every shared Buffer (collective: every rank, before ``destroy_process_group``)."""
    for buffer in _BUFFERS.values():
        buffer.destroy()
    _BUFFERS.clear()
