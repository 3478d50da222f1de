"""YAML run configuration of the DeepSpeed example: strict sections, every key typed and checked.

A file maps sections to keys::

    dispatcher: plugin        # 'plugin' (moe_ep_plugin.deepspeed.MoE), 'deepspeed' (deepspeed.moe.layer.MoE) or
                              # 'autoep' (DeepSpeed AutoEP on a tiny Mixtral: recipes/deepspeed/autoep.py)
    model: {...}              # ModelConfig
    moe: {...}                # MoEConfig: deepspeed.moe.layer.MoE's arguments + the plugin's options
    autoep: {...}             # AutoEPConfig (dispatcher: autoep only)
    train: {...}              # TrainConfig
    deepspeed: {...}          # passed to deepspeed.initialize as its config (JSON keys)

Missing keys take their defaults; an unknown section or key, a wrong type or an impossible combination raises
``ValueError`` starting with the dotted key (``moe.ep_size: ...``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field
from typing import Any

import torch

from ...config import positive_int
from ...deep_ep.install import real_deep_ep_origin
from ...deepspeed.autoep_versions import autoep_requirements, check_autoep_versions
from ...deepspeed.options import DeepSpeedOptions, check_moe_args
from ...ops import fp8
from ..common import checkpoint, schedule
from ..common.yaml_sections import apply_overrides, build_section, check_sections, read_yaml

DISPATCHERS = ("plugin", "deepspeed", "autoep")
AUTOEP_BACKENDS = ("deepep", "comm")
DTYPES = ("auto", "float32", "bfloat16")
NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")  # deepspeed.moe.layer.MoE's (it asserts in the ranks)


@dataclass
class ModelConfig:
    """A next-token model: embedding, ``num_layers`` pre-norm residual MoE blocks, a norm, an LM head."""

    vocab_size: int = 256
    hidden_size: int = 128
    ffn_hidden_size: int = 256  # inner width of each expert's GELU MLP
    num_layers: int = 2
    seq_len: int = 64


@dataclass(frozen=True)
class MoEConfig(DeepSpeedOptions):
    """``deepspeed.moe.layer.MoE`` arguments (same names) plus the plugin's options (the inherited
    :class:`DeepSpeedOptions` fields: router, score_function, ..., fp8_dispatch, transport; dispatcher: plugin only)."""

    num_experts: int = 8
    ep_size: int = 2
    k: int = 2
    capacity_factor: float = 1.0
    eval_capacity_factor: float = 1.0
    min_capacity: int = 0
    drop_tokens: bool = False
    use_rts: bool = True
    noisy_gate_policy: str | None = None
    use_residual: bool = False
    top2_2nd_expert_sampling: bool = True
    aux_loss_coeff: float = 0.01  # loss += coeff * sum of the layers' l_aux

    def plugin_options(self) -> DeepSpeedOptions:
        return DeepSpeedOptions(**{f.name: getattr(self, f.name) for f in dataclasses.fields(DeepSpeedOptions)})

    def stock(self) -> MoEConfig:
        """The same DeepSpeed arguments with the plugin's options at their defaults (for dispatcher: deepspeed)."""
        defaults = DeepSpeedOptions()
        return dataclasses.replace(
            self, **{f.name: getattr(defaults, f.name) for f in dataclasses.fields(DeepSpeedOptions)}
        )


@dataclass
class AutoEPConfig:
    """``dispatcher: autoep``: DeepSpeed's ``expert_parallel`` section (``enabled``, ``autoep_size`` = ``moe.ep_size``,
    ``preset_model: mixtral``, ``comm_max_tokens_per_rank`` = the tokens of a micro-batch are set by the example)."""

    comm_backend: str = "deepep"  # deepep: DeepEP's API served by moe_ep_plugin | comm: AutoEP's own all-to-all
    use_grouped_mm: bool = False  # AutoEP's experts as torch._grouped_mm (else its per-expert loop)
    num_attention_heads: int = 4  # the Mixtral's attention heads (key/value heads alike)


# DeepSpeed MoE layer arguments AutoEP's Mixtral blocks do not take (dropless top-k softmax routing, no aux loss)
_AUTOEP_REFUSED_MOE = {
    "capacity_factor": "capacity",
    "eval_capacity_factor": "capacity",
    "min_capacity": "capacity",
    "drop_tokens": "token dropping",
    "noisy_gate_policy": "noisy gating",
    "use_residual": "residual MoE",
    "use_rts": "random token selection",
    "top2_2nd_expert_sampling": "second-expert sampling",
}


