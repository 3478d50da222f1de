"""The trainer's YAML schema: shipped configs load, every key is documented, bad values name their key;
plus the data windows and the command line's no-spawn paths."""

import os
import re

import numpy as np
import pytest
import torch

from moe_ep_plugin.recipes.common.data import TokenWindows, load_tokens, shipped_corpus_path
from moe_ep_plugin.recipes.train import cli, config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")


def test_tiny_yaml_is_the_builtin_default_and_lists_every_key():
    path = os.path.join(CONFIGS, "tiny.yaml")
    assert config.load(path) == config.load(None)
    text = open(path).read()
    for key, *_ in config.schema():
        section, name = key.split(".")
        assert re.search(rf"^{section}:\n(  .*\n|\n)*?  {name}:", text, re.M), f"{key} missing from tiny.yaml"


def test_every_key_is_documented_in_docs():
    docs = open(os.path.join(ROOT, "docs", "training.md")).read()
    missing = [key for key, *_ in config.schema() if f"`{key}`" not in docs]
    assert not missing, f"keys without a row in docs/training.md: {missing}"


def test_deepseek_v3_proxy_has_the_deepseek_moe_dimensions_and_builds_on_meta():
    cfg = config.load(os.path.join(CONFIGS, "deepseek_v3_proxy.yaml"))
    m, e = cfg.model, cfg.moe
    assert (m.hidden_size, e.num_experts, e.topk, e.num_groups, e.group_topk) == (7168, 256, 8, 8, 4)
    assert (e.score_function, e.scaling_factor, e.num_shared_experts, e.expert_ffn_hidden_size) == (
        "sigmoid",
        2.5,
        1,
        2048,
    )
    assert 1 <= m.num_dense_layers < m.num_layers <= 8 and m.ffn_hidden_size == 18432 and cfg.parallel.fp8_dispatch
    report = cli.dry_run(cfg)
    # Per rank of EP=8: 32 experts x 3 MoE blocks x (7168 x 2 x 2048 + 2048 x 7168) weights.
    assert f"{32 * 3 * 3 * 7168 * 2048 / 1e6:,.1f}M own experts" in report, report


def test_ep2_h200_config_loads():
    cfg = config.load(os.path.join(CONFIGS, "ep2_h200.yaml"))
    assert cfg.parallel.nprocs == 2 and cfg.parallel.fp8_dispatch and cfg.model.hidden_size % 128 == 0


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["parallel.nprocs=4", "moe.num_experts=6", "moe.num_groups=1", "moe.group_topk=1"], "moe.num_experts"),
        (["moe.topk=5"], "moe.topk"),  # 2 of 4 groups x 2 experts = 4 reachable
        (["parallel.fp8_dispatch=true", "model.hidden_size=192"], "parallel.fp8_dispatch"),
        (["model.hiden_size=64"], "model.hiden_size"),  # unknown key
        (["optim.lr=1"], "optim"),  # unknown section
        (["train.steps=ten"], "train.steps"),
        (["train.steps=true"], "train.steps"),  # a bool is not an int
        (["train.lr=0"], "train.lr"),
        (["moe.num_groups=3"], "moe.num_groups"),
        (["moe.group_topk=5", "moe.topk=8"], "moe.group_topk"),
        (["moe.group_topk=2", "moe.topk=1"], "moe.group_topk"),
        (["model.num_dense_layers=5"], "model.num_dense_layers"),
        (["model.num_heads=3"], "model.num_heads"),
        (["moe.score_function=softmax"], "moe.expert_bias"),  # the bias needs sigmoid
        (["moe.score_function=relu"], "moe.score_function"),
        (["model.dtype=fp16"], "model.dtype"),
        (["parallel.transport=rdma"], "parallel.transport"),
        (["parallel.device=cpu", "parallel.backend=nccl"], "parallel.backend"),
        (["data.path=/no/such/file.txt"], "data.path"),
        (["data.eval_fraction=0.7"], "data.eval_fraction"),
        (["output.resume=/no/such/checkpoint"], "output.resume"),
        (["parallel.transport=torch", "parallel.ranks_per_node=1"], "parallel.ranks_per_node"),  # no nodes to split
        (["parallel.transport=nvlink", "parallel.ranks_per_node=2"], "parallel.ranks_per_node"),
        ([f"output.dir={__file__}/run"], "output.dir"),  # under a regular file: nobody can make it
    ],
)
def test_impossible_values_are_errors_naming_the_key(overrides, key):
    with pytest.raises(ValueError, match=rf"^{re.escape(key)}:"):
        config.load(None, tuple(overrides))


