"""The DeepSpeed example's ``dispatcher: autoep`` (configs/deepspeed_autoep.yaml): ``--compare`` through the example's
entry point on 2 gloo ranks trains a tiny Mixtral with AutoEP's ``comm`` backend, then with ``comm_backend:
deepep`` served by this library, and the per-step losses agree within 3e-3 (measured: at most 9e-4 over 4 BF16
ZeRO-1 steps at losses near 5.2, seeds 1-3; the two backends sum a token's expert outputs in different orders, in
BF16). The YAML's refusals come at config time, naming the key, before any rank starts."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("deepspeed", reason="deepspeed is not installed")

from moe_ep_plugin.recipes.deepspeed import config as ds_config  # noqa: E402
from moe_ep_plugin.recipes.deepspeed.autoep import LOSS_TOLERANCE  # noqa: E402
from moe_ep_plugin.recipes.deepspeed.config import load_config, parse_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "deepspeed_moe.py")
CONFIG = os.path.join(ROOT, "configs", "deepspeed_autoep.yaml")
STEPS = 4


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [sys.executable, EXAMPLE, "--config", CONFIG, *args], capture_output=True, text=True, timeout=600, env=env
    )


def test_autoep_deepep_on_this_library_trains_like_comm() -> None:
    pytest.importorskip(
        "transformers", reason="transformers is not installed (AutoEP replaces Hugging Face MoE blocks)"
    )
    proc = _run("--compare", f"train.steps={STEPS}", "train.log_interval=1", "train.warmup_steps=1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = [float(m) for m in re.findall(r"^step \d+/\d+ \| loss (\S+)", proc.stdout, re.M)]
    assert len(losses) == 2 * STEPS, proc.stdout[-3000:]
    comm, deepep = losses[:STEPS], losses[STEPS:]
    diff = max(abs(a - b) for a, b in zip(comm, deepep, strict=True))
    assert diff <= LOSS_TOLERANCE, (comm, deepep)
    verdict = re.search(
        r"^PASS: autoep deepep \(this library\) vs comm: largest per-step loss difference (\S+) over "
        rf"{STEPS} steps, tolerance 0.003 \(different BF16 summation orders\)$",
        proc.stdout,
        re.M,
    )
    assert verdict is not None, proc.stdout[-2000:]
    assert abs(float(verdict[1]) - diff) <= 1e-4, (verdict[0], diff)  # the printed losses are rounded to 1e-4
    assert deepep[-1] < deepep[0]  # it trains
    rows = dict(re.findall(r"^(autoep comm|autoep deepep) +(\S+)", proc.stdout, re.M))
    assert rows == {"autoep comm": "all_to_all", "autoep deepep": "deep_ep=moe_ep_plugin"}, proc.stdout[-2000:]


AUTOEP = {"dispatcher": "autoep", "moe": {"aux_loss_coeff": 0.0}, "train": {"dtype": "bfloat16"}}


def _with(**sections: dict) -> dict:
    data = {key: dict(value) if isinstance(value, dict) else value for key, value in AUTOEP.items()}
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values} if isinstance(values, dict) else values
    return data


@pytest.mark.parametrize(
    "data, key",
    [
        (_with(autoep={"comm_backend": "nccl"}), "autoep.comm_backend: expected one of"),
        (_with(autoep={"num_attention_heads": 3}), "autoep.num_attention_heads: 3 does not divide"),
        (_with(autoep={"comm_max_tokens_per_rank": 8}), "autoep.comm_max_tokens_per_rank: unknown key"),
        (_with(moe={"fp8_dispatch": True}), "moe.fp8_dispatch: a plugin option"),
        (_with(moe={"transport": "torch"}), "moe.transport: a plugin option"),
        (_with(moe={"drop_tokens": True}), "moe.drop_tokens: AutoEP's Mixtral blocks have no token dropping"),
        (_with(moe={"capacity_factor": 2.0}), "moe.capacity_factor: AutoEP's Mixtral blocks have no capacity"),
        (_with(moe={"aux_loss_coeff": 0.01}), "moe.aux_loss_coeff: AutoEP's Mixtral blocks add no auxiliary loss"),
        (_with(train={"dtype": "float32"}), "train.dtype: autoep.comm_backend 'deepep' dispatches bfloat16 only"),
        (_with(deepspeed={"expert_parallel": {"enabled": True}}), "deepspeed.expert_parallel: set by the example"),
        ({"dispatcher": "plugin", "autoep": {"comm_backend": "comm"}}, "autoep: this section is read with dispatcher"),
        (_with(dispatcher="autoep", moe={"num_experts": 6, "ep_size": 4}), "moe.num_experts"),
    ],
)
def test_autoep_config_refusals(data: dict, key: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_config(data, world_size=2)
    assert str(info.value).startswith(key), str(info.value)


def test_autoep_comm_baseline_takes_float32() -> None:
    cfg = parse_config(_with(autoep={"comm_backend": "comm"}, train={"dtype": "float32"}), world_size=2)
    assert (cfg.autoep.comm_backend, cfg.train.dtype) == ("comm", "float32")
    # --compare also runs deepep, which needs bfloat16: refused for the whole comparison
    with pytest.raises(ValueError, match="^train.dtype: autoep.comm_backend 'deepep'"):
        ds_config.compare_configs(cfg, 2)


def test_autoep_deepep_refuses_to_shadow_a_real_deep_ep(monkeypatch) -> None:
    monkeypatch.setattr(ds_config, "real_deep_ep_origin", lambda: "/site-packages/deep_ep/__init__.py")
    with pytest.raises(ValueError, match=r"^autoep.comm_backend: 'deepep' is served by moe_ep_plugin .*/deep_ep/"):
        parse_config(AUTOEP, world_size=2)
    parse_config(_with(autoep={"comm_backend": "comm"}), world_size=2)  # the baseline needs no deep_ep


def test_autoep_needs_transformers(monkeypatch) -> None:
    find_spec = ds_config.importlib.util.find_spec
    monkeypatch.setattr(
        ds_config.importlib.util,
        "find_spec",
        lambda name, *args: None if name == "transformers" else find_spec(name, *args),
    )
    with pytest.raises(ValueError, match="^dispatcher: 'autoep' needs transformers"):
        parse_config(AUTOEP, world_size=2)


def test_shipped_autoep_config_and_cli_refusal() -> None:
    cfg = load_config(CONFIG, world_size=2)
    assert (cfg.dispatcher, cfg.autoep.comm_backend, cfg.moe.ep_size) == ("autoep", "deepep", 2)
    proc = _run("autoep.comm_backend=nccl")  # before any rank starts: exit code 2, one line naming the key
    assert proc.returncode == 2 and "autoep.comm_backend: expected one of" in proc.stderr, proc.stderr[-2000:]
    proc = _run("--compare", "autoep.comm_backend=comm", "train.dtype=float32")
    assert proc.returncode == 2 and "train.dtype: autoep.comm_backend 'deepep'" in proc.stderr, proc.stderr[-2000:]
