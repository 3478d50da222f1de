"""YAML → Megatron-Core ``TransformerConfig`` (+ parallel layout, GPT, plugin, training and data options).

A pretraining YAML has these sections; anything else, and any key a section does not know, is an error that
names it:

- ``parallel``: ``tensor_model_parallel_size``, ``pipeline_model_parallel_size``, ``expert_model_parallel_size``,
  ``expert_tensor_parallel_size``, ``sequence_parallel`` (only here: the same keys under ``model`` conflict).
- ``model``: ``TransformerConfig`` fields (``MLATransformerConfig`` when ``multi_latent_attention: true``), by
  their Megatron names, plus ``activation: gelu | silu | swiglu | geglu`` (functions cannot be written in YAML)
  and ``dtype: fp32 | bf16 | fp16`` (sets ``params_dtype``/``bf16``/``fp16`` together).
  ``moe_token_dispatcher_type: ep_plugin`` selects this library's dispatcher; ``flex`` with
  ``moe_flex_dispatcher_backend: deepep | hybridep | ncclep | deepepv2`` (the last two where Megatron has them) runs
  Megatron's own flex dispatcher on this library.
- ``ep_plugin``: :class:`PluginOptions` (``transport``, ``fp8_dispatch``, ``round_scale``, ``num_sms``, ``timeout_s``,
  ``ranks_per_node``; for ``ep_plugin`` also the row budget ``recv_capacity_factor``, ``drop_on_overflow``).
- ``gpt``: ``GPTModel`` arguments (``vocab_size``, ``max_sequence_length``, ``position_embedding_type``, ...).
- ``train``, ``data``: the launcher's own options (:class:`TrainOptions`, :class:`DataOptions`).
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from dataclasses import dataclass
from typing import Any

import torch

from ...megatron.options import PLUGIN_DISPATCHER_TYPE, PluginOptions, set_plugin_options
from ..common.yaml_sections import build_section, check_sections, coerce, optional_inner, read_yaml

PARALLEL_KEYS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "sequence_parallel",
)
SECTIONS = ("parallel", "model", "ep_plugin", "gpt", "train", "data")
_ACTIVATIONS = {
    "gelu": (torch.nn.functional.gelu, False),
    "silu": (torch.nn.functional.silu, False),
    "swiglu": (torch.nn.functional.silu, True),
    "geglu": (torch.nn.functional.gelu, True),
}
_DTYPES = {
    "fp32": (torch.float32, False, False),
    "bf16": (torch.bfloat16, True, False),
    "fp16": (torch.float16, False, True),
}
_SMS_KEYS = ("moe_flex_dispatcher_num_sms", "moe_deepep_num_sms", "moe_hybridep_num_sms")
# Literal fields whose choices install() extends (checked where the dispatcher is picked)
_PLUGIN_CHOICES = ("moe_token_dispatcher_type", "moe_flex_dispatcher_backend")
_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")  # Megatron-Core's router reads these


@dataclass(frozen=True)
class GPTOptions:
    """``GPTModel`` constructor arguments that are not part of ``TransformerConfig``."""

    vocab_size: int = 256
    max_sequence_length: int = 256
    position_embedding_type: str = "rope"
    rotary_base: int = 10000
    share_embeddings_and_output_weights: bool = False


@dataclass(frozen=True)
class TrainOptions:
    """Training loop: ``steps`` optimizer steps of ``global_batch_size`` sequences of ``seq_length`` tokens."""

    steps: int = 100
    seq_length: int = 128
    micro_batch_size: int = 4
    global_batch_size: int = 8
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 10
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    clip_grad: float = 1.0
    seed: int = 1234
    log_interval: int = 10
    save_dir: str | None = None
    save_interval: int = 0
    load_dir: str | None = None
    resume_fallback: bool = False  # a damaged newest checkpoint: resume from the newest good one before it (printed)


@dataclass(frozen=True)
class DataOptions:
    """Offline token data through ``moe_ep_plugin.recipes.common.data``: ``path`` is a text file read as bytes, or a
    ``.npy`` of token ids (None: the corpus shipped in ``moe_ep_plugin/data``); ``eval_fraction`` is held out."""

    path: str | None = None
    seed: int = 0
    eval_fraction: float = 0.05


@dataclass
class PretrainConfig:
    """Everything one YAML file holds, validated."""

    parallel: dict[str, Any]
    transformer: Any  # TransformerConfig or MLATransformerConfig
    gpt: GPTOptions
    plugin: PluginOptions | None
    train: TrainOptions
    data: DataOptions


def _section(raw: dict[str, Any], name: str) -> dict[str, Any]:
    value = raw.get(name) or {}
    if not isinstance(value, dict):
        raise ValueError(f"{name}: expected a mapping, got {type(value).__name__}")
    return dict(value)


def _model_value(key: str, spec: dataclasses.Field, value: Any) -> Any:
    """A ``TransformerConfig`` field's YAML value, type-checked when the field is a plain bool/int/float/str or
    Optional of one, checked against the choices of a ``Literal`` one (Megatron reads those only in the ranks);
    Megatron's other annotations are left to its own ``__post_init__``."""
    hint = optional_inner(spec.type) or spec.type
    literal = typing.get_origin(hint) is typing.Literal and spec.name not in _PLUGIN_CHOICES
    if literal and value is not None and value not in typing.get_args(hint):
        raise ValueError(f"{key}: expected one of {list(typing.get_args(hint))}, got {value!r}")
    return coerce(key, value, spec.type) if hint in (bool, int, float, str) and value is not None else value


