"""deepspeed.initialize with the plugin layer: ZeRO-1/2 training equals stock DeepSpeed MoE, checkpoints round-trip,
DeepSpeed's MoE parameter machinery applies, and the YAML config rejects impossible settings (CPU, gloo)."""

from __future__ import annotations

import dataclasses
import glob
import os

import pytest
import torch
import torch.distributed as dist

os.environ.setdefault("DS_ACCELERATOR", "cpu")
deepspeed = pytest.importorskip("deepspeed")

from moe_ep_plugin import launch  # noqa: E402
from moe_ep_plugin.recipes.deepspeed.config import load_config, parse_config  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = {
    "model": {"vocab_size": 64, "hidden_size": 32, "ffn_hidden_size": 48, "num_layers": 2, "seq_len": 16},
    "moe": {"num_experts": 4, "ep_size": 2, "k": 2},
    "train": {"steps": 6, "micro_batch_size": 4, "lr": 1e-2, "log_interval": 100},
}


def _worker_training(ckpt_dir: str) -> None:
    from deepspeed.moe.utils import is_moe_param
    from deepspeed.utils import groups
    from test_deepspeed_moe import ds_finish, ds_init

    from moe_ep_plugin.deepspeed import PluginMOELayer, convert_moe
    from moe_ep_plugin.recipes.deepspeed.train import build_engine, build_model, initialize, train_steps

    ds_init()
    for stage in (2, 1):
        cfg = parse_config({**SMALL, "deepspeed": {"zero_optimization": {"stage": stage}}}, dist.get_world_size())
        stock_cfg = dataclasses.replace(cfg, dispatcher="deepspeed", moe=cfg.moe.stock())
        stock_engine = build_engine(stock_cfg)
        stock = train_steps(stock_engine, stock_cfg, 0, 6).losses
        engine = build_engine(cfg)
        plugin = train_steps(engine, cfg, 0, 6).losses
        # same weights, data and gate noise: only fp32 summation order differs, compounded over the steps
        assert plugin == pytest.approx(stock, rel=2e-4, abs=0), f"ZeRO-{stage}: {plugin} vs {stock}"
        assert plugin[-1] < 0.8 * plugin[0], f"ZeRO-{stage}: loss did not fall: {plugin}"
        if stage == 2:  # a stock model converted before deepspeed.initialize trains exactly like the plugin's
            model = build_model(stock_cfg)
            assert convert_moe(model) == ["blocks.0.moe", "blocks.1.moe"]
            converted = initialize(model, cfg)
            assert train_steps(converted, cfg, 0, 6).losses == plugin
            ds_finish(converted)

    # DeepSpeed's MoE machinery sees the plugin layers as its own
    assert engine.has_moe_layers and engine.num_experts == [4, 4]
    layers = [m for m in engine.module.modules() if isinstance(m, PluginMOELayer)]
    assert len(layers) == 2 and all(m.ep_group is groups._get_expert_parallel_group("ep_size_2") for m in layers)
    for name, p in engine.module.named_parameters():
        assert is_moe_param(p) == (".experts." in name), name
    assert any(g.get("moe") for g in engine.optimizer.optimizer.param_groups)

    # checkpoint round trip (ZeRO-1 engine from above): save, go on 2 steps; a fresh engine with other
    # weights loads the checkpoint and must reproduce those 2 steps exactly
    engine.save_checkpoint(ckpt_dir, tag="t")
    torch.manual_seed(5)  # the top-2 gate samples its second expert from the global RNG
    after = train_steps(engine, cfg, 6, 2).losses
    other = build_engine(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=99)))
    other.load_checkpoint(ckpt_dir, tag="t")
    torch.manual_seed(5)
    resumed = train_steps(other, cfg, 6, 2).losses
    assert resumed == after, f"{resumed} != {after}"
    if dist.get_rank() == 0:  # DeepSpeed writes each global expert of each layer to its own file
        assert len(glob.glob(os.path.join(ckpt_dir, "t", "layer_*_expert_*_mp_rank_00_model_states.pt"))) == 8

    # a stock DeepSpeed checkpoint resumes in the plugin: the same next steps up to summation order
    stock_engine.save_checkpoint(ckpt_dir, tag="stock")
    dist.barrier()
    if dist.get_rank() == 0:  # the plugin's checkpoint is stock DeepSpeed's layout: the same files and keys
        files = {tag: sorted(os.listdir(os.path.join(ckpt_dir, tag))) for tag in ("t", "stock")}
        assert files["t"] == files["stock"]
        for name in (f for f in files["t"] if f.endswith("model_states.pt")):
            plugin_state, stock_state = (
                torch.load(os.path.join(ckpt_dir, tag, name), weights_only=False) for tag in ("t", "stock")
            )
            assert plugin_state.keys() == stock_state.keys(), name
            if "module" in stock_state:
                assert plugin_state["module"].keys() == stock_state["module"].keys(), name
    torch.manual_seed(5)
    stock_after = train_steps(stock_engine, stock_cfg, 6, 2).losses
    other.load_checkpoint(ckpt_dir, tag="stock")
    torch.manual_seed(5)
    assert train_steps(other, cfg, 6, 2).losses == pytest.approx(stock_after, rel=1e-5, abs=0)
    ds_finish(engine, stock_engine, other)


