"""DeepSpeed integration: the plugin's dropless dispatcher as a drop-in for ``deepspeed.moe.layer.MoE``.

>>> from moe_ep_plugin.deepspeed import MoE              # same constructor as deepspeed.moe.layer.MoE
>>> from moe_ep_plugin.deepspeed import convert_moe      # or swap the dispatcher of an existing model
>>> from moe_ep_plugin.deepspeed import check_autoep_versions  # before AutoEP: refuses a transformers it fails with
"""

from ..buffer_cache import destroy_buffers, get_buffer
from .autoep_versions import check_autoep_versions
from .layer import MoE, PluginMOELayer, convert_moe, update_expert_biases
from .options import DeepSpeedOptions
from .routing import GroupLimitedGate, Routes

__all__ = [
    "MoE",
    "PluginMOELayer",
    "DeepSpeedOptions",
    "GroupLimitedGate",
    "Routes",
    "check_autoep_versions",
    "convert_moe",
    "destroy_buffers",
    "get_buffer",
    "update_expert_biases",
]
