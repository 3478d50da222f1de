"""Small differences between megatron-core 0.16 and 0.19 that the plugin meets when it builds modules.

0.16 describes a MoE layer as ``ModuleSpec(MoELayer, submodules=MoESubmodules(...))``; 0.19 as
``functools.partial(MoELayer, submodules=MoESubmodules(...))``. Both keep the router class in
``MoESubmodules.router``, which is how the plugin swaps in :class:`PortableTopKRouter`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from .router import PortableTopKRouter


def moe_submodules(mlp_spec: Any) -> MoESubmodules | None:
    """The ``MoESubmodules`` of a MoE layer spec (either form), or None for a dense MLP spec."""
    if isinstance(mlp_spec, ModuleSpec):
        sub = mlp_spec.submodules
    elif isinstance(mlp_spec, functools.partial):
        sub = mlp_spec.keywords.get("submodules")
    else:
        return None
    return sub if isinstance(sub, MoESubmodules) else None


def use_router(layer_specs: Iterable[Any], router: type = PortableTopKRouter) -> int:
    """Set ``router`` in the MoE layers of transformer-layer specs; returns how many were changed."""
    changed = 0
    for spec in layer_specs:
        sub = moe_submodules(getattr(spec.submodules, "mlp", None))
        if sub is not None:
            sub.router = router
            changed += 1
    return changed


def local_moe_spec(num_experts: int, router: type = PortableTopKRouter) -> Any:
    """A MoE layer spec without TransformerEngine (``SequentialMLP`` experts, local shared expert)."""
    spec = get_moe_module_spec(use_te=False, num_experts=num_experts, moe_grouped_gemm=False)
    moe_submodules(spec).router = router
    return spec


def build_moe_layer(spec: Any, config: Any, layer_number: int = 1) -> Any:
    """Instantiate a MoE layer spec of either form."""
    if isinstance(spec, ModuleSpec):
        return build_module(spec, config=config, layer_number=layer_number)
    return spec(config=config, layer_number=layer_number)
