"""The options every integration passes to its Buffer: one frozen, validated base that the Megatron-Core
dispatcher uses as is and the DeepSpeed layer extends with its router options."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from .config import DEFAULT_TIMEOUT_S
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
    - ``fused_dispatch``: on ``nvlink``, the expert-major dispatch kernel writes rows straight into the experts'
      layout (``NVLinkTuning.fused_dispatch``; off until timed on the GPU, same results either way);
      ``fused_dispatch_sms`` > 0: that kernel's SMs (``NVLinkTuning.fused_dispatch_sms``; 0: ``num_sms``).
    - ``fused_combine``: on ``nvlink``, ``combine_experts`` sums each token's expert rows inside the (push) combine
      kernel (``NVLinkTuning.fused_combine``; off until timed, same results either way).
    - ``hierarchical_chunks``: on ``hierarchical``, pipeline the inter-node and intra-node stages over this many
      chunks of tokens (``Config.hierarchical_chunks``; 1: not chunked, the default until measured across nodes).
    """

    transport: str = "auto"
    fp8_dispatch: bool = False
    round_scale: bool = False
    num_sms: Optional[int] = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    ranks_per_node: Optional[int] = None
    fused_dispatch: bool = False
    fused_dispatch_sms: int = 0
    fused_combine: bool = False
    hierarchical_chunks: int = 1

    def __post_init__(self) -> None:
        if self.transport not in ("auto",) + TRANSPORTS:
            raise ValueError(f"transport: expected one of {('auto',) + TRANSPORTS}, got {self.transport!r}")
        for name in ("fp8_dispatch", "round_scale", "fused_dispatch", "fused_combine"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        if self.round_scale and not self.fp8_dispatch:
            raise ValueError("round_scale: only meaningful with fp8_dispatch=True")
        if self.num_sms is not None and (not isinstance(self.num_sms, int) or isinstance(self.num_sms, bool)
                                         or self.num_sms <= 0 or self.num_sms % 2):
            raise ValueError(f"num_sms: expected a positive even int or None, got {self.num_sms!r}")
        if not isinstance(self.fused_dispatch_sms, int) or isinstance(self.fused_dispatch_sms, bool) \
                or self.fused_dispatch_sms < 0:
            raise ValueError(f"fused_dispatch_sms: expected an int >= 0, got {self.fused_dispatch_sms!r}")
        if not isinstance(self.hierarchical_chunks, int) or isinstance(self.hierarchical_chunks, bool) \
                or self.hierarchical_chunks < 1:
            raise ValueError(f"hierarchical_chunks: expected a positive int, got {self.hierarchical_chunks!r}")
        if not isinstance(self.timeout_s, (int, float)) or isinstance(self.timeout_s, bool) or not self.timeout_s > 0:
            raise ValueError(f"timeout_s: expected a positive number of seconds, got {self.timeout_s!r}")
        if self.ranks_per_node is not None and (not isinstance(self.ranks_per_node, int)
                                                or isinstance(self.ranks_per_node, bool) or self.ranks_per_node <= 0):
            raise ValueError(f"ranks_per_node: expected a positive int or None, got {self.ranks_per_node!r}")
        if self.ranks_per_node is not None and self.transport in ("torch", "nvlink"):
            raise ValueError(f"ranks_per_node: only for transport 'hierarchical' or 'auto' (transport "
                             f"{self.transport!r} has no node layout)")

    def nvlink_tuning(self) -> dict[str, Any]:
        """The ``NVLinkTuning`` fields these options set (``buffer_cache.sm_configs``), none at their defaults."""
        fields = dict(fused_dispatch=self.fused_dispatch, fused_dispatch_sms=self.fused_dispatch_sms,
                      fused_combine=self.fused_combine)
        return {name: value for name, value in fields.items() if value}

    @classmethod
    def from_dict(cls, values: Any, section: str) -> "PluginOptions":
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

