"""Transport registry: ``auto`` → ``nvlink`` kernels when usable on this group, else ``torch``."""
from __future__ import annotations

import importlib
import os

import torch
import torch.distributed as dist

from .base import DispatchArgs, DispatchResult, Transport
from .low_latency_base import LowLatencyTransport
from .torch_transport import TorchTransport

TRANSPORTS = ("torch", "nvlink")
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


def resolve_transport_name(requested: str, group: dist.ProcessGroup, device: torch.device) -> str:
    """``requested`` (or ``$MOE_EP_TRANSPORT`` when it is ``auto``) → a concrete transport name."""
    name = os.environ.get(ENV_VAR, requested) if requested == "auto" else requested
    if name not in TRANSPORTS + ("auto",):
        raise ValueError(f"transport must be one of {('auto',) + TRANSPORTS}, got {name!r}")
    if name == "auto":
        return "nvlink" if nvlink_unavailable_reason(group, device) is None else "torch"
    if name == "nvlink":
        reason = nvlink_unavailable_reason(group, device)
        if reason is not None:
            raise ValueError(f"transport='nvlink' is not usable: {reason}")
    return name


def create_transport(name: str, group: dist.ProcessGroup, device: torch.device, timeout_s: float,
                     num_nvl_bytes: int) -> Transport:
    if name == "torch":
        return TorchTransport(group, device, timeout_s)
    return _nvlink_class()(group, device, timeout_s, num_nvl_bytes=num_nvl_bytes)


def create_low_latency_transport(transport: Transport, num_rdma_bytes: int) -> LowLatencyTransport:
    """The low-latency form for a Buffer whose normal-mode transport is ``transport``: the peer-memory kernels
    (``low_latency_nvlink``) beside ``nvlink``, the collectives (``low_latency_torch``) beside ``torch``."""
    if isinstance(transport, TorchTransport):
        from .low_latency_torch import TorchLowLatency
        return TorchLowLatency(transport)
    from .low_latency_nvlink import NVLinkLowLatency
    return NVLinkLowLatency(transport.group, transport.device, transport.timeout_s, num_rdma_bytes)


__all__ = ["DispatchArgs", "DispatchResult", "LowLatencyTransport", "Transport", "TorchTransport", "TRANSPORTS",
           "create_low_latency_transport", "create_transport", "resolve_transport_name", "nvlink_unavailable_reason"]
