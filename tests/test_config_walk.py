"""Every key of each front door's config with a bad value (issue 46): the door refuses it with the one stderr line
``PROG: config error: KEY: ...`` naming the key and exit code 2, before any rank starts.

Each case calls the door's own CLI function in this process (what it validates before spawning), with
``launch.run_ranks`` replaced by a stub that fails the test, so a value let through never starts ranks; one real
command per door proves the exit code and the single line end to end. A key of a door's sections missing from its
table fails the test, so a new key comes with its bad values."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import typing
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from moe_ep_plugin import launch
from moe_ep_plugin.recipes.common.yaml_sections import optional_inner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_FILE = "/nonexistent/moe_ep_plugin/walk"


def _wrong_type(hint: Any) -> Any:
    """A YAML value of another type than ``hint`` (a field's annotation)."""
    hint = optional_inner(hint) or hint
    return {int: "many", float: "many", bool: "maybe", str: [1], dict: [1], list: "one"}[
        typing.get_origin(hint) or hint
    ]


def _typed_keys(section: str, cls: type) -> dict[str, Any]:
    """``section.field`` → the field's annotation, for every field of dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    return {f"{section}.{f.name}": hints[f.name] for f in dataclasses.fields(cls)}


@pytest.fixture
def no_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    def started(prog: str, *args: Any, **kwargs: Any) -> int:
        return -1  # the exit code the walk reports for a value let through to the ranks

    monkeypatch.setattr(launch, "run_ranks", started)


def _walk(
    capsys: pytest.CaptureFixture,
    prog: str,
    keys: dict[str, Any],
    bad: dict[str, list[Any]],
    refuse: Callable[[str, Any], int],
) -> None:
    """Every key of ``keys`` (dotted key → annotation) with its ``bad`` values and one of a wrong type: ``refuse(key,
    value)`` (the door's CLI function on that config) returns 2 and printed one line naming the key (a value that
    conflicts with another key may be named beside it)."""
    assert sorted(set(keys) - set(bad)) == [], "keys without bad values in the walk's table"
    failures = []
    for key in keys:
        for value in bad[key] + ([] if keys[key] is None else [_wrong_type(keys[key])]):
            code = refuse(key, value)
            lines = capsys.readouterr().err.strip().splitlines()
            if (
                code != 2
                or len(lines) != 1
                or not lines[0].startswith(f"{prog}: config error: ")
                or key not in lines[0]
            ):
                failures.append(f"{key}={value!r}: exit {code}, stderr {lines}")
    assert not failures, "\n".join(failures)


# ---- moe-ep-train (recipes/train) ----
TRAIN_BAD: dict[str, list[Any]] = {
    "model.vocab_size": [0, 100],
    "model.hidden_size": [0],
    "model.num_layers": [0],
    "model.num_dense_layers": [-1, 5],
    "model.num_heads": [0, 3],
    "model.ffn_hidden_size": [0],
    "model.seq_len": [0],
    "model.rope_theta": [0],
    "model.init_std": [0],
    "model.dtype": ["float64"],
    "moe.num_experts": [0, 7],
    "moe.num_shared_experts": [-1],
    "moe.expert_ffn_hidden_size": [0],
    "moe.topk": [0, 9],
    "moe.score_function": ["relu"],
    "moe.use_pre_softmax": [True],
    "moe.num_groups": [0, 3],
    "moe.group_topk": [0, 5],
    "moe.scaling_factor": [0, -2.5],
    "moe.expert_bias": [],
    "moe.bias_update_rate": [-1e-3],
    "moe.seq_aux_loss_coeff": [-1e-4],
    "moe.expert_compute": ["fast"],
    "parallel.nprocs": [0],
    "parallel.device": ["tpu"],
    "parallel.backend": ["mpi", "nccl"],
    "parallel.transport": ["ib", "nvlink"],
    "parallel.ranks_per_node": [0, 3],
    "parallel.fp8_dispatch": [],
    "parallel.timeout_s": [0],
    "data.path": [NO_FILE],
    "data.eval_fraction": [-0.1, 0.5],
    "train.seed": [-1],
    "train.steps": [0],
    "train.micro_batch_size": [0],
    "train.lr": [0],
    "train.min_lr": [-1e-4, 1.0],
    "train.warmup_steps": [-1],
    "train.weight_decay": [-0.1],
    "train.beta1": [1.0],
    "train.beta2": [-0.1],
    "train.grad_clip": [-1.0],
    "train.eval_interval": [-1],
    "train.eval_batches": [0],
    "output.dir": [os.path.join(ROOT, "README.md", "run")],
    "output.log_interval": [0],
    "output.checkpoint_interval": [-1],
    "output.keep_checkpoints": [-1],
    "output.resume": [NO_FILE],
    "output.resume_fallback": [],
    "output.tensorboard": [],
    "output.plots": [],
    "output.progress_bar": [],
    "output.peak_tflops": [0],
}


def test_every_key_of_the_trainer(tmp_path, capsys, no_ranks) -> None:
    from moe_ep_plugin.recipes.train import cli
    from moe_ep_plugin.recipes.train import config as config_mod

    keys = {key: None for key, *_ in config_mod.schema()}
    keys.update(
        {key: hint for section, cls in config_mod.SECTIONS.items() for key, hint in _typed_keys(section, cls).items()}
    )

    def refuse(key: str, value: Any) -> int:
        return cli.main(["--dry-run", "--set", f"output.dir={tmp_path}", "--set", f"{key}={json.dumps(value)}"])

    _walk(capsys, "moe-ep-train", keys, TRAIN_BAD, refuse)


def _command(args: list[str], prog: str, key: str) -> None:
    """One real command: exit code 2 and one stderr line naming ``key``."""
    env = dict(os.environ, PYTHONPATH=ROOT, DS_ACCELERATOR="cpu")
    out = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"{prog}: config error: {key}"), out.stderr


def test_the_trainer_command(tmp_path) -> None:
    _command(
        [
            sys.executable,
            "-m",
            "moe_ep_plugin.recipes.train.cli",
            "--set",
            f"output.dir={tmp_path}",
            "--set",
            "moe.topk=9",
        ],
        "moe-ep-train",
        "moe.topk",
    )


# ---- moe-ep-pretrain (recipes/megatron): its own sections, and the model keys of the shipped CPU config ----
MEGATRON_BAD: dict[str, list[Any]] = {
    "parallel.tensor_model_parallel_size": [0, 3],
    "parallel.pipeline_model_parallel_size": [0, 2],
    "parallel.expert_model_parallel_size": [0, 3],
    "parallel.expert_tensor_parallel_size": [0, 3],
    "parallel.sequence_parallel": ["maybe"],
    "model.num_layers": [0],
    "model.hidden_size": [0, 130],
    "model.num_attention_heads": [0, 3],
    "model.num_query_groups": [0, 3],
    "model.ffn_hidden_size": [0],
    "model.normalization": ["BatchNorm"],
    "model.activation": ["relu"],
    "model.add_bias_linear": [],
    "model.hidden_dropout": [-0.1, 1.5],
    "model.attention_dropout": [-0.1, 1.5],
    "model.use_cpu_initialization": [],
    "model.dtype": ["fp64"],
    "model.moe_layer_freq": [[0, 1], 0],
    "model.num_moe_experts": [0, 7],
    "model.moe_ffn_hidden_size": [0],
    "model.moe_shared_expert_intermediate_size": [0],
    "model.moe_router_topk": [0, 9],
    "model.moe_router_num_groups": [0, 3],
    "model.moe_router_group_topk": [0, 5],
    "model.moe_router_score_function": ["relu"],
    "model.moe_router_topk_scaling_factor": [0, -2.5],
    "model.moe_router_enable_expert_bias": [],
    "model.moe_router_bias_update_rate": [-1e-3],
    "model.moe_router_load_balancing_type": ["bogus"],
    "model.moe_aux_loss_coeff": [-1e-4],
    "model.moe_router_dtype": ["fp16"],
    "model.moe_token_dispatcher_type": ["bogus"],
    "ep_plugin.transport": ["ib", "nvlink"],
    "ep_plugin.fp8_dispatch": [],
    "ep_plugin.round_scale": [True],
    "ep_plugin.num_sms": [0, 3],
    "ep_plugin.timeout_s": [0],
    "ep_plugin.ranks_per_node": [0, 3],
    "ep_plugin.recv_capacity_factor": [0, -1.0],
    "ep_plugin.drop_on_overflow": [True],  # without recv_capacity_factor
    "gpt.vocab_size": [0, 100],
    "gpt.max_sequence_length": [0, 32],
    "gpt.position_embedding_type": ["spiral"],
    "gpt.rotary_base": [0],
    "gpt.share_embeddings_and_output_weights": [],
    "train.steps": [0],
    "train.seq_length": [0, 128],
    "train.micro_batch_size": [0, 3],
    "train.global_batch_size": [0, 6],
    "train.lr": [0],
    "train.min_lr": [-1e-4, 1.0],
    "train.warmup_steps": [-1],
    "train.weight_decay": [-0.1],
    "train.adam_beta1": [1.0],
    "train.adam_beta2": [-0.1],
    "train.clip_grad": [-1.0],
    "train.seed": [-1],
    "train.log_interval": [0],
    "train.save_dir": [os.path.join(ROOT, "README.md", "run")],
    "train.save_interval": [-1],
    "train.load_dir": [NO_FILE],
    "train.resume_fallback": [],
    "data.path": [NO_FILE],
    "data.seed": [-1],
    "data.eval_fraction": [-0.1, 1.0],
}


def _megatron_keys(raw: dict) -> dict[str, Any]:
    """The launcher's own keys (typed) and the model keys ``raw`` holds (typed by Megatron's annotations)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from moe_ep_plugin.megatron.options import PluginOptions  # the ep_plugin section the launcher reads
    from moe_ep_plugin.recipes.megatron import yaml_config

    keys = {f"parallel.{k}": bool if k == "sequence_parallel" else int for k in yaml_config.PARALLEL_KEYS}
    for section, cls in (
        ("ep_plugin", PluginOptions),
        ("gpt", yaml_config.GPTOptions),
        ("train", yaml_config.TrainOptions),
        ("data", yaml_config.DataOptions),
    ):
        keys.update(_typed_keys(section, cls))
    fields = {f.name: f.type for f in dataclasses.fields(TransformerConfig)}
    for key in raw["model"]:
        hint = fields.get(key)
        keys[f"model.{key}"] = hint if (optional_inner(hint) or hint) in (bool, int, float, str) else None
    return keys


