"""moe_ep_plugin: expert-parallel dispatch/combine for MoE training (DeepEP-compatible ``Buffer``)."""

from .buffer import Buffer
from .config import Config
from .event import EventOverlap
from .handle import DispatchHandle

__version__ = "0.1.0"
__all__ = ["Buffer", "Config", "EventOverlap", "DispatchHandle", "install_deep_ep", "__version__"]


def install_deep_ep(force: bool = False):
    """Make ``import deep_ep`` resolve to :mod:`moe_ep_plugin.deep_ep` (``moe_ep_plugin.deep_ep.install``; refuses
    to shadow a real DeepEP unless ``force``). The integration is loaded only when asked for."""
    from importlib import import_module

    return import_module("moe_ep_plugin.deep_ep.install").install_deep_ep(force)
