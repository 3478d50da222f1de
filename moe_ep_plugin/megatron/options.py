"""The plugin dispatcher's own options, carried on a ``TransformerConfig`` as the attribute ``moe_ep_plugin``.

``TransformerConfig`` is a dataclass that rejects unknown constructor keywords, so the options cannot be one of
its fields; they travel as a validated :class:`PluginOptions` object (the options base every integration shares,
``moe_ep_plugin.plugin_options``; on the ``flex`` + ``deepep`` path Megatron's own SM setting replaces ``num_sms``)
attached after construction (:func:`set_plugin_options`), which the YAML mapping does from its ``ep_plugin:``
section.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..plugin_options import PluginOptions as SharedOptions

PLUGIN_DISPATCHER_TYPE = "ep_plugin"
CONFIG_ATTR = "moe_ep_plugin"
__all__ = [
    "PLUGIN_DISPATCHER_TYPE",
    "CONFIG_ATTR",
    "PluginOptions",
    "set_plugin_options",
    "get_plugin_options",
    "check_fp16",
    "captured_dispatch",
]
# Megatron's per-rank row budget (megatron-core 0.19): ep_plugin's where ep_plugin.recv_capacity_factor is unset
MEGATRON_BUDGET_KEY = "moe_expert_rank_capacity_factor"
# transports whose dispatch with fixed-size outputs reads nothing on the host (``local``: a group of one rank)
SYNC_FREE_TRANSPORTS = ("nvlink", "local")


@dataclass(frozen=True)
class PluginOptions(SharedOptions):
    """The shared options (``moe_ep_plugin.plugin_options.PluginOptions``) plus the row budget of ``ep_plugin``'s
    dropless dispatch sized on the device (``megatron/budget.py``):

    - ``recv_capacity_factor``: the expert-major rows each rank's experts take, as a multiple of the mean
      (``tokens x top-k``), rounded up to the block alignment; None: the worst case (every token of every rank on
      this rank's experts), which never overflows. Setting it (or capturing the dispatch in a CUDA graph) makes
      the dispatch read nothing on the host.
    - ``drop_on_overflow``: rows past the budget are dropped (and counted) instead of raising at the next
      ``check_over_budget``; only with ``recv_capacity_factor``.
    """

    recv_capacity_factor: float | None = None
    drop_on_overflow: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        factor = self.recv_capacity_factor
        if factor is not None and (
            isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0
        ):
            raise ValueError(f"recv_capacity_factor: expected a positive number or None, got {factor!r}")
        if not isinstance(self.drop_on_overflow, bool):
            raise TypeError(f"drop_on_overflow: expected a bool, got {self.drop_on_overflow!r}")
        if self.drop_on_overflow and factor is None:
            raise ValueError("drop_on_overflow: only with recv_capacity_factor (the worst-case budget never overflows)")


def captured_dispatch(config: Any) -> str | None:
    """What of ``config``'s CUDA-graph settings captures the MoE token dispatch (for the error that names it), or
    None. megatron-core 0.16 names the regions ``cuda_graph_scope``, 0.19 ``cuda_graph_modules``; an empty list
    is the whole layer."""
    impl = getattr(config, "cuda_graph_impl", "none")
    if impl == "none" or not getattr(config, "num_moe_experts", None):
        return None
    if impl == "full_iteration":
        return f"cuda_graph_impl: {impl!r}"
    key = "cuda_graph_modules" if hasattr(config, "cuda_graph_modules") else "cuda_graph_scope"
    regions = graph_regions(getattr(config, key))
    if regions and not {"moe", "full_iteration"} & set(regions):
        return None
    return f"{key}: {regions or 'the whole layer'} with cuda_graph_impl {impl!r}"


def graph_regions(regions: Any) -> list[str]:
    """The region names of a ``cuda_graph_scope``/``cuda_graph_modules`` value as given or as Megatron normalised
    it: a comma-separated string, one ``CudaGraphScope``, or a list of either (None: none)."""
    if regions is None:
        return []
    if isinstance(regions, str):  # "full" is Megatron's old name of the whole layer
        regions = [name for name in regions.split(",") if name and name != "full"]
    elif not isinstance(regions, (list, tuple)):
        regions = [regions]
    return sorted(getattr(region, "name", str(region)) for region in regions)


def check_fp16(config: Any, options: PluginOptions) -> None:
    """Refuse ``fp16: True`` with FP8 dispatch at config time: the send-path quantizer reads BF16 (or FP32) rows.
    FP16 tokens themselves are served on every transport, moved as they are and summed in fp32 as BF16 ones."""
    if getattr(config, "fp16", False) and options.fp8_dispatch:
        raise ValueError("fp16: True with ep_plugin.fp8_dispatch: FP8 dispatch takes bf16 tokens (use bf16: True)")


def check_capture(config: Any, options: PluginOptions) -> None:
    """Refuse, naming the fix, an ``ep_plugin`` config whose CUDA-graph region holds the token dispatch unless the
    dispatch reads nothing on the host: transport ``nvlink`` (``local`` in a group of one rank), where drop-and-pad
    and the dropless dispatch sized from a row budget (``budget.py``; the worst case without
    ``recv_capacity_factor``) both run without a host read. The ``torch`` and ``hierarchical`` transports exchange
    their counts through the host."""
    what = captured_dispatch(config)
    if what is None or options.transport in SYNC_FREE_TRANSPORTS:
        return
    raise ValueError(
        f"{what} captures the MoE token dispatch, which moe_token_dispatcher_type: ep_plugin on transport "
        f"{options.transport!r} runs with one host read of its counts (not capturable); capture attn, moe_router or "
        f"moe_preprocess only, or set ep_plugin.transport: nvlink, which reads nothing on the host"
    )


def row_budget(config: Any, options: PluginOptions) -> tuple[str, float | None, bool]:
    """``ep_plugin``'s row budget: ``(the key that gives it, factor (None: the worst case), whether pairs past it
    are dropped without an error)``: ``ep_plugin.recv_capacity_factor`` with its ``drop_on_overflow``, else
    Megatron's ``moe_expert_rank_capacity_factor`` where the installed megatron-core has it (0.19), a budget that
    drops, as Megatron's ``hybridep`` and Megatron-LM main's ``ncclep`` take it."""
    megatron = getattr(config, MEGATRON_BUDGET_KEY, None)
    if options.recv_capacity_factor is None and megatron is not None:
        return MEGATRON_BUDGET_KEY, megatron, True
    return "ep_plugin.recv_capacity_factor", options.recv_capacity_factor, options.drop_on_overflow


def check_budget(config: Any, options: PluginOptions) -> None:
    """The row budget keys apply to ``ep_plugin``'s dropless dispatch only (the ``flex`` backends take Megatron's
    own): one of ``ep_plugin.recv_capacity_factor`` and Megatron's ``moe_expert_rank_capacity_factor``, a positive
    number; refused with drop-and-pad (which fixes every count itself) and with ``batch_invariant_mode`` (a budget
    that drops is not batch invariant)."""
    plugin = getattr(config, "moe_token_dispatcher_type", None) == PLUGIN_DISPATCHER_TYPE
    given = [f"ep_plugin.{key}" for key in ("recv_capacity_factor", "drop_on_overflow") if getattr(options, key)]
    if given and not plugin:
        raise ValueError(
            f"{given[0]}: the row budget of moe_token_dispatcher_type: ep_plugin's dropless dispatch; the flex "
            f"backends take Megatron's own budget keys"
        )
    megatron = getattr(config, MEGATRON_BUDGET_KEY, None) if plugin else None
    if megatron is not None:
        if options.recv_capacity_factor is not None:
            raise ValueError(
                f"ep_plugin.recv_capacity_factor: {MEGATRON_BUDGET_KEY} gives ep_plugin's row budget already; set "
                f"one of the two"
            )
        if isinstance(megatron, bool) or not isinstance(megatron, (int, float)) or not 0 < megatron < math.inf:
            raise ValueError(f"{MEGATRON_BUDGET_KEY}: expected a positive number, got {megatron!r}")
        given.append(MEGATRON_BUDGET_KEY)
    for key in given:
        if getattr(config, "moe_pad_expert_input_to_capacity", False):
            raise ValueError(
                f"{key}: drop-and-pad (moe_pad_expert_input_to_capacity) fixes every expert's rows itself; unset {key}"
            )
        if getattr(config, "batch_invariant_mode", False):
            raise ValueError(
                f"{key}: batch_invariant_mode serves dropless routing only (which pairs a row budget drops depends "
                f"on the whole batch; without a budget key the worst case drops none); unset {key}"
            )


def set_plugin_options(config: Any, options: PluginOptions) -> None:
    """Attach ``options`` to a ``TransformerConfig`` (read by the dispatcher when a MoE layer is built), after the
    checks of ``options`` against ``config`` (FP8, FP16, the budget keys, a CUDA-graph region holding the dispatch
    for ``ep_plugin``)."""
    if not isinstance(options, PluginOptions):
        raise TypeError(f"options: expected PluginOptions, got {type(options).__name__}")
    if options.fp8_dispatch:
        hidden = getattr(config, "moe_latent_size", None) or config.hidden_size
        if hidden % 128:
            raise ValueError(
                f"ep_plugin.fp8_dispatch needs the dispatched hidden size to be a multiple of 128, got {hidden}"
            )
    check_fp16(config, options)
    check_budget(config, options)
    if getattr(config, "moe_token_dispatcher_type", None) == PLUGIN_DISPATCHER_TYPE:
        check_capture(config, options)
    setattr(config, CONFIG_ATTR, options)


def get_plugin_options(config: Any, default: PluginOptions | None = None) -> PluginOptions:
    """The options attached to ``config``, else ``default``, else :class:`PluginOptions` defaults."""
    options = getattr(config, CONFIG_ATTR, None)
    if options is None:
        return default if default is not None else PluginOptions()
    if not isinstance(options, PluginOptions):
        raise TypeError(f"config.{CONFIG_ATTR}: expected PluginOptions, got {type(options).__name__}")
    return options