def _check_values(kwargs: dict[str, Any]) -> None:
    """Model values Megatron-Core takes and fails on (or trains with) only in the ranks."""
    for key in ("ffn_hidden_size", "moe_ffn_hidden_size"):
        if kwargs.get(key) is not None and kwargs[key] < 1:
            raise ValueError(f"model.{key}: must be >= 1, got {kwargs[key]}")
    for key in ("hidden_dropout", "attention_dropout"):
        if key in kwargs and not 0.0 <= kwargs[key] <= 1.0:
            raise ValueError(f"model.{key}: must be in [0, 1], got {kwargs[key]}")
    scaling = kwargs.get("moe_router_topk_scaling_factor")
    if scaling is not None and not scaling > 0:
        raise ValueError(f"model.moe_router_topk_scaling_factor: must be > 0 or null, got {scaling}")
    for key in ("moe_router_bias_update_rate", "moe_aux_loss_coeff"):
        values = kwargs.get(key, 0.0)
        if any(v < 0 for v in (values if isinstance(values, list) else [values])):
            raise ValueError(f"model.{key}: must be >= 0, got {values}")
    types = kwargs.get("moe_router_load_balancing_type", "aux_loss")
    bad = [t for t in (types if isinstance(types, list) else [types]) if t not in _BALANCING]
    if bad:
        raise ValueError(f"model.moe_router_load_balancing_type: expected one of {list(_BALANCING)}, got {bad[0]!r}")
    freq = kwargs.get("moe_layer_freq")
    if isinstance(freq, int) and freq < 1:
        raise ValueError(f"model.moe_layer_freq: must be >= 1 (a MoE layer every this-many) or a list, got {freq}")


def _check_shape(kwargs: dict[str, Any]) -> None:
    """Model sizes Megatron-Core checks late or not at all (a reshape error in the ranks, a ZeroDivisionError)."""
    for key in ("num_layers", "hidden_size", "num_attention_heads"):
        if not isinstance(kwargs.get(key), int) or kwargs[key] < 1:
            raise ValueError(f"model.{key}: expected an int >= 1, got {kwargs.get(key)!r}")
    hidden, heads, groups = kwargs["hidden_size"], kwargs["num_attention_heads"], kwargs.get("num_query_groups")
    if kwargs.get("kv_channels") is None and hidden % heads:
        raise ValueError(
            f"model.num_attention_heads: model.hidden_size={hidden} is not a multiple of {heads} heads "
            f"(or set model.kv_channels)"
        )
    if groups is not None and (groups < 1 or heads % groups):
        raise ValueError(f"model.num_query_groups: {groups} does not divide model.num_attention_heads={heads}")
    freq = kwargs.get("moe_layer_freq")
    if isinstance(freq, list) and len(freq) != kwargs["num_layers"]:
        raise ValueError(f"model.moe_layer_freq: {len(freq)} entries for model.num_layers={kwargs['num_layers']}")


def _check_experts(kwargs: dict[str, Any]) -> None:
    """What Megatron-Core checks late or not at all (after the ranks started, or as an index error)."""
    experts, topk = kwargs.get("num_moe_experts"), kwargs.get("moe_router_topk", 2)
    if experts is None:
        return
    if experts < 1:
        raise ValueError(f"model.num_moe_experts: must be >= 1 (or null for a dense model), got {experts}")
    if not 1 <= topk <= experts:
        raise ValueError(f"model.moe_router_topk: top-{topk} needs 1 <= topk <= model.num_moe_experts={experts}")
    ep = kwargs.get("expert_model_parallel_size", 1)
    if experts % ep:
        raise ValueError(
            f"model.num_moe_experts: {experts} experts cannot be split evenly over "
            f"parallel.expert_model_parallel_size={ep} ranks"
        )
    groups, group_topk = kwargs.get("moe_router_num_groups"), kwargs.get("moe_router_group_topk")
    if groups is not None and (groups < 1 or experts % groups):
        raise ValueError(f"model.moe_router_num_groups: {groups} groups do not divide model.num_moe_experts={experts}")
    if groups is not None and group_topk is not None and not 1 <= group_topk <= groups:
        raise ValueError(f"model.moe_router_group_topk: {group_topk} is not in 1..model.moe_router_num_groups={groups}")