def test_every_key_of_the_megatron_launcher(tmp_path, capsys, no_ranks) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    import moe_ep_plugin.megatron as ep_megatron
    from moe_ep_plugin.recipes.megatron import pretrain

    with open(os.path.join(ROOT, "configs", "megatron_dsv3_cpu.yaml"), encoding="utf-8") as f:
        base = yaml.safe_load(f)
    base["train"]["save_dir"] = str(tmp_path / "run")

    def refuse(key: str, value: Any) -> int:
        section, name = key.split(".")
        raw = json.loads(json.dumps(base))
        raw.setdefault(section, {})[name] = value
        path = tmp_path / "walk.yaml"
        path.write_text(yaml.safe_dump(raw))
        return pretrain.main([str(path)])

    try:
        _walk(capsys, "moe-ep-pretrain", _megatron_keys(base), MEGATRON_BAD, refuse)
    finally:
        ep_megatron.uninstall()  # main() validates in this process, which installs the plugin


def test_the_megatron_command(tmp_path) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    with open(os.path.join(ROOT, "configs", "megatron_dsv3_cpu.yaml"), encoding="utf-8") as f:
        raw = yaml.safe_load(f)
    raw["train"].update(save_dir=str(tmp_path / "run"), warmup_steps=-1)
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(raw))
    _command(  # without Megatron-Core's import warnings on a host lacking Transformer Engine and Apex
        [
            sys.executable,
            "-W",
            "ignore::UserWarning",
            "-m",
            "moe_ep_plugin.recipes.megatron.pretrain",
            str(tmp_path / "bad.yaml"),
        ],
        "moe-ep-pretrain",
        "train.warmup_steps",
    )


