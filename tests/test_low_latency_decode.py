"""examples/decode_moe.py on 2 CPU ranks: greedy decoding with the example model's MoE blocks on low-latency mode
matches the normal-mode forward of the same model on the same Buffer (to the BF16 rounding of the LL wire)."""
from __future__ import annotations

import os
import sys

import pytest

from moe_ep_plugin.launch import spawn
from moe_ep_plugin.train import config

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import decode_moe  # noqa: E402  (the example script, importable from examples/)


@pytest.mark.parametrize("fp8_dispatch", [False, True])
def test_decode_matches_normal_forward(fp8_dispatch: bool) -> None:
    # Two MoE blocks of 8 experts over 2 ranks, 3 sequences per rank: 3 prompt tokens, 4 decoded. With the FP8
    # dispatch wire both paths quantize (the decode once sent BF16 against an FP8 normal forward: 3.1e-3 apart).
    cfg = config.load(None, ("model.num_layers=3", "parallel.nprocs=2", f"parallel.fp8_dispatch={fp8_dispatch}"))
    spawn(decode_moe.decode, 2, args=(cfg, 3, 3, 4, False), backend="gloo")