def test_runtime_world_size_is_checked_against_the_experts():
    cfg = config.load(None)
    config.validate(cfg, world_size=4)
    with pytest.raises(ValueError, match=r"^moe.num_experts: .*WORLD_SIZE=3"):
        config.validate(cfg, world_size=3)


def test_yaml_values_coerce_and_override_syntax(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: 1e-3\n  steps: 7\nmoe:\n  scaling_factor: 2\n")
    cfg = config.load(str(path), ("train.steps=9",))
    assert (cfg.train.lr, cfg.train.steps, cfg.moe.scaling_factor) == (1e-3, 9, 2.0)
    with pytest.raises(ValueError, match="expected section.key=value"):
        config.load(str(path), ("steps=9",))
    path.write_text("- just\n- a list\n")
    with pytest.raises(ValueError, match="^config:"):
        config.load(str(path))


def test_cli_reports_config_errors_without_launching(capsys):
    code = cli.main(["--set", "parallel.nprocs=3"])
    assert code == 2
    assert "moe.num_experts: 8 experts cannot be split evenly over 3 EP ranks" in capsys.readouterr().err


def test_windows_split_the_global_batch_across_ranks_independently_of_ep(tmp_path):
    np.save(tmp_path / "ids.npy", np.arange(5000))  # token i sits at position i
    windows = TokenWindows(
        load_tokens(str(tmp_path / "ids.npy"), vocab_size=5000), seq_len=16, eval_fraction=0.1, seed=3
    )
    cpu = torch.device("cpu")
    whole_x, whole_y = windows.batch(5, 6, 0, 1, cpu)
    assert torch.equal(torch.cat([windows.batch(5, 2, r, 3, cpu)[0] for r in range(3)]), whole_x)
    assert torch.equal(whole_x + 1, whole_y)  # targets are the next tokens
    assert int(whole_x[:, 0].max()) + 17 <= 4500  # training windows stay out of the eval tail
    eval_x, _ = windows.batch(0, 2, 0, 1, cpu, split="eval")
    assert int(eval_x.min()) >= 4500
    assert torch.equal(eval_x, windows.batch(0, 2, 0, 1, cpu, split="eval")[0])  # fixed eval batches
    assert not torch.equal(whole_x, windows.batch(6, 6, 0, 1, cpu)[0])  # fresh data every step
    with pytest.raises(ValueError, match="^data.path: token ids must lie in"):
        load_tokens(str(tmp_path / "ids.npy"), vocab_size=4999)


def test_shipped_corpus_is_byte_level_text():
    ids = load_tokens(None, vocab_size=256)
    assert 50_000 < len(ids) < 400_000 and ids.max() < 128
    assert open(shipped_corpus_path(), encoding="utf-8").read().encode() == bytes(ids.astype(np.uint8))


def test_cli_list_keys_and_plot_from_csv(tmp_path, capsys):
    assert cli.main(["--list-keys"]) == 0
    listed = capsys.readouterr().out
    assert all(f"{key} (" in listed for key, *_ in config.schema())
    (tmp_path / "metrics.csv").write_text(
        "step,loss,lm_loss,aux_loss,eval_loss,lr,grad_norm,tokens_per_s,step_time_s,load_max_over_mean,"
        "load_max_over_mean_worst_layer,elapsed_s\n"
        "1,5.5,5.4,0.1,,0.001,1.0,1000,0.1,2.0,3.0,0.1\n2,4.0,3.9,0.1,4.2,0.001,1.0,1100,0.1,1.5,2.0,0.2\n"
    )
    (tmp_path / "expert_load.csv").write_text("block,expert,tokens\n1,0,10\n1,1,30\n2,0,20\n2,1,20\n")
    code = cli.main(["--plot", str(tmp_path)])
    try:
        import matplotlib  # noqa: F401  (the [plots] extra)
    except ImportError:
        assert code == 1 and "matplotlib is not installed" in capsys.readouterr().out
        return
    assert code == 0
    for name in ("loss.png", "expert_load.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
