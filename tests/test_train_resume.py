"""Resume-after-checkpoint reproduces the uninterrupted run, through the real command line (2 spawned ranks).

Run A trains 6 steps straight. Run B stops after step 3 (``--until 3``, which checkpoints there), then a second
invocation resumes from that checkpoint and finishes. Every logged metric of all 6 steps, the expert-load totals
and each rank's final weights and optimizer state must be identical (CPU arithmetic is deterministic). A
checkpoint of a different model is refused.
"""

import csv
import importlib.util
import os

import torch

from moe_ep_plugin.recipes.train import cli

CONFIG = """
model: {hidden_size: 64, num_layers: 3, num_dense_layers: 1, num_heads: 2, ffn_hidden_size: 96, seq_len: 32}
moe: {num_experts: 4, expert_ffn_hidden_size: 32, topk: 2, num_groups: 2, group_topk: 1, bias_update_rate: 0.01}
parallel: {nprocs: 2, device: cpu}
train: {steps: 6, micro_batch_size: 2, warmup_steps: 2, eval_interval: 2, eval_batches: 1}
output: {log_interval: 1, checkpoint_interval: 0, keep_checkpoints: 1, progress_bar: false}
"""


def _rows(run: str) -> list[dict]:
    with open(os.path.join(run, "metrics.csv"), newline="") as f:
        return [
            {k: v for k, v in r.items() if k not in ("tokens_per_s", "step_time_s", "elapsed_s")}
            for r in csv.DictReader(f)
        ]


def _final(run: str, rank: int) -> dict:
    return torch.load(os.path.join(run, "checkpoints", "step_0000006", f"rank_{rank:05d}.pt"), weights_only=False)


def _assert_same(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    else:
        assert a == b, where


def test_resume_continues_the_same_trajectory(tmp_path, capsys):
    config = tmp_path / "small.yaml"
    config.write_text(CONFIG)
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    assert cli.main([str(config), "--set", f"output.dir={straight}"]) == 0
    assert cli.main([str(config), "--set", f"output.dir={split}", "--until", "3"]) == 0
    assert [r["step"] for r in _rows(split)] == ["1", "2", "3"]
    assert os.path.isfile(os.path.join(split, "checkpoints", "step_0000003", "COMPLETE"))
    assert cli.main([str(config), "--set", f"output.dir={split}"]) == 0

    assert "resumed from" in open(os.path.join(split, "train.log")).read()
    assert _rows(split) == _rows(straight)
    assert [r["eval_loss"] != "" for r in _rows(straight)] == [False, True, False, True, False, True]
    assert open(os.path.join(split, "expert_load.csv")).read() == open(os.path.join(straight, "expert_load.csv")).read()
    # keep_checkpoints: 1 pruned step 3 once step 6 was complete.
    assert sorted(os.listdir(os.path.join(split, "checkpoints"))) == ["step_0000006"]
    for rank in range(2):
        a, b = _final(straight, rank), _final(split, rank)
        _assert_same(a["model"], b["model"], f"rank {rank} model")
        _assert_same(a["optimizer"], b["optimizer"], f"rank {rank} optimizer")
    assert float(_rows(straight)[-1]["loss"]) < float(_rows(straight)[0]["loss"])
    if importlib.util.find_spec("matplotlib"):  # the [plots] extra
        assert all(os.path.getsize(os.path.join(straight, f)) > 10_000 for f in ("loss.png", "expert_load.png"))
    # A checkpoint of another model or EP size is refused before any rank starts, naming the key that differs.
    assert cli.main([str(config), "--set", f"output.dir={split}", "--set", "moe.expert_ffn_hidden_size=48"]) == 2
    assert capsys.readouterr().err.startswith("moe-ep-train: config error: moe: differs from the checkpoint")
    assert cli.main([str(config), "--set", f"output.dir={split}", "--set", "parallel.nprocs=1"]) == 2
    assert capsys.readouterr().err.startswith("moe-ep-train: config error: parallel.nprocs: the checkpoint")