def _check_no_cuda_graphs(kwargs: dict[str, Any]) -> None:
    """The launcher's loop runs the model eagerly: it never calls Megatron's ``create_cudagraphs`` nor seeds a
    graph-safe RNG tracker, so Megatron's CUDA-graph settings would be built but never captured."""
    impl = kwargs.get("cuda_graph_impl", "none")
    if impl != "none":
        raise ValueError(
            f"model.cuda_graph_impl: {impl!r} is not served by moe-ep-pretrain, whose training loop "
            f"runs eagerly; use 'none' (Megatron's own training loop drives its CUDA graphs)"
        )
    for key in ("enable_cuda_graph", "external_cuda_graph"):
        if kwargs.get(key):
            raise ValueError(f"model.{key}: not served by moe-ep-pretrain, whose training loop runs eagerly")


def _config_class(model: dict[str, Any]) -> type:
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    return MLATransformerConfig if model.get("multi_latent_attention") else TransformerConfig


def build_transformer_config(model: dict[str, Any], parallel: dict[str, Any], plugin: PluginOptions | None) -> Any:
    """``model`` + ``parallel`` sections (and the plugin options) → a validated Megatron config object."""
    model = dict(model)
    clash = sorted(set(model) & set(PARALLEL_KEYS))
    if clash:
        raise ValueError(f"model: {clash} belong in the parallel: section (set them there only)")
    unknown = sorted(set(parallel) - set(PARALLEL_KEYS))
    if unknown:
        raise ValueError(f"parallel: unknown key(s) {unknown}; known: {list(PARALLEL_KEYS)}")
    kwargs: dict[str, Any] = dict(parallel)
    if "activation" in model:
        name = model.pop("activation")
        if name not in _ACTIVATIONS:
            raise ValueError(f"model.activation must be one of {sorted(_ACTIVATIONS)}, got {name!r}")
        if "gated_linear_unit" in model:
            raise ValueError("model: give activation or gated_linear_unit, not both (activation sets it)")
        kwargs["activation_func"], kwargs["gated_linear_unit"] = _ACTIVATIONS[name]
    if "dtype" in model:
        name = model.pop("dtype")
        if name not in _DTYPES:
            raise ValueError(f"model.dtype must be one of {sorted(_DTYPES)}, got {name!r}")
        for key in ("params_dtype", "bf16", "fp16"):
            if key in model:
                raise ValueError(f"model: give dtype or {key}, not both (dtype sets it)")
        kwargs["params_dtype"], kwargs["bf16"], kwargs["fp16"] = _DTYPES[name]
    for key in ("activation_func", "params_dtype", "init_method", "output_layer_init_method"):
        if key in model:
            raise ValueError(f"model.{key}: not expressible in YAML (use model.activation / model.dtype)")
    cls = _config_class(model)
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(model) - set(known))
    if unknown:
        raise ValueError(f"model: unknown key(s) {unknown} for {cls.__name__}")
    for key, value in model.items():
        kwargs[key] = _model_value(f"model.{key}", known[key], value)
    for key in PARALLEL_KEYS[:4]:
        if key in kwargs and kwargs[key] is not None:
            kwargs[key] = coerce(f"parallel.{key}", kwargs[key], int)
            if kwargs[key] < 1:
                raise ValueError(f"parallel.{key}: must be >= 1, got {kwargs[key]}")
    if "sequence_parallel" in kwargs:
        kwargs["sequence_parallel"] = coerce("parallel.sequence_parallel", kwargs["sequence_parallel"], bool)
    if kwargs.get("pipeline_model_parallel_size", 1) != 1:
        raise ValueError("parallel.pipeline_model_parallel_size: the launcher runs one pipeline stage; use 1")
    _check_shape(kwargs)
    _check_values(kwargs)
    _check_experts(kwargs)
    _check_no_cuda_graphs(kwargs)

    dispatcher = model.get("moe_token_dispatcher_type", "allgather")
    # Every flex backend goes through install(): it serves deepep, hybridep (ncclep, deepepv2 where Megatron has them)
    # and refuses any other backend at config time, naming the key.
    serves_plugin = dispatcher in (PLUGIN_DISPATCHER_TYPE, "flex")
    if plugin is not None and not serves_plugin:
        raise ValueError(
            f"ep_plugin: options given but model.moe_token_dispatcher_type is {dispatcher!r}; use "
            f"{PLUGIN_DISPATCHER_TYPE!r} or flex"
        )
    sms = {k: model[k] for k in _SMS_KEYS if model.get(k) is not None}
    if plugin is not None and plugin.num_sms is not None and any(v != plugin.num_sms for v in sms.values()):
        raise ValueError(f"ep_plugin.num_sms={plugin.num_sms} conflicts with model {sms}")
    if serves_plugin:
        from ...megatron.registration import install

        install(plugin)  # idempotent; makes this config's options the defaults of the DeepEP shim
    try:
        config = cls(**kwargs)
    except (AssertionError, TypeError, ValueError) as exc:  # Megatron's own checks name fields, not our sections
        text = str(exc)
        # the keys its message names (by field or by command-line flag), under their sections
        named = [
            f"{'parallel' if key in PARALLEL_KEYS else 'model'}.{key}"
            for key in kwargs
            if key in text or key.replace("_", "-") in text
        ]
        raise ValueError(
            f"{', '.join(named) or 'model'}: Megatron-Core's {cls.__name__} rejects this section: {text}"
        ) from exc
    if dispatcher == PLUGIN_DISPATCHER_TYPE:
        set_plugin_options(config, plugin or PluginOptions())
    return config


