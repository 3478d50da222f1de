"""Transport registry: a group of one rank gets ``local`` whatever was asked for (nothing crosses, so no transport
has anything to add); otherwise ``auto`` → ``hierarchical`` when the group spans nodes and ``nvlink`` serves every
node, ``nvlink`` kernels when usable on this (one-host) group, else ``torch``. The stages of ``hierarchical``
follow the same rule: a node or rail group of one rank gets ``local``."""

from __future__ import annotations

import importlib
import os

import torch
import torch.distributed as dist

from .base import DispatchArgs, DispatchResult, Transport
from .hierarchical import HierarchicalTransport, NodeSplit, node_ids, split_by_node
from .local import LocalLowLatency, LocalTransport
from .low_latency_base import LowLatencyTransport
from .torch_transport import TorchTransport

TRANSPORTS = ("local", "torch", "nvlink", "hierarchical")
ENV_VAR = "MOE_EP_TRANSPORT"


def _nvlink_class():
    return importlib.import_module(".nvlink", __name__).NVLinkTransport


def nvlink_unavailable_reason(group: dist.ProcessGroup, device: torch.device) -> str | None:
    """Why the ``nvlink`` transport cannot serve ``group`` here (None when it can)."""
    if device.type != "cuda":
        return "the group's backend is not NCCL (tensors live on the CPU)"
    try:
        cls = _nvlink_class()
    except ImportError as exc:
        return f"the nvlink transport is not importable: {exc}"
    return cls.unavailable_reason(group, device)


def _nvlink_on_every_node(group: dist.ProcessGroup, split: NodeSplit, device: torch.device) -> bool:
    """Whether ``nvlink`` serves every node group; all ranks of ``group`` get the same answer."""
    if device.type != "cuda":
        return False  # the same on every rank: no collective needed
    ok = torch.tensor(
        [int(nvlink_unavailable_reason(split.node_group, device) is None)],
        device=device if dist.get_backend(group) == "nccl" else "cpu",
    )
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    return bool(ok.item())


def resolve_transport(
    requested: str, group: dist.ProcessGroup, device: torch.device, ranks_per_node: int | None, timeout_s: float
) -> tuple[str, NodeSplit | None]:
    """``requested`` (or ``$MOE_EP_TRANSPORT`` when it is ``auto``) → a concrete transport name, plus the node
    split for ``hierarchical``. ``ranks_per_node`` emulates nodes (else torchrun's ``LOCAL_WORLD_SIZE`` or the
    hostnames); the one-host transports, asked for by name, refuse it. Collective over ``group`` (the node layout
    is agreed within ``timeout_s``)."""
    name = os.environ.get(ENV_VAR, requested) if requested == "auto" else requested
    if name not in TRANSPORTS + ("auto",):
        raise ValueError(f"transport must be one of {('auto',) + TRANSPORTS}, got {name!r}")
    if ranks_per_node is not None and requested in ("torch", "nvlink"):
        raise ValueError(
            f"ranks_per_node: only the 'hierarchical' transport (or 'auto', which may pick it) splits "
            f"the group into nodes; transport={requested!r} sends every row directly and has no node "
            f"layout: drop ranks_per_node or ask for transport='hierarchical'"
        )
    if dist.get_world_size(group) == 1:
        return "local", None
    if name == "local":
        raise ValueError(f"transport='local' serves a group of one rank, got {dist.get_world_size(group)} ranks")
    if name == "nvlink":
        reason = nvlink_unavailable_reason(group, device)
        if reason is not None:
            raise ValueError(f"transport='nvlink' is not usable: {reason}")
        return name, None
    if name == "torch":
        return name, None
    nodes = node_ids(group, ranks_per_node, device, timeout_s)
    if name == "hierarchical":
        return name, split_by_node(group, nodes, timeout_s)
    if len(set(nodes)) > 1:
        if device.type == "cuda":
            split = split_by_node(group, nodes, timeout_s)
            if _nvlink_on_every_node(group, split, device):
                return "hierarchical", split
        return "torch", None
    return ("nvlink" if nvlink_unavailable_reason(group, device) is None else "torch"), None


def _stage(
    name: str, group: dist.ProcessGroup, device: torch.device, timeout_s: float, num_nvl_bytes: int
) -> Transport:
    """A hierarchical stage over ``group``: ``local`` for one rank, else the named one-host transport."""
    if dist.get_world_size(group) == 1:
        return LocalTransport(group, device, timeout_s)
    if name == "nvlink":
        return _nvlink_class()(group, device, timeout_s, num_nvl_bytes=num_nvl_bytes)
    return TorchTransport(group, device, timeout_s)


def create_transport(
    name: str,
    group: dist.ProcessGroup,
    device: torch.device,
    timeout_s: float,
    num_nvl_bytes: int,
    split: NodeSplit | None = None,
    rail: str = "torch",
) -> Transport:
    """The transport ``name`` (from :func:`resolve_transport`) over ``group``. ``rail``: the hierarchical
    transport's stage between nodes, ``torch`` (a real cluster: the rail ranks span hosts) or ``nvlink`` (ranks
    that emulate nodes on one host with a gloo group, which cannot carry CUDA tensors: the GPU tests)."""
    if name == "local":
        return LocalTransport(group, device, timeout_s)
    if name == "torch":
        return TorchTransport(group, device, timeout_s)
    if name == "nvlink":
        return _nvlink_class()(group, device, timeout_s, num_nvl_bytes=num_nvl_bytes)
    # Inside a node: the kernels when they serve every node, else the torch transport over the node group.
    intra_name = "nvlink" if _nvlink_on_every_node(group, split, device) else "torch"
    intra = _stage(intra_name, split.node_group, device, timeout_s, num_nvl_bytes)
    rail_stage = _stage(rail, split.rail_group, device, timeout_s, num_nvl_bytes)
    if device.type == "cuda" and dist.get_backend(group) != "nccl" and "torch" in (intra.name, rail_stage.name):
        raise ValueError(
            f"device: the hierarchical transport's torch stages move rows with the group's collectives, "
            f"and a {dist.get_backend(group)} group cannot carry {device} tensors; use an NCCL group"
        )
    return HierarchicalTransport(group, device, timeout_s, split, intra, rail_stage)


def create_low_latency_transport(transport: Transport, num_rdma_bytes: int) -> LowLatencyTransport:
    """The low-latency form for a Buffer whose normal-mode transport is ``transport``: the peer-memory kernels
    (``low_latency_nvlink``) beside ``nvlink``, the collectives (``low_latency_torch``) beside ``torch``, and
    their one-rank form beside ``local``."""
    if isinstance(transport, LocalTransport):
        return LocalLowLatency(transport)
    if isinstance(transport, TorchTransport):
        from .low_latency_torch import TorchLowLatency

        return TorchLowLatency(transport)
    if transport.name != "nvlink":
        raise ValueError(
            f"low_latency_mode: served beside the torch and nvlink transports, not {transport.name!r} "
            f"(multi-node low-latency mode: docs/low_latency.md)"
        )
    from .low_latency_nvlink import NVLinkLowLatency

    return NVLinkLowLatency(transport.group, transport.device, transport.timeout_s, num_rdma_bytes)


__all__ = [
    "DispatchArgs",
    "DispatchResult",
    "LocalTransport",
    "LowLatencyTransport",
    "Transport",
    "TorchTransport",
    "HierarchicalTransport",
    "TRANSPORTS",
    "create_low_latency_transport",
    "create_transport",
    "resolve_transport",
    "nvlink_unavailable_reason",
]