# ---- the DeepSpeed example (recipes/deepspeed): configs/deepspeed_moe.yaml; the autoep keys on deepspeed_autoep.yaml
DEEPSPEED_BAD: dict[str, list[Any]] = {
    "dispatcher": ["tutel"],
    "model.vocab_size": [0],  # synthetic tokens: any vocabulary
    "model.hidden_size": [0],
    "model.ffn_hidden_size": [0],
    "model.num_layers": [0],
    "model.seq_len": [0],
    "moe.transport": ["ib", "nvlink"],
    "moe.fp8_dispatch": [],
    "moe.round_scale": [True],
    "moe.num_sms": [0, 3],
    "moe.timeout_s": [0],
    "moe.ranks_per_node": [0, 3],
    "moe.router": ["top1"],
    "moe.score_function": ["relu"],
    "moe.use_pre_softmax": [],
    "moe.num_groups": [0, 3],
    "moe.group_topk": [0],
    "moe.scaling_factor": [0, -2.5],
    "moe.expert_bias_rate": [-1e-3],
    "moe.expert_compute": ["fast"],
    "moe.num_experts": [0, 7],
    "moe.ep_size": [0, 4],
    "moe.k": [0, 9],
    "moe.capacity_factor": [0, -1.0],
    "moe.eval_capacity_factor": [0],
    "moe.min_capacity": [-1],
    "moe.drop_tokens": [],
    "moe.use_rts": [],
    "moe.noisy_gate_policy": ["Gaussian"],
    "moe.use_residual": [],
    "moe.top2_2nd_expert_sampling": [],
    "moe.aux_loss_coeff": [-0.01],
    "train.steps": [0],
    "train.micro_batch_size": [0],
    "train.lr": [0],
    "train.min_lr": [-1e-4, 1.0],
    "train.lr_warmup_steps": [-1],
    "train.seed": [],  # torch seeds any int
    "train.dtype": ["float16"],
    "train.log_interval": [0],
    "train.warmup_steps": [-1],
    "train.nprocs": [0, 3],
    "train.checkpoint_dir": [os.path.join(ROOT, "README.md", "run")],
    "deepspeed.zero_optimization": [{"stage": 3}, 2],
    "deepspeed.gradient_clipping": [-1.0],
    "deepspeed.steps_per_print": [0],
    "deepspeed.train_batch_size": [16],
    "deepspeed.bf16": [{"enabled": True}],
    "deepspeed.optimizer": [{"type": "Adam"}],
    "deepspeed.expert_parallel": [{"comm_backend": "deepep"}],
    "autoep.comm_backend": ["nccl"],
    "autoep.use_grouped_mm": [],
    "autoep.num_attention_heads": [0, 3],
}