def _check_launcher_values(gpt: GPTOptions, train: TrainOptions, data: DataOptions) -> None:
    """The launcher's own values that GPTModel, the optimizer or the data would take and fail on (or train with)
    only in the ranks."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    for key, value in (
        ("gpt.vocab_size", gpt.vocab_size),
        ("gpt.max_sequence_length", gpt.max_sequence_length),
        ("gpt.rotary_base", gpt.rotary_base),
        ("train.lr", train.lr),
    ):
        if not value > 0:
            raise ValueError(f"{key}: must be > 0, got {value}")
    for key, value in (
        ("train.min_lr", train.min_lr),
        ("train.warmup_steps", train.warmup_steps),
        ("train.weight_decay", train.weight_decay),
        ("train.clip_grad", train.clip_grad),
        ("train.seed", train.seed),
        ("train.save_interval", train.save_interval),
        ("data.seed", data.seed),  # numpy's generators take no negative seed
    ):
        if value < 0:
            raise ValueError(f"{key}: must be >= 0, got {value}")
    if train.min_lr > train.lr:
        raise ValueError(f"train.min_lr: {train.min_lr} is above train.lr={train.lr}")
    for key, value in (("train.adam_beta1", train.adam_beta1), ("train.adam_beta2", train.adam_beta2)):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{key}: must be in [0, 1), got {value}")
    positions = typing.get_args(inspect.signature(GPTModel).parameters["position_embedding_type"].annotation)
    if gpt.position_embedding_type not in positions:
        raise ValueError(
            f"gpt.position_embedding_type: expected one of {list(positions)}, got {gpt.position_embedding_type!r}"
        )


def load_pretrain_config(source: str | dict[str, Any]) -> PretrainConfig:
    """Read a YAML file path (or an already parsed mapping) into a :class:`PretrainConfig`."""
    if isinstance(source, str):
        raw = read_yaml(source)
    elif isinstance(source, dict):
        raw = source
    else:
        raise TypeError(f"source: expected a YAML path or a mapping, got {type(source).__name__}")
    check_sections(raw, SECTIONS)
    plugin = PluginOptions.from_dict(raw["ep_plugin"] or {}, "ep_plugin") if "ep_plugin" in raw else None
    parallel = _section(raw, "parallel")
    train = build_section("train", TrainOptions, raw.get("train"))
    data = build_section("data", DataOptions, raw.get("data"))
    gpt = build_section("gpt", GPTOptions, raw.get("gpt"))
    _check_launcher_values(gpt, train, data)
    if not 0.0 <= data.eval_fraction < 1.0:
        raise ValueError(f"data.eval_fraction must be in [0, 1), got {data.eval_fraction}")
    if train.seq_length > gpt.max_sequence_length:
        raise ValueError(
            f"train.seq_length={train.seq_length} exceeds gpt.max_sequence_length={gpt.max_sequence_length}"
        )
    for name in ("steps", "seq_length", "micro_batch_size", "global_batch_size", "log_interval"):
        if getattr(train, name) <= 0:
            raise ValueError(f"train.{name} must be positive, got {getattr(train, name)}")
    if train.global_batch_size % train.micro_batch_size:
        raise ValueError(
            f"train.global_batch_size={train.global_batch_size} must be a multiple of "
            f"train.micro_batch_size={train.micro_batch_size}"
        )
    transformer = build_transformer_config(_section(raw, "model"), parallel, plugin)
    return PretrainConfig(parallel=parallel, transformer=transformer, gpt=gpt, plugin=plugin, train=train, data=data)
