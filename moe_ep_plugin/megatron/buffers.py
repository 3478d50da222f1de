"""One plugin ``Buffer`` per (process group, transport), sized for the largest hidden row seen so far.

Both the ``ep_plugin`` dispatcher and the ``flex`` + ``deepep`` shim take their Buffer from here, so a model
mixing both paths on one group shares one set of communication buffers (as Megatron does with DeepEP's).
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

from .. import Buffer
from .options import PluginOptions

_buffers: dict[tuple[Any, str], Any] = {}


def _nvl_bytes(group: dist.ProcessGroup, hidden_bytes: int) -> int:
    size = dist.get_world_size(group)
    return max(cfg.get_nvl_buffer_size_hint(hidden_bytes, size)
               for cfg in (Buffer.get_dispatch_config(size), Buffer.get_combine_config(size)))


def get_buffer(group: dist.ProcessGroup, hidden_bytes: int, options: PluginOptions) -> Any:
    """The cached Buffer for ``group`` and ``options.transport``, re-created when rows of ``hidden_bytes`` no
    longer fit at the current SM count (``Buffer.num_sms``, which the callers set)."""
    if group is None:
        raise ValueError("group: a torch.distributed process group is required")
    if hidden_bytes <= 0:
        raise ValueError(f"hidden_bytes must be positive, got {hidden_bytes}")
    key = (group, options.transport)
    need = _nvl_bytes(group, hidden_bytes)
    buffer = _buffers.get(key)
    if buffer is None or buffer.num_nvl_bytes < need:
        buffer = Buffer(group, num_nvl_bytes=need, num_rdma_bytes=0, transport=options.transport,
                        timeout_s=options.timeout_s)
        _buffers[key] = buffer
    return buffer


def clear_buffers() -> None:
    """Drop every cached Buffer (after the process groups they use are destroyed)."""
    _buffers.clear()
