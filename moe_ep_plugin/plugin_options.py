"""The options every integration passes to its Buffer: one frozen, validated base that the Megatron-Core
dispatcher uses as is and the DeepSpeed layer extends with its router options."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .config import DEFAULT_TIMEOUT_S, check_num_sms, positive_int
from .transports import TRANSPORTS


@dataclass(frozen=True)
class PluginOptions:
    """How the plugin moves one MoE layer's tokens.

    - ``transport``: the ``moe_ep_plugin.Buffer`` transport, ``auto`` (NVLink kernels when usable, ``hierarchical``
      when the EP group spans nodes) or one of ``transports.TRANSPORTS``.
    - ``fp8_dispatch``: BF16 tokens cross the wire as FP8 (1x128 blocks) and arrive as BF16; combine and all
      gradients stay BF16. Needs ``hidden_size % 128 == 0``.
    - ``round_scale``: power-of-two (UE8M0) FP8 scales; only with ``fp8_dispatch``.
    - ``num_sms``: SMs the communication kernels may use (a positive even int; None: the Buffer's default).
    - ``timeout_s``: seconds a rank waits for its peers before raising.
    - ``ranks_per_node``: EP ranks per node for ``hierarchical``/``auto`` (None: the launcher's nodes); setting it
      emulates nodes on one host (docs/multinode.md).
    """

    transport: str = "auto"
    fp8_dispatch: bool = False
    round_scale: bool = False
    num_sms: int | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    ranks_per_node: int | None = None

    def __post_init__(self) -> None:
        if self.transport not in ("auto",) + TRANSPORTS:
            raise ValueError(f"transport: expected one of {('auto',) + TRANSPORTS}, got {self.transport!r}")
        for name in ("fp8_dispatch", "round_scale"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        if self.round_scale and not self.fp8_dispatch:
            raise ValueError("round_scale: only meaningful with fp8_dispatch=True")
        if self.num_sms is not None:
            check_num_sms(self.num_sms, "num_sms")
        if not isinstance(self.timeout_s, (int, float)) or isinstance(self.timeout_s, bool) or not self.timeout_s > 0:
            raise ValueError(f"timeout_s: expected a positive number of seconds, got {self.timeout_s!r}")
        if self.ranks_per_node is not None:
            positive_int(self.ranks_per_node, "ranks_per_node")
        if self.ranks_per_node is not None and self.transport in ("torch", "nvlink"):
            raise ValueError(
                f"ranks_per_node: only for transport 'hierarchical' or 'auto' (transport "
                f"{self.transport!r} has no node layout)"
            )

    @classmethod
    def from_dict(cls, values: Any, section: str) -> PluginOptions:
        """Build from a YAML mapping; every error names ``section.key``."""
        if not isinstance(values, dict):
            raise ValueError(f"{section}: expected a mapping, got {type(values).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        for key in values:
            if key not in known:
                raise ValueError(f"{section}.{key}: unknown option (known: {', '.join(sorted(known))})")
        try:
            return cls(**values)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{section}.{exc}") from exc
