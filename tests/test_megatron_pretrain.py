"""``moe-ep-pretrain`` on CPU: 2 gloo ranks (EP2) train the smoke config with the GPU config's features (BF16
parameters, FP8 dispatch, ep_plugin dispatcher); the loss falls, checkpoints are written, and a second run
resumes from the last one instead of starting over."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
import yaml

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from support.megatron_host import flex_backends_on_host  # noqa: E402

from moe_ep_plugin.recipes.common import checkpoint  # noqa: E402


def _megatron_version() -> str:
    import megatron.core

    return megatron.core.__version__


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _restore_megatron():
    yield
    import moe_ep_plugin.megatron as ep_megatron

    ep_megatron.uninstall()  # main() validates the YAML in this process, which installs the plugin


def _losses(path: str) -> list[tuple[int, float]]:
    with open(path, encoding="utf-8") as f:
        return [(r["step"], r["loss"]) for r in map(json.loads, f)]


def test_pretrain_trains_checkpoints_and_resumes(tmp_path, capfd) -> None:
    from moe_ep_plugin.recipes.megatron import pretrain

    with open(os.path.join(ROOT, "configs", "megatron_dsv3_cpu.yaml"), encoding="utf-8") as f:
        raw = yaml.safe_load(f)
    raw["model"].update(dtype="bf16", num_layers=2, moe_layer_freq=[0, 1])
    raw["ep_plugin"]["fp8_dispatch"] = True
    raw["gpt"]["max_sequence_length"] = 32
    raw["train"].update(
        seq_length=32, steps=8, warmup_steps=1, save_interval=4, log_interval=2, save_dir=str(tmp_path / "run")
    )
    config = tmp_path / "smoke.yaml"
    config.write_text(yaml.safe_dump(raw))

    assert pretrain.main([str(config)]) == 0
    # rank 0's progress: the first step, every log_interval-th and the last, each with its time per step and ETA
    lines = [ln for ln in capfd.readouterr().out.splitlines() if ln.startswith("step ")]
    assert [int(ln.split()[1].split("/")[0]) for ln in lines] == [1, 2, 4, 6, 8], lines
    for ln in lines:
        assert re.fullmatch(
            r"step \d/8 \| loss \d+\.\d{4} \| lr \S+ \| grad norm \S+ \| [\d,]+ tok/s \| "
            r"[\d,]+ ms/step \| ETA \d+:\d\d:\d\d",
            ln,
        ), ln
    run = tmp_path / "run"
    assert [os.path.basename(d) for d in checkpoint.complete_checkpoints(str(run))] == ["step_0000004", "step_0000008"]
    for step in (4, 8):
        assert sorted(os.listdir(run / f"step_{step:07d}")) == [
            "COMPLETE",
            "meta.json",
            "rank_00000.pt",
            "rank_00001.pt",
        ]
    losses = _losses(str(run / "metrics.jsonl"))
    assert [s for s, _ in losses] == list(range(1, 9))
    assert losses[-1][1] < losses[0][1] - 0.5, losses

    assert pretrain.main([str(config), "--steps", "10"]) == 0
    resumed = _losses(str(run / "metrics.jsonl"))[len(losses) :]
    assert [s for s, _ in resumed] == [9, 10]  # continued from the step-8 checkpoint
    assert os.path.basename(checkpoint.newest(str(run))) == "step_0000010"


def test_pretrain_reports_a_row_budget_overflow(tmp_path, capfd) -> None:
    """Dropless ``ep_plugin`` with a row budget (``ep_plugin.recv_capacity_factor``) too small for the routing: the
    launcher's check after the first step ends the run on every rank naming the key; with
    ``ep_plugin.drop_on_overflow`` the same run trains, dropping the pairs past the budget."""
    from moe_ep_plugin.recipes.megatron import pretrain

    with open(os.path.join(ROOT, "configs", "megatron_dsv3_cpu.yaml"), encoding="utf-8") as f:
        raw = yaml.safe_load(f)
    raw["model"].update(num_layers=2, moe_layer_freq=[0, 1])
    raw["ep_plugin"]["recv_capacity_factor"] = 0.25
    raw["gpt"]["max_sequence_length"] = 32
    raw["train"].update(seq_length=32, steps=2, warmup_steps=1, save_interval=100, save_dir=str(tmp_path / "run"))
    config = tmp_path / "budget.yaml"
    config.write_text(yaml.safe_dump(raw))
    assert pretrain.main([str(config)]) == 1
    err = capfd.readouterr().err
    assert "ep_plugin.recv_capacity_factor" in err and "drop_on_overflow" in err, err
    raw["ep_plugin"]["drop_on_overflow"] = True
    raw["train"]["save_dir"] = str(tmp_path / "dropped")
    config.write_text(yaml.safe_dump(raw))
    assert pretrain.main([str(config)]) == 0
    assert [s for s, _ in _losses(str(tmp_path / "dropped" / "metrics.jsonl"))] == [1, 2]


def test_pretrain_rejects_bad_config(tmp_path, capsys) -> None:
    from moe_ep_plugin.recipes.megatron import pretrain

    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump({"model": {"num_layers": 1}, "trainer": {}}))
    assert pretrain.main([str(config)]) == 2
    assert capsys.readouterr().err.startswith("moe-ep-pretrain: config error: trainer: unknown section")


def test_pretrain_with_expert_tensor_parallelism_keeps_replicas_equal(tmp_path) -> None:
    # Expert TP 2 (EP 1, TP 1, 2 ranks): each rank holds half of every expert, the dense weights are replicated. With
    # the gradient clipped every step, a grad norm that differed between the ranks would clip them differently and
    # the replicated weights would part; they must stay bit for bit equal.
    from moe_ep_plugin.recipes.megatron import pretrain

    with open(os.path.join(ROOT, "configs", "megatron_dsv3_cpu.yaml"), encoding="utf-8") as f:
        raw = yaml.safe_load(f)
    raw["parallel"].update(expert_model_parallel_size=1, expert_tensor_parallel_size=2)
    raw["model"].update(num_layers=2, moe_layer_freq=[0, 1])
    raw["gpt"]["max_sequence_length"] = 32
    raw["train"].update(
        seq_length=32,
        steps=4,
        warmup_steps=1,
        save_interval=4,
        log_interval=2,
        clip_grad=1.0e-3,
        save_dir=str(tmp_path / "run"),
    )
    config = tmp_path / "etp2.yaml"
    config.write_text(yaml.safe_dump(raw))

    assert pretrain.main([str(config), "--nprocs", "2"]) == 0
    step = tmp_path / "run" / "step_0000004"
    states = [torch.load(step / f"rank_0000{r}.pt", map_location="cpu", weights_only=False) for r in (0, 1)]
    dense = [{k: v for k, v in _model_state(s).items() if "experts" not in k} for s in states]
    experts = [{k: v for k, v in _model_state(s).items() if "experts" in k} for s in states]
    assert dense[0].keys() == dense[1].keys() and dense[0]
    assert all(torch.equal(dense[0][k], dense[1][k]) for k in dense[0])
    assert experts[0] and any(not torch.equal(experts[0][k], experts[1][k]) for k in experts[0])  # halves differ
    assert all(clip < 1.0 for clip in _clip_factors(str(tmp_path / "run" / "metrics.jsonl")))


def _model_state(state: dict) -> dict:
    return {k: v for k, v in state["model"].items() if isinstance(v, torch.Tensor)}


def _clip_factors(path: str) -> list[float]:
    with open(path, encoding="utf-8") as f:
        return [1.0e-3 / r["grad_norm"] for r in map(json.loads, f)]


@pytest.mark.parametrize("backend", ["deepep", "hybridep", "ncclep", "deepepv2"])
def test_pretrain_runs_megatron_flex_backends_on_this_library(tmp_path, backend: str) -> None:
    from moe_ep_plugin.megatron.registration import SERVED_FLEX_BACKENDS

    if backend not in SERVED_FLEX_BACKENDS:  # ncclep: megatron-core >= 0.19; deepepv2: Megatron-LM dev
        pytest.skip(f"megatron-core {_megatron_version()} has no {backend} flex backend")
    if backend not in flex_backends_on_host((backend,)):
        pytest.skip(f"megatron-core {_megatron_version()}'s {backend} manager allocates on CUDA when built")
    # Megatron's own flex dispatcher, its backend served by this library after install() (which the launcher runs
    # from the YAML): a few steps train on 2 gloo ranks.
    from moe_ep_plugin.recipes.megatron import pretrain

    with open(os.path.join(ROOT, "configs", "megatron_dsv3_cpu.yaml"), encoding="utf-8") as f:
        raw = yaml.safe_load(f)
    raw["model"].update(
        num_layers=2, moe_layer_freq=[0, 1], moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend=backend
    )
    if backend == "ncclep":  # sizes each rank's receive buffer: every routed row fits (no overflow)
        raw["model"]["moe_expert_rank_capacity_factor"] = 2.0
    raw["gpt"]["max_sequence_length"] = 32
    raw["train"].update(
        seq_length=32, steps=4, warmup_steps=1, save_interval=0, log_interval=2, save_dir=str(tmp_path / "run")
    )
    config = tmp_path / f"{backend}.yaml"
    config.write_text(yaml.safe_dump(raw))

    assert pretrain.main([str(config)]) == 0
    losses = _losses(str(tmp_path / "run" / "metrics.jsonl"))
    assert [s for s, _ in losses] == [1, 2, 3, 4] and losses[-1][1] < losses[0][1], losses
