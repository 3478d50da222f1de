"""One shared ``Buffer`` per (process group, transport), grown when wider rows need more peer memory.

This is DeepEP's usage pattern (Megatron-Core keeps one global DeepEP buffer): the ``nvlink`` transport
pre-allocates peer-visible memory, so all MoE layers on a group share one buffer instead of one each.
The Megatron-Core dispatcher, the DeepSpeed layer and the example trainer all take their buffer from here
(:func:`get_buffer`: fetched per call, re-created when it must grow). Objects that keep their buffer, the
``deep_ep`` module's ``ElasticBuffer``/``EPBuffer`` (one per layer in DeepSpeed AutoEP before its PR #8557), hold
a :class:`Lease` on one shared Buffer instead (:func:`lease_buffer`): the last lease released destroys it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .buffer import Buffer, buffer_device
from .config import Config, combine_config, dispatch_config, positive_int
from .transports.nvlink.plan import dispatch_slot_bytes, staging_bytes

_BUFFERS: dict[tuple[dist.ProcessGroup, str, int | None, torch.device], Buffer] = {}
# lease_buffer's Buffers: the one new leases of a key get, and the live leases of each (an outgrown Buffer stays
# in _LEASES until its last lease is released)
_LEASED: dict[tuple[dist.ProcessGroup, str, int | None, torch.device, float | None], Buffer] = {}
_LEASES: dict[Buffer, int] = {}


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


def _new_buffer(key: tuple, num_nvl_bytes: int, timeout_s: float | None) -> Buffer:
    """A Buffer of ``num_nvl_bytes`` for a cache key ``(group, transport, ranks_per_node, device, ...)``."""
    group, transport, ranks_per_node, device = key[:4]
    return Buffer(
        group,
        num_nvl_bytes=num_nvl_bytes,
        transport=transport,
        timeout_s=timeout_s,
        ranks_per_node=ranks_per_node,
        device=device,
    )


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
        buffer = _new_buffer(key, need, timeout_s)
        _BUFFERS[key] = buffer
    return buffer


class Lease:
    """One holder's claim on a shared Buffer (:func:`lease_buffer`), valid until :meth:`release`."""

    def __init__(self, buffer: Buffer) -> None:
        self.buffer = buffer
        self.released = False

    def check_live(self) -> None:
        """Raise when this lease was released (its holder was destroyed; the Buffer may serve others still)."""
        if self.released:
            raise RuntimeError("buffer: used after destroy(), which released its share of the buffer; make a new one")

    def release(self) -> None:
        """Give up this claim (again: nothing); the last claim on the Buffer destroys it, which is collective for
        the kernel transports, so every rank releases the same leases in the same order."""
        if self.released:
            return
        self.released = True
        _LEASES[self.buffer] -= 1
        if _LEASES[self.buffer]:
            return
        del _LEASES[self.buffer]
        for key, buffer in list(_LEASED.items()):
            if buffer is self.buffer:
                del _LEASED[key]
        self.buffer.destroy()


def lease_buffer(
    group: dist.ProcessGroup,
    num_nvl_bytes: int,
    transport: str = "auto",
    timeout_s: float | None = None,
    device: torch.device | str | None = None,
    ranks_per_node: int | None = None,
) -> Lease:
    """A lease on the shared Buffer of ``group``, ``transport``, ``timeout_s``, ``device`` and ``ranks_per_node``
    (as :class:`moe_ep_plugin.Buffer` takes them) with at least ``num_nvl_bytes`` of peer memory.

    Collective: the ranks first compare their requests and whether they hold such a Buffer (every rank raises the
    same ``ValueError`` when they differ), then all reuse it or all make one. A request larger than the shared
    Buffer makes a new one that later leases share; leases on the outgrown one keep it until they are released.

    Arguments:
        group: the process group.
        num_nvl_bytes: the peer-memory bytes the holder needs (a non-negative int, the same on every rank).
        transport, timeout_s, device, ranks_per_node: as :class:`moe_ep_plugin.Buffer`.

    Returns:
        A :class:`Lease`; ``lease.buffer`` is the shared Buffer.
    """
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group: expected a torch.distributed.ProcessGroup, got {type(group).__name__}")
    positive_int(num_nvl_bytes, "num_nvl_bytes", 0)
    device = buffer_device(group, device)
    key = (group, transport, ranks_per_node, device, timeout_s)
    buffer = _LEASED.get(key)
    reuse = buffer is not None and not buffer.destroyed and buffer.num_nvl_bytes >= num_nvl_bytes
    mine = (num_nvl_bytes, transport, ranks_per_node, timeout_s, reuse)
    everyone: list[tuple | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    if any(other != mine for other in everyone):
        raise ValueError(
            "buffer: the ranks ask for different shared buffers: (num_bytes, transport, ranks_per_node, timeout, "
            f"holds one already) in rank order: {everyone}; pass the same on every rank, in the same order"
        )
    if not reuse:
        buffer = _new_buffer(key, num_nvl_bytes, timeout_s)
        _LEASED[key] = buffer
    _LEASES[buffer] = _LEASES.get(buffer, 0) + 1
    return Lease(buffer)


def cached_transports() -> list[str]:
    """Transports the shared buffers resolved to (``auto`` becomes ``nvlink`` or ``torch``)."""
    return sorted({buffer.transport_name for buffer in _BUFFERS.values()})


def destroy_buffers() -> None:
    """Release every shared Buffer (collective: every rank, before ``destroy_process_group``)."""
    for buffer in _BUFFERS.values():
        buffer.destroy()
    _BUFFERS.clear()
