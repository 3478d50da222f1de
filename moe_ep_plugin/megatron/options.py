"""The plugin dispatcher's own options, carried on a ``TransformerConfig`` as the attribute ``moe_ep_plugin``.

``TransformerConfig`` is a dataclass that rejects unknown constructor keywords, so the options cannot be one of
its fields; they travel as a validated :class:`PluginOptions` object (the options base every integration shares,
``moe_ep_plugin.plugin_options``; on the ``flex`` + ``deepep`` path Megatron's own SM setting replaces ``num_sms``)
attached after construction (:func:`set_plugin_options`), which the YAML mapping does from its ``ep_plugin:``
section.
"""
from __future__ import annotations

from typing import Any, Optional

from ..plugin_options import PluginOptions

PLUGIN_DISPATCHER_TYPE = "ep_plugin"
CONFIG_ATTR = "moe_ep_plugin"
__all__ = ["PLUGIN_DISPATCHER_TYPE", "CONFIG_ATTR", "PluginOptions", "set_plugin_options", "get_plugin_options"]


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
