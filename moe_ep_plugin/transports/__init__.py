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


def create_low_latency_transport(transport: Transport) -> LowLatencyTransport:
    """The low-latency form over a Buffer's ``transport``: collectives for ``torch``; on ``nvlink`` the
    collectives of an NCCL group until the peer-memory low-latency kernels serve it (docs/low_latency.md)."""
    from .low_latency_torch import TorchLowLatency
    if isinstance(transport, TorchTransport):
        return TorchLowLatency(transport)
    if dist.get_backend(transport.group) == "nccl":
        return TorchLowLatency(TorchTransport(transport.group, transport.device, transport.timeout_s))
    raise ValueError("low_latency_mode: on ranks sharing a GPU (a gloo group with CUDA tensors) low-latency mode "
                     "needs the peer-memory kernels, which this build does not serve yet; use an NCCL group")


__all__ = ["create_low_latency_transport", "DispatchArgs", "DispatchResult", "Transport", "TorchTransport", "TRANSPORTS", "create_transport",
           "resolve_transport_name", "nvlink_unavailable_reason"]
