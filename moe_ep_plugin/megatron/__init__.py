"""Megatron-Core integration: a drop-in ``MoETokenDispatcher`` on this library's Buffer.

    import moe_ep_plugin.megatron as ep_megatron
    ep_megatron.install()                      # idempotent; ep_megatron.uninstall() reverts it
    config.moe_token_dispatcher_type = "ep_plugin"
    ep_megatron.set_plugin_options(config, ep_megatron.PluginOptions(fp8_dispatch=True))

``flex`` + ``deepep`` configs also run on this library after ``install()``. Needs ``megatron-core`` (0.16-0.20)
and ``triton`` (imported by ``megatron.core``).
"""

from __future__ import annotations

try:
    import megatron.core  # noqa: F401
except ImportError as exc:  # name the missing piece: megatron.core itself imports triton
    raise ImportError(
        f"moe_ep_plugin.megatron needs megatron-core (pip install 'moe_ep_plugin[megatron]'): {exc}"
    ) from exc

from ..ops.routing import routing_map_to_topk
from .dispatcher import EPPluginTokenDispatcher, check_over_budget
from .options import PLUGIN_DISPATCHER_TYPE, PluginOptions, get_plugin_options, set_plugin_options
from .registration import install, is_installed, uninstall
from .router import PortableTopKRouter

__all__ = [
    "EPPluginTokenDispatcher",
    "PLUGIN_DISPATCHER_TYPE",
    "PluginOptions",
    "PortableTopKRouter",
    "check_over_budget",
    "get_plugin_options",
    "install",
    "is_installed",
    "routing_map_to_topk",
    "set_plugin_options",
    "uninstall",
]