def _deepspeed_example() -> Any:
    pytest.importorskip("deepspeed", reason="deepspeed is not installed")
    spec = importlib.util.spec_from_file_location(
        "deepspeed_moe_example", os.path.join(ROOT, "examples", "deepspeed_moe.py")
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def test_every_key_of_the_deepspeed_example(tmp_path, capsys, no_ranks) -> None:
    from moe_ep_plugin.recipes.deepspeed import config as ds_config

    example = _deepspeed_example()
    bases = {}
    for name in ("deepspeed_moe", "deepspeed_autoep"):
        with open(os.path.join(ROOT, "configs", f"{name}.yaml"), encoding="utf-8") as f:
            bases[name] = yaml.safe_load(f)
    keys: dict[str, Any] = {"dispatcher": str}
    for section, cls in (
        ("model", ds_config.ModelConfig),
        ("moe", ds_config.MoEConfig),
        ("autoep", ds_config.AutoEPConfig),
        ("train", ds_config.TrainConfig),
    ):
        keys.update(_typed_keys(section, cls))
    keys.update({f"deepspeed.{k}": None for k in bases["deepspeed_moe"]["deepspeed"]})
    keys.update({f"deepspeed.{k}": None for k in ("train_batch_size", "bf16", "optimizer", "expert_parallel")})

    def refuse(key: str, value: Any) -> int:
        raw = json.loads(json.dumps(bases["deepspeed_autoep" if key.startswith("autoep.") else "deepspeed_moe"]))
        *parents, name = key.split(".")
        node = raw
        for part in parents:
            node = node.setdefault(part, {})
        node[name] = value
        path = tmp_path / "walk.yaml"
        path.write_text(yaml.safe_dump(raw))
        return example.cli(["--config", str(path)])

    _walk(capsys, example.PROG, keys, DEEPSPEED_BAD, refuse)


def test_the_deepspeed_command() -> None:
    pytest.importorskip("deepspeed", reason="deepspeed is not installed")
    _command(
        [
            sys.executable,
            "examples/deepspeed_moe.py",
            "--config",
            "configs/deepspeed_moe.yaml",
            "moe.capacity_factor=-1",
        ],
        "deepspeed_moe.py",
        "moe.capacity_factor",
    )
