"""benchmarks/trainer_ab.py, run as a script: the loop and grouped expert GEMMs trained side by side through the
trainer's own loop.

On CPU torch's grouped matmul runs the same per-expert matmul as the loop (``moe_ep_plugin.experts``), so the two
variants' loss curves must be identical to the last bit, over every step and every repeat. The summary's figures
are recomputed here from the per-step CSV the script writes (warm-up steps left out).
"""

from __future__ import annotations

import csv
import json
import os
import statistics
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "trainer_ab.py")
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
# one rank, a few small steps, no eval; a made-up peak so the MFU column is computed on CPU too
FAST = [
    "parallel.nprocs=1",
    "parallel.device=cpu",
    "train.steps=4",
    "train.micro_batch_size=2",
    "train.eval_interval=0",
    "--set",
    "output.peak_tflops=0.001",
]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    return subprocess.run(
        [sys.executable, SCRIPT, TINY, *FAST, *args], capture_output=True, text=True, env=env, timeout=600
    )


def test_loop_and_grouped_train_identically_on_cpu(tmp_path) -> None:
    out = str(tmp_path / "ab")
    proc = _run("--warmup", "1", "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]

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

    # The summary from the steps: the first step of each leg left out (--warmup 1), medians over the rest.
    for variant, row in table.items():
        names = sorted({r["leg"] for r in rows if r["variant"] == variant})
        legs = [[r for r in rows if r["leg"] == leg] for leg in names]
        timed = [r for leg in legs for r in leg[1:]]
        assert row["tokens_per_s"] == statistics.median(float(r["tokens_per_s"]) for r in timed)
        assert row["ms_per_step"] == pytest.approx(1e3 * statistics.median(float(r["step_time_s"]) for r in timed))
        per_leg = [statistics.median(float(r["tokens_per_s"]) for r in leg[1:]) for leg in legs]
        assert row["leg_spread"] == pytest.approx((max(per_leg) - min(per_leg)) / statistics.median(per_leg))
    assert table["grouped"]["ratio"] == pytest.approx(table["grouped"]["tokens_per_s"] / table["loop"]["tokens_per_s"])

    with open(os.path.join(out, "train.log")) as f:
        log = f.read()
    assert "GFLOP per token per training step" in log  # the trainer's header, with its MFU FLOP count
    assert "variant" in log and "tokens/s" in log and "max|dloss|" in log and "vs loop" in log
    assert os.path.isfile(os.path.join(out, "loss_curves.png")) or "plot skipped" in log


@pytest.mark.parametrize(
    "extra",
    [["--warmup", "4"], ["--variants", "loop,loop"], ["--variants", "fast"], ["--repeats", "0"], ["moe.num_experts=7"]],
)
def test_bad_arguments_are_config_errors(extra: list[str], tmp_path) -> None:
    proc = _run("--out", str(tmp_path), *extra)
    assert proc.returncode == 2 and proc.stderr.startswith("trainer_ab: config error:"), proc.stderr[-2000:]