def test_zero1_zero2_training_matches_stock_and_checkpoints(tmp_path):
    launch.spawn(_worker_training, 2, (str(tmp_path),))


@pytest.mark.parametrize(
    "data, key",
    [
        ({"moe": {"capacity": 2}}, "moe.capacity: unknown key"),
        ({"optimizer": {}}, "optimizer: unknown section"),
        ({"moe": {"num_experts": 6, "ep_size": 4}}, "moe.num_experts"),
        ({"moe": {"ep_size": 4, "num_experts": 8}}, "moe.ep_size: 4 does not divide the 2 ranks"),
        ({"moe": {"k": 9}}, "moe.k"),
        ({"model": {"hidden_size": "wide"}}, "model.hidden_size: expected int"),
        ({"model": {"hidden_size": 96}, "moe": {"fp8_dispatch": True}}, "model.hidden_size"),
        ({"dispatcher": "deepspeed", "moe": {"fp8_dispatch": True}}, "moe.fp8_dispatch: a plugin option"),
        ({"dispatcher": "tutel"}, "dispatcher"),
        ({"moe": {"router": "group_limited", "num_groups": 3}}, "moe.num_groups"),
        ({"moe": {"num_groups": 2}}, "moe.num_groups: only used by router='group_limited'"),
        ({"moe": {"transport": "rdma"}}, "moe.transport"),
        ({"moe": {"expert_compute": "fast"}}, "moe.expert_compute: expected one of"),
        ({"dispatcher": "deepspeed", "moe": {"expert_compute": "grouped"}}, "moe.expert_compute: a plugin option"),
        ({"deepspeed": {"bf16": {"enabled": True}}}, "deepspeed.bf16: set by the example from train.dtype"),
        ({"deepspeed": {"zero_optimization": {"stage": 3}}}, "deepspeed.zero_optimization.stage"),
        ({"train": {"dtype": "float16"}}, "train.dtype"),
        ({"train": {"dtype": "float32"}, "moe": {"fp8_dispatch": True}}, "train.dtype: moe.fp8_dispatch"),
    ],
)
def test_config_rejects_impossible_settings(data, key):
    with pytest.raises(ValueError) as info:
        parse_config(data, world_size=2)
    assert str(info.value).startswith(key), str(info.value)


def test_shipped_configs_and_overrides():
    paths = sorted(glob.glob(os.path.join(REPO, "configs", "deepspeed_*.yaml")))
    assert len(paths) >= 2
    for path in paths:
        load_config(path, world_size=2)
    cfg = load_config(paths[0], ("moe.k=1", "train.lr=1e-4", "deepspeed.zero_optimization.stage=1"), world_size=4)
    assert (cfg.moe.k, cfg.train.lr, cfg.deepspeed["zero_optimization"]["stage"]) == (1, 1e-4, 1)
    with pytest.raises(ValueError, match="^moe.k: expected int"):
        load_config(paths[0], ("moe.k=two",))
    with pytest.raises(ValueError, match="^moe.ep_size: 2 does not divide the 3 ranks"):
        load_config(paths[0], world_size=3)


def _expert() -> torch.nn.Module:
    return torch.nn.Linear(8, 8)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(num_experts=6, ep_size=4), "num_experts"),
        (dict(num_experts=4, ep_size=0), "ep_size"),
        (dict(num_experts=4, k=5), "k"),
        (dict(num_experts=4, use_tutel=True), "use_tutel"),
        (dict(num_experts=4, enable_expert_tensor_parallelism=True), "enable_expert_tensor_parallelism"),
        (dict(num_experts=4, fp8_dispatch=True), "hidden_size"),
        (dict(num_experts=4, num_groups=2), "num_groups"),
        (dict(num_experts=4, router="group_limited", drop_tokens=True), "drop_tokens"),
        (dict(num_experts=4, k=2, router="group_limited", num_groups=2, group_topk=3), "group_topk"),
        (dict(num_experts=4, router="group_limited", expert_bias_rate=0.1), "expert_bias_rate"),
        (dict(num_experts=4, transport="rdma"), "transport"),
        (dict(num_experts=4, round_scale=True), "round_scale"),
        (dict(num_experts=4, noisy_gate_policy="Gaussian"), "noisy_gate_policy"),
    ],
)
def test_layer_rejects_impossible_settings(kwargs, name):
    from moe_ep_plugin.deepspeed import MoE

    with pytest.raises(ValueError) as info:
        MoE(8, _expert(), **kwargs)
    assert str(info.value).startswith(name), str(info.value)


def test_layer_needs_its_expert_group():
    from moe_ep_plugin.deepspeed import MoE

    with pytest.raises(ValueError, match="^ep_group: not set"):
        MoE(8, _expert(), num_experts=2)(torch.randn(3, 8))
    with pytest.raises(TypeError, match="^hidden_states: the plugin dispatches BF16 or FP32"):
        MoE(8, _expert(), num_experts=2)(torch.randn(3, 8, dtype=torch.float16))
    with pytest.raises(TypeError, match="^hidden_states: fp8_dispatch quantizes BF16 activations"):
        MoE(128, torch.nn.Linear(128, 128), num_experts=2, fp8_dispatch=True)(torch.randn(3, 128))
