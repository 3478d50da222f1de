"""The plugin dispatcher's own options, carried on a ``TransformerConfig`` as the attribute ``moe_ep_plugin``.

``TransformerConfig`` is a dataclass that rejects unknown constructor keywords, so the options cannot be one of
its fields; they travel as a validated :class:`PluginOptions` object attached after construction
(:func:`set_plugin_options`), which the YAML mapping does from its ``ep_plugin:`` section.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

PLUGIN_DISPATCHER_TYPE = "ep_plugin"
CONFIG_ATTR = "moe_ep_plugin"
TRANSPORTS = ("auto", "torch", "nvlink", "hierarchical")


@dataclass(frozen=True)
class PluginOptions:
    """Options of the ``ep_plugin`` dispatcher (and of the ``flex`` + ``deepep`` shim).

    - ``transport``: the Buffer transport, ``auto`` | ``torch`` | ``nvlink`` | ``hierarchical`` (docs/multinode.md).
    - ``ranks_per_node``: EP ranks per node for ``hierarchical``/``auto`` (None: the launcher's nodes); setting
      it emulates nodes on one host.
    - ``fp8_dispatch``: quantize BF16 tokens to FP8 (1x128 blocks) in the send path and dequantize to BF16 on
      receive, so BF16 experts see half the dispatch bytes; combine and all gradients stay BF16. Needs
      ``hidden_size % 128 == 0``.
    - ``num_sms``: SMs the communication kernels may use (None: the Buffer's default). On the ``flex`` +
      ``deepep`` path Megatron's own SM setting is used instead.
    - ``timeout_s``: how long a rank waits for its peers before raising.
    """

    transport: str = "auto"
    fp8_dispatch: bool = False
    num_sms: Optional[int] = None
    timeout_s: float = 300.0
    ranks_per_node: Optional[int] = None

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"ep_plugin.transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if not isinstance(self.fp8_dispatch, bool):
            raise TypeError(f"ep_plugin.fp8_dispatch must be a bool, got {self.fp8_dispatch!r}")
        if self.num_sms is not None and (not isinstance(self.num_sms, int) or isinstance(self.num_sms, bool)
                                         or self.num_sms <= 0 or self.num_sms % 2):
            raise ValueError(f"ep_plugin.num_sms must be a positive even int or None, got {self.num_sms!r}")
        if not isinstance(self.timeout_s, (int, float)) or isinstance(self.timeout_s, bool) or self.timeout_s <= 0:
            raise ValueError(f"ep_plugin.timeout_s must be a positive number, got {self.timeout_s!r}")
        if self.ranks_per_node is not None and (not isinstance(self.ranks_per_node, int)
                                                or isinstance(self.ranks_per_node, bool) or self.ranks_per_node <= 0):
            raise ValueError(f"ep_plugin.ranks_per_node must be a positive int or None, got {self.ranks_per_node!r}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "PluginOptions":
        """Build from a mapping (a YAML section), rejecting unknown keys by name."""
        if not isinstance(values, dict):
            raise TypeError(f"ep_plugin: expected a mapping, got {type(values).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"ep_plugin: unknown option(s) {unknown}; known: {sorted(known)}")
        return cls(**values)


def set_plugin_options(config: Any, options: PluginOptions) -> None:
    """Attach ``options`` to a ``TransformerConfig`` (read by the dispatcher when a MoE layer is built)."""
    if not isinstance(options, PluginOptions):
        raise TypeError(f"options: expected PluginOptions, got {type(options).__name__}")
    if options.fp8_dispatch:
        hidden = getattr(config, "moe_latent_size", None) or config.hidden_size
        if hidden % 128:
            raise ValueError(f"ep_plugin.fp8_dispatch needs the dispatched hidden size to be a multiple of 128, "
                             f"got {hidden}")
    setattr(config, CONFIG_ATTR, options)


def get_plugin_options(config: Any, default: Optional[PluginOptions] = None) -> PluginOptions:
    """The options attached to ``config``, else ``default``, else :class:`PluginOptions` defaults."""
    options = getattr(config, CONFIG_ATTR, None)
    if options is None:
        return default if default is not None else PluginOptions()
    if not isinstance(options, PluginOptions):
        raise TypeError(f"config.{CONFIG_ATTR}: expected PluginOptions, got {type(options).__name__}")
    return options
