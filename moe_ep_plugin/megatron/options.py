"""The plugin dispatcher's own options, carried on a ``TransformerConfig`` as the attribute ``moe_ep_plugin``.

``TransformerConfig`` is a dataclass that rejects unknown constructor keywords, so the options cannot be one of
its fields; they travel as a validated :class:`PluginOptions` object (the options base every integration shares,
``moe_ep_plugin.plugin_options``; on the ``flex`` + ``deepep`` path Megatron's own SM setting replaces ``num_sms``)
attached after construction (:func:`set_plugin_options`), which the YAML mapping does from its ``ep_plugin:``
section.
"""

from __future__ import annotations

from typing import Any

import torch

from ..plugin_options import PluginOptions

PLUGIN_DISPATCHER_TYPE = "ep_plugin"
CONFIG_ATTR = "moe_ep_plugin"
__all__ = [
    "PLUGIN_DISPATCHER_TYPE",
    "CONFIG_ATTR",
    "PluginOptions",
    "set_plugin_options",
    "get_plugin_options",
    "check_fp16",
    "fp16_served",
    "carried",
    "as_token_dtype",
]
FP16_DTYPES = "bf16 and fp32"  # what the kernel transports carry


def fp16_served(options: PluginOptions) -> bool:
    """Whether FP16 tokens can be dispatched with ``options``: the ``torch`` transport carries them as fp32 (exact)
    and sums the combine in fp32; the kernel transports carry bf16/fp32 only (``auto`` without CUDA is ``torch``)."""
    return options.transport == "torch" or (options.transport == "auto" and not torch.cuda.is_available())


def carried(x: torch.Tensor, options: PluginOptions, name: str) -> torch.Tensor:
    """``x`` as the Buffer carries it: fp16 rows as fp32 (which holds every fp16 value, so the rows arrive unchanged
    and a combine sums them in fp32) where :func:`fp16_served`, else a TypeError naming ``name``; other dtypes as
    they are. Every front door of Megatron's (``ep_plugin`` and the ``flex`` shims) passes its tokens through here
    and casts its results back with :func:`as_token_dtype`."""
    if x.dtype != torch.float16:
        return x
    if not fp16_served(options):
        raise TypeError(
            f"{name}: float16 needs ep_plugin.transport 'torch' (transport {options.transport!r} carries {FP16_DTYPES})"
        )
    return x.float()


def as_token_dtype(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A result ``y`` of rows :func:`carried` made fp32, cast back to the tokens' ``dtype`` once (after any fp32
    sum)."""
    return y.to(dtype) if dtype == torch.float16 else y


def check_fp16(config: Any, options: PluginOptions) -> None:
    """Refuse ``fp16: True`` at config time where ``options`` pick a kernel transport."""
    if getattr(config, "fp16", False) and not fp16_served(options):
        raise ValueError(
            f"fp16: True needs ep_plugin.transport 'torch'; transport {options.transport!r} carries "
            f"{FP16_DTYPES} (use bf16: True)"
        )
    if getattr(config, "fp16", False) and options.fp8_dispatch:
        raise ValueError("fp16: True with ep_plugin.fp8_dispatch: FP8 dispatch takes bf16 tokens (use bf16: True)")


def set_plugin_options(config: Any, options: PluginOptions) -> None:
    """Attach ``options`` to a ``TransformerConfig`` (read by the dispatcher when a MoE layer is built)."""
    if not isinstance(options, PluginOptions):
        raise TypeError(f"options: expected PluginOptions, got {type(options).__name__}")
    if options.fp8_dispatch:
        hidden = getattr(config, "moe_latent_size", None) or config.hidden_size
        if hidden % 128:
            raise ValueError(
                f"ep_plugin.fp8_dispatch needs the dispatched hidden size to be a multiple of 128, got {hidden}"
            )
    check_fp16(config, options)
    setattr(config, CONFIG_ATTR, options)


def get_plugin_options(config: Any, default: PluginOptions | None = None) -> PluginOptions:
    """The options attached to ``config``, else ``default``, else :class:`PluginOptions` defaults."""
    options = getattr(config, CONFIG_ATTR, None)
    if options is None:
        return default if default is not None else PluginOptions()
    if not isinstance(options, PluginOptions):
        raise TypeError(f"config.{CONFIG_ATTR}: expected PluginOptions, got {type(options).__name__}")
    return options
