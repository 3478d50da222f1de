"""A ``deep_ep``-compatible module on this library: what frameworks import from DeepEP.

- DeepEP V1 (<= 2.1): ``Buffer``, ``Config``, ``EventOverlap`` (``moe_ep_plugin.Buffer`` and friends).
- DeepEP V2: ``ElasticBuffer``, ``EPHandle``; DeepEP 2.5 and 2.6: ``EPBuffer``; all: ``topk_idx_t``,
  ``utils.EventOverlap``, ``utils.EventHandle``.

``import deep_ep`` resolves to this module only after an explicit opt-in: :func:`install.install_deep_ep` (also
``moe_ep_plugin.install_deep_ep``) or, for launch scripts, ``python -m moe_ep_plugin.deep_ep`` (docs/compat.md).
"""

from __future__ import annotations

import torch

from ..buffer import Buffer
from ..config import Config
from . import utils
from .elastic import ElasticBuffer, EPHandle
from .ep_buffer import EPBuffer
from .utils import EventHandle, EventOverlap

topk_idx_t = torch.int64  # DeepEP's top-k index dtype (int32 is accepted too)
__version__ = "2.6.0+moe_ep_plugin"  # the newest DeepEP API this module serves (docs/compat.md: what of it)

__all__ = [
    "Buffer",
    "Config",
    "EPBuffer",
    "EPHandle",
    "ElasticBuffer",
    "EventHandle",
    "EventOverlap",
    "topk_idx_t",
    "utils",
]
