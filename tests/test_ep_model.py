"""``benchmarks/ep_model.py --traffic``: the memory traffic per remote byte of a staged and a direct dispatch, counted
from the sweep's routing, against a plain loop over tokens."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "benchmarks"))

import ep_model  # noqa: E402
import sm_sweep  # noqa: E402


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_traffic_counts_every_row_once(ep: int) -> None:
    tokens, seed = 64, 3
    local = remote = sent = 0
    for rank in range(ep):
        idx = sm_sweep.route(tokens, ep, seed * 1000 + rank)
        for t in range(tokens):
            ranks = {int(e) // (256 // ep) for e in idx[t].tolist() if e >= 0}
            local += rank in ranks
            remote += len(ranks - {rank})
            sent += bool(ranks)
    got = ep_model.traffic(ep, tokens, seed)
    assert got["direct"] == (sent + remote + local) / (2 * remote)
    assert got["staged"] == (sent + 3 * remote + local) / (2 * remote)