@dataclass
class TrainConfig:
    steps: int = 30
    micro_batch_size: int = 8  # sequences per rank per step
    lr: float = 3e-3  # peak learning rate (AdamW)
    min_lr: float | None = None  # cosine decay to this at train.steps; null = lr (constant after warm-up)
    lr_warmup_steps: int = 0  # linear warm-up steps (recipes.common.schedule, as every recipe)
    seed: int = 1234
    dtype: str = "auto"  # auto: bfloat16 on GPU, float32 on CPU
    log_interval: int = 10
    warmup_steps: int = 5  # steps left out of the step-time median
    nprocs: int = 2  # ranks to spawn when not started by torchrun
    checkpoint_dir: str | None = None  # save a DeepSpeed checkpoint here at the end (step_NNNNNNN/, COMPLETE)

    def lr_at(self, step: int) -> float:
        """The shared schedule's LR of 0-based ``step``."""
        return schedule.lr_at(
            step, self.lr, self.lr if self.min_lr is None else self.min_lr, self.lr_warmup_steps, self.steps
        )

    def torch_dtype(self) -> torch.dtype:
        """The activation dtype: ``auto`` is BF16 when CUDA is available, else FP32."""
        if self.dtype == "auto":
            return torch.bfloat16 if torch.cuda.is_available() else torch.float32
        return getattr(torch, self.dtype)


