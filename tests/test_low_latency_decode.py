"""The decode recipe on 2 CPU ranks: greedy decoding with the example model's MoE blocks on low-latency mode matches
the normal-mode forward of the same model on the same Buffer (each MoE block to the wire's rounding, the logits end
to end on the BF16 wire), and the check catches a low-latency block that is off by 10 %. ``examples/decode_moe.py``
runs it as a script."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from moe_ep_plugin.launch import LaunchError, spawn
from moe_ep_plugin.recipes.train import config
from moe_ep_plugin.recipes.train import decode as decode_moe


def _config(fp8_dispatch: bool) -> config.TrainerConfig:
    # Two MoE blocks of 8 experts over 2 ranks (3 blocks, the first dense).
    return config.load(None, ("model.num_layers=3", "parallel.nprocs=2", f"parallel.fp8_dispatch={fp8_dispatch}"))


@pytest.mark.parametrize("fp8_dispatch", [False, True])
def test_decode_matches_normal_forward(fp8_dispatch: bool, capfd) -> None:
    # 3 sequences per rank: 3 prompt tokens, 4 decoded; decode raises if a tolerance is exceeded.
    spawn(decode_moe.decode, 2, args=(_config(fp8_dispatch), 3, 3, 4, False), backend="gloo")
    lines = capfd.readouterr().out.splitlines()
    # rank 0 prints one table, every rank's row in rank order, then the verdict
    assert lines[0].split()[:2] == ["rank", "seqs"] and [line.split()[0] for line in lines[1:3]] == ["0", "1"]
    assert lines[3].startswith("PASS: 2 ranks, every MoE block within ") and len(lines) == 4, lines


def _decode_with_scaled_blocks(cfg: config.TrainerConfig) -> None:
    exact = decode_moe.low_latency_moe
    decode_moe.low_latency_moe = lambda *args: exact(*args) * 1.1
    decode_moe.decode(cfg, 3, 3, 4, False)


def test_decode_check_catches_a_wrong_block(capfd) -> None:
    with pytest.raises(LaunchError, match="MoE block differs from its normal-mode forward") as info:
        spawn(_decode_with_scaled_blocks, 2, args=(_config(True),), backend="gloo")
    assert [f.rank for f in info.value.failures] in ([0, 1], [1, 0])  # every rank raises
    verdict = capfd.readouterr().out.splitlines()[-1]
    assert verdict.startswith("FAIL: rank 0: a low-latency MoE block differs") and "; rank 1: " in verdict, verdict


def test_the_example_script_decodes() -> None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(root, "examples", "decode_moe.py"),
            "--set",
            "model.num_layers=2",
            "--prompt-len",
            "2",
            "--new-tokens",
            "2",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    header = ["rank", "seqs", "prompt", "new", "graph", "MoE", "block", "logits", "replay-eager"]
    rows = [line.split() for line in proc.stdout.splitlines()]  # rank 0: the header, a row per rank, the verdict
    assert len(rows) == 4 and rows[0] == header and rows[3][0] == "PASS:", proc.stdout
    assert [row[:5] for row in rows[1:3]] == [["0", "2", "2", "2", "False"], ["1", "2", "2", "2", "False"]]
