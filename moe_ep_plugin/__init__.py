"""moe_ep_plugin: expert-parallel dispatch/combine for MoE training (DeepEP-compatible ``Buffer``)."""
from .buffer import Buffer
from .config import Config
from .event import EventOverlap
from .handle import DispatchHandle

__version__ = "0.1.0"
__all__ = ["Buffer", "Config", "EventOverlap", "DispatchHandle", "__version__"]