@dataclass
class RunConfig:
    dispatcher: str = "plugin"
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    autoep: AutoEPConfig = field(default_factory=AutoEPConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    deepspeed: dict = field(default_factory=lambda: {"zero_optimization": {"stage": 2}})


# keys of the DeepSpeed config the train section owns
_OWNED_DS_KEYS = {
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "train_batch_size": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.micro_batch_size",
    "bf16": "train.dtype",
    "fp16": "train.dtype",
    "optimizer": "train.lr (a torch AdamW is used)",
    "expert_parallel": "dispatcher: autoep and the autoep section",
}


def validate(cfg: RunConfig, world_size: int | None = None) -> RunConfig:
    """Cross-key checks; ``world_size`` (when known) must be a multiple of ``moe.ep_size``."""
    if cfg.dispatcher not in DISPATCHERS:
        raise ValueError(f"dispatcher: expected one of {DISPATCHERS}, got {cfg.dispatcher!r}")
    for key in ("vocab_size", "hidden_size", "ffn_hidden_size", "num_layers", "seq_len"):
        positive_int(getattr(cfg.model, key), f"model.{key}")
    for key in ("num_experts", "ep_size", "k"):
        positive_int(getattr(cfg.moe, key), f"moe.{key}")
    for key in ("steps", "micro_batch_size", "log_interval", "nprocs"):
        positive_int(getattr(cfg.train, key), f"train.{key}")
    m = cfg.moe
    _validate_moe_values(m)
    if m.fp8_dispatch and cfg.model.hidden_size % fp8.BLOCK:
        raise ValueError(
            f"model.hidden_size: moe.fp8_dispatch needs a multiple of {fp8.BLOCK}, got {cfg.model.hidden_size}"
        )
    options = m.plugin_options()
    try:  # the layer's own checks, before any rank starts
        check_moe_args(cfg.model.hidden_size, m.num_experts, m.ep_size, m.k, m.drop_tokens, False, False, options)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"moe.{exc}") from exc
    ranks = world_size if world_size is not None else cfg.train.nprocs
    ranks_key = "WORLD_SIZE" if world_size is not None else "train.nprocs"
    if ranks % m.ep_size:
        raise ValueError(f"moe.ep_size: {m.ep_size} does not divide the {ranks} ranks ({ranks_key}={ranks})")
    if m.ranks_per_node is not None and ranks % m.ranks_per_node:
        raise ValueError(
            f"moe.ranks_per_node: {m.ranks_per_node} does not divide the {ranks} ranks ({ranks_key}={ranks})"
        )
    if m.transport == "nvlink" and not torch.cuda.is_available():
        raise ValueError("moe.transport: 'nvlink' runs CUDA kernels, but torch sees no GPU here (use auto or torch)")
    changed = [
        f.name
        for f in dataclasses.fields(DeepSpeedOptions)
        if (f.name != "transport" or cfg.dispatcher == "autoep")
        and getattr(options, f.name) != getattr(DeepSpeedOptions(), f.name)
    ]
    if cfg.dispatcher != "plugin" and changed:
        raise ValueError(f"moe.{changed[0]}: a plugin option; it needs dispatcher: plugin")
    if cfg.dispatcher == "autoep":
        _validate_autoep(cfg)
    if cfg.train.warmup_steps < 0:
        raise ValueError(f"train.warmup_steps: must be >= 0, got {cfg.train.warmup_steps}")
    if not cfg.train.lr > 0 or cfg.train.lr_warmup_steps < 0:
        raise ValueError(
            f"train.lr: expected > 0 with train.lr_warmup_steps >= 0, got {cfg.train.lr} and "
            f"{cfg.train.lr_warmup_steps}"
        )
    if cfg.train.min_lr is not None and not 0 <= cfg.train.min_lr <= cfg.train.lr:
        raise ValueError(f"train.min_lr: expected 0 <= min_lr <= train.lr={cfg.train.lr}, got {cfg.train.min_lr}")
    if cfg.train.dtype not in DTYPES:
        raise ValueError(f"train.dtype: expected one of {DTYPES}, got {cfg.train.dtype!r}")
    if m.fp8_dispatch and cfg.train.torch_dtype() != torch.bfloat16:
        raise ValueError(
            f"train.dtype: moe.fp8_dispatch quantizes BF16 activations; '{cfg.train.dtype}' gives "
            f"{cfg.train.torch_dtype()} here (use bfloat16)"
        )
    if not isinstance(cfg.deepspeed, dict):
        raise ValueError(f"deepspeed: expected a mapping (DeepSpeed's JSON config), got {type(cfg.deepspeed).__name__}")
    for key, owner in _OWNED_DS_KEYS.items():
        if key in cfg.deepspeed:
            raise ValueError(f"deepspeed.{key}: set by the example from {owner}; remove it here")
    _validate_deepspeed_values(cfg.deepspeed)
    zero = cfg.deepspeed.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ValueError(f"deepspeed.zero_optimization: expected a mapping such as {{stage: 2}}, got {zero!r}")
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2):
        raise ValueError(
            f"deepspeed.zero_optimization.stage: DeepSpeed MoE layers run with ZeRO 0, 1 or 2, got {stage}"
        )
    if cfg.train.checkpoint_dir:
        checkpoint.check_writable(cfg.train.checkpoint_dir, "train.checkpoint_dir")
    return cfg


def _validate_deepspeed_values(ds: dict) -> None:
    """DeepSpeed config values the example's configs set that DeepSpeed takes and fails on (a modulo by zero in
    the ranks) or ignores without a word."""
    clip = ds.get("gradient_clipping", 0.0)
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0:
        raise ValueError(f"deepspeed.gradient_clipping: expected a number >= 0 (0 disables), got {clip!r}")
    positive_int(ds.get("steps_per_print", 1), "deepspeed.steps_per_print")


def _validate_moe_values(m: MoEConfig) -> None:
    """DeepSpeed's MoE arguments it checks only in the ranks (noisy_gate_policy) or not at all (a negative
    capacity factor trains)."""
    if m.noisy_gate_policy not in NOISY_GATE_POLICIES:
        raise ValueError(f"moe.noisy_gate_policy: expected one of {NOISY_GATE_POLICIES}, got {m.noisy_gate_policy!r}")
    for key in ("capacity_factor", "eval_capacity_factor"):
        if not getattr(m, key) > 0:
            raise ValueError(f"moe.{key}: must be > 0, got {getattr(m, key)}")
    for key in ("min_capacity", "aux_loss_coeff"):
        if getattr(m, key) < 0:
            raise ValueError(f"moe.{key}: must be >= 0, got {getattr(m, key)}")


