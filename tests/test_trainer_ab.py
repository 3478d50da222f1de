"""benchmarks/trainer_ab.py: the loop and grouped expert GEMMs trained side by side through the trainer's own loop.

On CPU torch's grouped matmul runs the same per-expert matmul as the loop (``moe_ep_plugin.experts``), so the two
variants' loss curves must be identical to the last bit, over every step and every repeat.
"""
from __future__ import annotations

import csv
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import trainer_ab  # noqa: E402

TINY = os.path.join(ROOT, "configs", "tiny.yaml")
# one rank, a few small steps, no eval; a made-up peak so the MFU column is computed on CPU too
FAST = ["parallel.nprocs=1", "parallel.device=cpu", "train.steps=4", "train.micro_batch_size=2",
        "train.eval_interval=0", "--set", "output.peak_tflops=0.001"]


def test_loop_and_grouped_train_identically_on_cpu(tmp_path) -> None:
    out = str(tmp_path / "ab")
    assert trainer_ab.main([TINY, *FAST, "--warmup", "1", "--out", out]) == 0

    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    assert summary["legs"] == ["loop", "grouped", "loop", "grouped"]
    table = {row["variant"]: row for row in summary["variants"]}
    assert list(table) == ["loop", "grouped"]
    for row in table.values():
        assert row["legs"] == 2 and row["tokens_per_s"] > 0 and row["ms_per_step"] > 0 and row["mfu"] > 0
        assert row["max_abs_loss_diff"] == 0.0  # bit for bit, over the whole curve
        assert row["baseline"] == "loop"
    assert table["loop"]["ratio"] == 1.0
    assert table["grouped"]["final_loss"] == table["loop"]["final_loss"]

    with open(os.path.join(out, "steps.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    curves: dict[str, list[str]] = {}
    for r in rows:
        curves.setdefault(r["leg"], []).append(r["loss"])
    assert len(curves) == 4 and all(len(c) == 4 for c in curves.values())
    assert len({tuple(c) for c in curves.values()}) == 1  # the CSV keeps every digit: all four curves are equal

    with open(os.path.join(out, "train.log")) as f:
        log = f.read()
    assert "GFLOP per token per training step" in log  # the trainer's header, with its MFU FLOP count
    assert "variant" in log and "tokens/s" in log and "max|dloss|" in log and "vs loop" in log
    assert os.path.isfile(os.path.join(out, "loss_curves.png")) or "plot skipped" in log


def _rows(losses: list[float], tokens_per_s: list[float]) -> list[dict]:
    return [{"step": i + 1, "loss": loss, "tokens_per_s": tps, "step_time_s": 1000.0 / tps, "mfu": None}
            for i, (loss, tps) in enumerate(zip(losses, tokens_per_s))]


def test_summarize_leaves_out_warmup_and_compares_with_the_first_leg() -> None:
    legs = [("loop", _rows([3.0, 2.0, 1.0], [1.0, 100.0, 100.0])),
            ("grouped", _rows([3.0, 2.5, 1.5], [1.0, 200.0, 200.0])),
            ("loop", _rows([3.0, 2.0, 1.25], [1.0, 110.0, 110.0])),
            ("grouped", _rows([3.0, 2.5, 1.5], [1.0, 220.0, 220.0]))]
    table = {row["variant"]: row for row in trainer_ab.summarize(legs, warmup=1)}
    assert table["loop"]["tokens_per_s"] == 105.0 and table["grouped"]["tokens_per_s"] == 210.0
    assert table["grouped"]["ratio"] == 2.0 and table["loop"]["ratio"] == 1.0
    assert table["loop"]["max_abs_loss_diff"] == 0.25 and table["grouped"]["max_abs_loss_diff"] == 0.5
    assert table["loop"]["final_loss"] == 1.0 and table["loop"]["mfu"] is None
    assert table["loop"]["leg_spread"] == pytest.approx(10.0 / 105.0)
    assert len(trainer_ab.format_table(list(table.values()))) == 3


@pytest.mark.parametrize("extra", [["--warmup", "4"], ["--variants", "loop,loop"], ["--variants", "fast"],
                                   ["--repeats", "0"], ["moe.num_experts=7"]])
def test_bad_arguments_are_config_errors(extra: list[str], tmp_path, capsys) -> None:
    assert trainer_ab.main([TINY, *FAST, "--out", str(tmp_path), *extra]) == 2
    assert capsys.readouterr().err.startswith("trainer_ab: config error:")
