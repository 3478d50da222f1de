"""The trainer's YAML schema: sections of typed, documented keys, loaded strictly and validated.

A config file is a mapping of sections (``model``, ``moe``, ``parallel``, ``data``, ``train``, ``output``) to
mappings of keys. A missing key takes its default (the defaults are ``configs/tiny.yaml``); an unknown
section or key, a value of the wrong type, or a combination that cannot run is a ``ValueError`` whose message
starts with the dotted key, e.g. ``moe.num_experts: 6 experts cannot be split over 4 EP ranks``.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from typing import Any

from ...config import DEFAULT_TIMEOUT_S
from ...experts import EXPERT_COMPUTE
from ...transports import TRANSPORTS
from ..common import checkpoint
from ..common.yaml_sections import apply_overrides, build_section, check_sections, read_yaml, type_name

FP8_BLOCK = 128  # FP8 dispatch quantizes per token in blocks of this many channels (moe_ep_plugin.ops.fp8.BLOCK)


def _doc(text: str, default: Any) -> Any:
    """A dataclass field with its user-facing description (shown in errors, --help-config and docs)."""
    return field(default=default, metadata={"doc": text})


@dataclass
class ModelConfig:
    vocab_size: int = _doc("Token vocabulary; 256 for the byte-level text path, larger for .npy token files.", 256)
    hidden_size: int = _doc("Width of the residual stream (H). FP8 dispatch needs a multiple of 128.", 128)
    num_layers: int = _doc("Transformer blocks in total (dense + MoE).", 4)
    num_dense_layers: int = _doc(
        "The first this-many blocks use a dense MLP (DeepSeek-V3: first_k_dense_replace); the rest are MoE blocks.", 1
    )
    num_heads: int = _doc(
        "Attention heads (plain causal multi-head attention); hidden_size / num_heads must be even.", 4
    )
    ffn_hidden_size: int = _doc("Inner width of the dense blocks' SwiGLU MLP.", 384)
    seq_len: int = _doc("Tokens per training sequence (context length).", 128)
    rope_theta: float = _doc("Base of the rotary position embedding.", 10000.0)
    init_std: float = _doc("Standard deviation of the normal weight initialisation.", 0.02)
    dtype: str = _doc(
        "Compute dtype: 'auto' (bfloat16 on GPU, float32 on CPU), 'bfloat16' or 'float32'. "
        "Parameters and optimizer state stay float32.",
        "auto",
    )


@dataclass
class MoEConfig:
    num_experts: int = _doc("Routed experts per MoE block (E), sharded evenly over the EP ranks.", 8)
    num_shared_experts: int = _doc("Always-on shared experts per MoE block (DeepSeek-V3: 1); 0 disables.", 1)
    expert_ffn_hidden_size: int = _doc("Inner width of each routed (and shared) expert's SwiGLU MLP.", 64)
    topk: int = _doc("Routed experts per token (K).", 2)
    score_function: str = _doc("Router score: 'sigmoid' (DeepSeek-V3) or 'softmax'.", "sigmoid")
    use_pre_softmax: bool = _doc(
        "Softmax only: take top-k of the softmax over all experts (else softmax over the top-k logits).", False
    )
    num_groups: int = _doc("Expert groups for group-limited routing; 1 = plain top-k. Must divide num_experts.", 4)
    group_topk: int = _doc("Groups each token may use (DeepSeek-V3: 4 of 8).", 2)
    scaling_factor: float | None = _doc(
        "Multiplier on the normalised top-k weights (DeepSeek-V3: 2.5); null = none.", None
    )
    expert_bias: bool = _doc(
        "Aux-loss-free balancing: a per-expert bias added to the scores for selection only (sigmoid only).", True
    )
    bias_update_rate: float = _doc(
        "Per step, bias += rate * sign(mean load - expert load) (DeepSeek-V3: 1e-3 over "
        "far more steps than the tiny run).",
        1e-2,
    )
    seq_aux_loss_coeff: float = _doc("Weight of the sequence-wise balance loss (DeepSeek-V3: 1e-4); 0 disables.", 1e-4)
    expert_compute: str = _doc(
        "Routed experts' GEMMs: 'grouped' (torch's grouped matmul, one kernel per projection), "
        "'loop' (one matmul per local expert) or 'auto' (grouped where torch runs it without "
        "a host sync: BF16 on SM90+ GPUs, or CPU; else loop). See moe_ep_plugin.experts.",
        "auto",
    )


@dataclass
class ParallelConfig:
    nprocs: int = _doc(
        "Local ranks to spawn when not under torchrun (= the EP size); under torchrun its "
        "WORLD_SIZE is the EP size instead.",
        2,
    )
    device: str = _doc("'auto' (cuda when available), 'cpu' or 'cuda'. One GPU per rank.", "auto")
    backend: str = _doc("torch.distributed backend: 'auto' (nccl on GPU, gloo on CPU), 'gloo' or 'nccl'.", "auto")
    transport: str = _doc(
        "moe_ep_plugin.Buffer transport: 'auto' (NVLink kernels when built and usable, else torch), "
        "'torch' (torch.distributed collectives, any device), 'nvlink' or 'hierarchical' (NVLink "
        "inside a node, NCCL between nodes: docs/multinode.md).",
        "auto",
    )
    ranks_per_node: int | None = _doc(
        "EP ranks per node for the hierarchical transport; null = the launcher's "
        "(LOCAL_WORLD_SIZE, else hostnames). Set it to emulate nodes on one host.",
        None,
    )
    fp8_dispatch: bool = _doc(
        "Send tokens as FP8 e4m3 with per-128-channel scales on dispatch (receive BF16); "
        "combine and all gradients stay BF16. Needs hidden_size % 128 == 0.",
        False,
    )
    timeout_s: float = _doc("Seconds a collective may wait for a missing rank before raising.", DEFAULT_TIMEOUT_S)


@dataclass
class DataConfig:
    path: str | None = _doc(
        "null = the corpus shipped in moe_ep_plugin/data; a .npy file = integer token ids "
        "(< vocab_size); any other file = text read as UTF-8 bytes (byte-level tokens).",
        None,
    )
    eval_fraction: float = _doc("Tail fraction of the tokens held out for evaluation (0 disables eval).", 0.05)


@dataclass
class TrainConfig:
    seed: int = _doc("Seed of the weights and of the data order (every rank derives the same stream).", 1234)
    steps: int = _doc("Optimizer steps to train in total (a resumed run continues up to this).", 300)
    micro_batch_size: int = _doc("Sequences per rank per step; the global batch is this times the EP size.", 8)
    lr: float = _doc("Peak learning rate (AdamW).", 3e-3)
    min_lr: float = _doc("Learning rate at the end of the cosine decay.", 3e-4)
    warmup_steps: int = _doc("Linear warm-up steps before the cosine decay.", 20)
    weight_decay: float = _doc("AdamW decoupled weight decay on matrices (not on norms or biases).", 0.1)
    beta1: float = _doc("AdamW beta1.", 0.9)
    beta2: float = _doc("AdamW beta2.", 0.95)
    grad_clip: float = _doc("Clip the global gradient norm (over all ranks' experts too) to this; 0 disables.", 1.0)
    eval_interval: int = _doc("Evaluate on held-out data every this-many steps and at the end; 0 disables.", 100)
    eval_batches: int = _doc("Batches per evaluation.", 4)


@dataclass
class OutputConfig:
    dir: str = _doc("Run directory: train.log, metrics.csv, checkpoints/, plots, tensorboard/.", "runs/tiny")
    log_interval: int = _doc("Write a log line every this-many steps.", 10)
    checkpoint_interval: int = _doc("Save a checkpoint every this-many steps and at the end; 0 = only at the end.", 100)
    keep_checkpoints: int = _doc("Keep only the newest this-many checkpoints (0 keeps all).", 2)
    resume: str = _doc(
        "'auto' (newest checkpoint in dir/checkpoints if any), 'never', or a checkpoint directory.", "auto"
    )
    resume_fallback: bool = _doc(
        "When a file of the checkpoint to resume is missing or damaged (checked before any "
        "rank starts), resume from the newest complete checkpoint before it that passes, "
        "and say so; false: refuse, naming the file.",
        False,
    )
    tensorboard: bool = _doc("Also write TensorBoard scalars (needs the tensorboard package).", False)
    plots: bool = _doc(
        "Write loss.png and expert_load.png at the end (needs matplotlib: pip install 'moe_ep_plugin[plots]').", True
    )
    progress_bar: bool = _doc("Show a tqdm progress bar on rank 0.", True)
    peak_tflops: float | None = _doc(
        "Peak TFLOP/s of one device for the logged MFU; null = the dense BF16 "
        "datasheet figure of an H100/H200 computing in BF16 (989.4), else MFU n/a.",
        None,
    )


@dataclass
class TrainerConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(TrainerConfig)}  # type: ignore[misc]
_CHOICES = {
    "model.dtype": ("auto", "bfloat16", "float32"),
    "moe.score_function": ("sigmoid", "softmax"),
    "moe.expert_compute": EXPERT_COMPUTE,
    "parallel.device": ("auto", "cpu", "cuda"),
    "parallel.backend": ("auto", "gloo", "nccl"),
    "parallel.transport": ("auto",) + TRANSPORTS,
}


def schema() -> list[tuple[str, str, Any, str]]:
    """Every key as ``(dotted_key, type name, default, description)``, in file order (used by the docs test)."""
    rows = []
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            rows.append((f"{section}.{f.name}", type_name(hints[f.name]), f.default, f.metadata["doc"]))
    return rows


def from_dict(raw: dict[str, Any] | None) -> TrainerConfig:
    """Build and validate a config from nested mappings; unknown sections/keys are errors naming them."""
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ValueError(f"config: expected a mapping of sections, got {type(raw).__name__}")
    check_sections(raw, SECTIONS)
    cfg = TrainerConfig(
        **{section: build_section(section, cls, raw.get(section) or {}) for section, cls in SECTIONS.items()}
    )
    validate(cfg)
    return cfg


def load(path: str | None = None, overrides: tuple[str, ...] = ()) -> TrainerConfig:
    """Read a YAML file (None = all defaults) and apply ``section.key=value`` overrides (values parsed as YAML)."""
    return from_dict(apply_overrides(read_yaml(path), overrides))


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{key}: {message}")


def validate(cfg: TrainerConfig, world_size: int | None = None) -> None:
    """Reject values that cannot run; ``world_size`` (the actual EP size) defaults to ``parallel.nprocs``."""
    m, e, p, d, t, o = cfg.model, cfg.moe, cfg.parallel, cfg.data, cfg.train, cfg.output
    for key, value in dataclasses.asdict(cfg).items():
        for name, v in value.items():
            if f"{key}.{name}" in _CHOICES and v not in _CHOICES[f"{key}.{name}"]:
                raise ValueError(f"{key}.{name}: expected one of {_CHOICES[f'{key}.{name}']}, got {v!r}")
    positive = {
        "model.vocab_size": m.vocab_size,
        "model.hidden_size": m.hidden_size,
        "model.num_layers": m.num_layers,
        "model.num_heads": m.num_heads,
        "model.ffn_hidden_size": m.ffn_hidden_size,
        "model.seq_len": m.seq_len,
        "model.rope_theta": m.rope_theta,
        "model.init_std": m.init_std,
        "moe.num_experts": e.num_experts,
        "moe.expert_ffn_hidden_size": e.expert_ffn_hidden_size,
        "moe.topk": e.topk,
        "moe.num_groups": e.num_groups,
        "moe.group_topk": e.group_topk,
        "parallel.nprocs": p.nprocs,
        "parallel.timeout_s": p.timeout_s,
        "train.steps": t.steps,
        "train.micro_batch_size": t.micro_batch_size,
        "train.lr": t.lr,
        "train.eval_batches": t.eval_batches,
        "output.log_interval": o.log_interval,
    }
    for key, value in positive.items():
        _require(value > 0, key, f"must be > 0, got {value}")
    non_negative = {
        "model.num_dense_layers": m.num_dense_layers,
        "moe.num_shared_experts": e.num_shared_experts,
        "moe.bias_update_rate": e.bias_update_rate,
        "moe.seq_aux_loss_coeff": e.seq_aux_loss_coeff,
        "train.seed": t.seed,  # numpy's generators take no negative seed (they would fail in the ranks)
        "train.min_lr": t.min_lr,
        "train.warmup_steps": t.warmup_steps,
        "train.weight_decay": t.weight_decay,
        "train.grad_clip": t.grad_clip,
        "train.eval_interval": t.eval_interval,
        "output.checkpoint_interval": o.checkpoint_interval,
        "output.keep_checkpoints": o.keep_checkpoints,
    }
    for key, value in non_negative.items():
        _require(value >= 0, key, f"must be >= 0, got {value}")
    _require(
        m.num_dense_layers <= m.num_layers,
        "model.num_dense_layers",
        f"{m.num_dense_layers} dense blocks do not fit in model.num_layers={m.num_layers}",
    )
    _require(
        m.hidden_size % m.num_heads == 0 and (m.hidden_size // m.num_heads) % 2 == 0,
        "model.num_heads",
        f"hidden_size {m.hidden_size} must split into {m.num_heads} heads of even width (rotary embedding)",
    )
    _require(
        m.vocab_size >= 256 or d.path is not None and d.path.endswith(".npy"),
        "model.vocab_size",
        f"byte-level text needs vocab_size >= 256, got {m.vocab_size}",
    )
    _require(0.0 <= d.eval_fraction < 0.5, "data.eval_fraction", f"must be in [0, 0.5), got {d.eval_fraction}")
    _require(t.min_lr <= t.lr, "train.min_lr", f"{t.min_lr} is above train.lr={t.lr}")
    _require(0.0 <= t.beta1 < 1.0, "train.beta1", f"must be in [0, 1), got {t.beta1}")
    _require(0.0 <= t.beta2 < 1.0, "train.beta2", f"must be in [0, 1), got {t.beta2}")
    if d.path is not None:
        _require(os.path.isfile(d.path), "data.path", f"no such file {d.path!r}")

    ep = p.nprocs if world_size is None else world_size
    ep_key = "parallel.nprocs" if world_size is None else "WORLD_SIZE"
    _require(
        e.num_experts % ep == 0,
        "moe.num_experts",
        f"{e.num_experts} experts cannot be split evenly over {ep} EP ranks ({ep_key}={ep})",
    )
    _require(
        e.num_experts % e.num_groups == 0,
        "moe.num_groups",
        f"{e.num_groups} groups do not divide moe.num_experts={e.num_experts}",
    )
    _require(
        e.group_topk <= e.num_groups, "moe.group_topk", f"{e.group_topk} is more than moe.num_groups={e.num_groups}"
    )
    if p.ranks_per_node is not None:
        _require(
            p.transport not in ("torch", "nvlink"),
            "parallel.ranks_per_node",
            f"only the 'hierarchical' transport (or 'auto', which may pick it) splits the EP ranks into nodes; "
            f"parallel.transport is {p.transport!r} (drop ranks_per_node, or use transport: hierarchical)",
        )
        _require(
            p.ranks_per_node > 0 and ep % p.ranks_per_node == 0,
            "parallel.ranks_per_node",
            f"{p.ranks_per_node} does not divide the {ep} EP ranks ({ep_key}={ep})",
        )
        nodes = ep // p.ranks_per_node
        # Groups map onto nodes (experts and ranks are both contiguous): with num_groups a multiple of the node
        # count each group lies on one node, so a token reaches at most group_topk nodes.
        _require(
            e.num_groups == 1 or e.num_groups % nodes == 0,
            "moe.num_groups",
            f"{e.num_groups} groups do not map onto the {nodes} nodes (parallel.ranks_per_node="
            f"{p.ranks_per_node}): use a multiple of the node count so each group lies on one node",
        )
    reachable = e.group_topk * (e.num_experts // e.num_groups)
    _require(
        e.topk <= reachable,
        "moe.topk",
        f"top-{e.topk} exceeds the {reachable} experts in the {e.group_topk} allowed groups "
        f"(group_topk * num_experts / num_groups)",
    )
    _require(
        e.topk >= e.group_topk,
        "moe.group_topk",
        f"group scores sum the top topk/group_topk experts of a group, so group_topk={e.group_topk} "
        f"must not exceed moe.topk={e.topk}",
    )
    _require(
        e.scaling_factor is None or e.scaling_factor > 0,
        "moe.scaling_factor",
        f"must be > 0 or null, got {e.scaling_factor}",
    )
    _require(
        not e.expert_bias or e.score_function == "sigmoid",
        "moe.expert_bias",
        "the aux-loss-free bias needs moe.score_function: sigmoid",
    )
    _require(
        e.score_function == "softmax" or not e.use_pre_softmax,
        "moe.use_pre_softmax",
        "only applies to moe.score_function: softmax",
    )
    has_moe = m.num_layers > m.num_dense_layers
    _require(
        not p.fp8_dispatch or not has_moe or m.hidden_size % FP8_BLOCK == 0,
        "parallel.fp8_dispatch",
        f"FP8 dispatch needs model.hidden_size % {FP8_BLOCK} == 0, got {m.hidden_size}",
    )
    _require(not (p.device == "cpu" and p.backend == "nccl"), "parallel.backend", "nccl needs parallel.device: cuda")
    _require(
        not (p.device == "cuda" and p.backend == "gloo"),
        "parallel.backend",
        "gloo cannot move CUDA tensors for the Buffer; use nccl or auto",
    )
    checkpoint.check_writable(o.dir, "output.dir")
    _require(
        o.peak_tflops is None or o.peak_tflops > 0, "output.peak_tflops", f"must be > 0 or null, got {o.peak_tflops}"
    )
    _require(
        o.resume in ("auto", "never") or os.path.isdir(o.resume),
        "output.resume",
        f"expected 'auto', 'never' or an existing checkpoint directory, got {o.resume!r}",
    )