def _validate_autoep(cfg: RunConfig) -> None:
    """What ``dispatcher: autoep`` can run: AutoEP's backends, the Mixtral's shape, the dtype DeepEP's API takes."""
    a = cfg.autoep
    if a.comm_backend not in AUTOEP_BACKENDS:
        raise ValueError(
            f"autoep.comm_backend: expected one of {AUTOEP_BACKENDS} (deepep: served by moe_ep_plugin, "
            f"comm: AutoEP's all-to-all), got {a.comm_backend!r}"
        )
    positive_int(a.num_attention_heads, "autoep.num_attention_heads")
    if cfg.model.hidden_size % a.num_attention_heads:
        raise ValueError(
            f"autoep.num_attention_heads: {a.num_attention_heads} does not divide model.hidden_size="
            f"{cfg.model.hidden_size}"
        )
    defaults = MoEConfig()
    for key, what in _AUTOEP_REFUSED_MOE.items():
        if getattr(cfg.moe, key) != getattr(defaults, key):
            raise ValueError(f"moe.{key}: AutoEP's Mixtral blocks have no {what}; leave it out with dispatcher: autoep")
    if cfg.moe.aux_loss_coeff:
        raise ValueError(
            "moe.aux_loss_coeff: AutoEP's Mixtral blocks add no auxiliary loss (DeepSpeed refuses "
            "load_balance_coeff); set 0 with dispatcher: autoep"
        )
    if a.comm_backend == "deepep":
        if cfg.train.torch_dtype() != torch.bfloat16:
            raise ValueError(
                f"train.dtype: autoep.comm_backend 'deepep' dispatches bfloat16 only (DeepSpeed checks); "
                f"'{cfg.train.dtype}' gives {cfg.train.torch_dtype()} here (use bfloat16)"
            )
        origin = real_deep_ep_origin()
        if origin is not None:
            raise ValueError(
                f"autoep.comm_backend: 'deepep' is served by moe_ep_plugin through install_deep_ep(), "
                f"which does not shadow the real deep_ep importable at {origin}"
            )
    if importlib.util.find_spec("transformers") is None:
        raise ValueError(
            "dispatcher: 'autoep' needs transformers (AutoEP replaces Hugging Face MoE blocks; the "
            f"example builds a tiny Mixtral): pip install '{autoep_requirements()[1]}'"
        )
    try:
        check_autoep_versions()
    except RuntimeError as exc:
        raise ValueError(f"dispatcher: 'autoep': {exc}") from exc


def compare_configs(cfg: RunConfig, world_size: int | None = None) -> dict[str, RunConfig]:
    """The runs of ``--compare``, each validated: the baseline first, then this library's. Stock DeepSpeed MoE vs
    the plugin's layer; with ``dispatcher: autoep``, AutoEP's ``comm`` backend vs its ``deepep`` one on this
    library."""
    if cfg.dispatcher == "autoep":
        runs = {
            f"autoep {backend}": dataclasses.replace(cfg, autoep=dataclasses.replace(cfg.autoep, comm_backend=backend))
            for backend in ("comm", "deepep")
        }
    else:
        runs = {
            "deepspeed": dataclasses.replace(cfg, dispatcher="deepspeed", moe=cfg.moe.stock()),
            "plugin": dataclasses.replace(cfg, dispatcher="plugin"),
        }
    return {name: validate(run, world_size) for name, run in runs.items()}


def parse_config(data: Any, world_size: int | None = None) -> RunConfig:
    """A parsed YAML document (a mapping) → validated :class:`RunConfig`."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"config: expected a mapping of sections, got {type(data).__name__}")
    sections = {"model": ModelConfig, "moe": MoEConfig, "autoep": AutoEPConfig, "train": TrainConfig}
    check_sections(data, ("dispatcher", *sections, "deepspeed"))
    if "autoep" in data and data.get("dispatcher", "plugin") != "autoep":
        raise ValueError("autoep: this section is read with dispatcher: autoep only")
    cfg = RunConfig(
        dispatcher=data.get("dispatcher", "plugin"),
        deepspeed=data.get("deepspeed", RunConfig().deepspeed),
        **{name: build_section(name, cls, data.get(name)) for name, cls in sections.items()},
    )
    return validate(cfg, world_size)


def load_config(path: str, overrides: tuple[str, ...] = (), world_size: int | None = None) -> RunConfig:
    """Read a YAML file; ``overrides`` are ``section.key=value`` strings (values parsed as YAML)."""
    return parse_config(apply_overrides(read_yaml(path), overrides), world_size)
