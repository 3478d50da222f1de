"""Build a Megatron-Core ``GPTModel`` with DeepSeek-V3-style MoE layers from a :class:`PretrainConfig`.

The layer specs are Megatron's own local (no TransformerEngine) GPT specs from ``get_gpt_decoder_block_spec``:
dense MLP layers where ``moe_layer_freq`` says 0 (DeepSeek-V3's first dense layers), MoE layers elsewhere with
a shared expert, ``SequentialMLP`` experts and the router swapped for :class:`PortableTopKRouter` (identical on
GPU; keeps its tensors on the host without CUDA). Routing (sigmoid, groups, expert bias, scaling, sequence aux
loss) comes from the ``TransformerConfig``. Multi-latent attention needs TransformerEngine in Megatron-Core (its
local ``DotProductAttention`` takes no separate key width), so it is refused clearly when TE is absent.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

from ...megatron import compat
from ...megatron.host import cuda_device_is_host
from .yaml_config import PretrainConfig


def build_gpt_model(cfg: PretrainConfig, device: torch.device) -> GPTModel:
    """This rank's pipeline stage of the GPT model, on ``device``, parameters in ``params_dtype``."""
    config = cfg.transformer
    if getattr(config, "multi_latent_attention", False) and importlib.util.find_spec("transformer_engine") is None:
        raise ValueError(
            "model.multi_latent_attention: Megatron-Core builds MLA only with TransformerEngine, which "
            "is not installed; use standard attention (num_query_groups for GQA)"
        )
    use_te = importlib.util.find_spec("transformer_engine") is not None and device.type == "cuda"
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te)
    compat.use_router(spec.layer_specs)
    with cuda_device_is_host():
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=cfg.gpt.vocab_size,
            max_sequence_length=cfg.gpt.max_sequence_length,
            pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=cfg.gpt.share_embeddings_and_output_weights,
            position_embedding_type=cfg.gpt.position_embedding_type,
            rotary_base=cfg.gpt.rotary_base,
        )
    with torch.no_grad():  # local norms keep fp32 weights; give every parameter the model dtype (buffers such
        for param in model.parameters():  # as the fp32 expert bias and token counts stay as they are)
            if param.is_floating_point() and param.dtype != config.params_dtype:
                param.data = param.data.to(config.params_dtype)
    return model.to(device)


def moe_routers(model: torch.nn.Module) -> list[Any]:
    """The MoE routers of ``model`` (each holds its expert bias and the token counts since the last update)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]
