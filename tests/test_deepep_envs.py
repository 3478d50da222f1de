"""The gloo stand-ins for NCCL's collectives that DeepEP's own test files get when tests/gpu/test_deepep_own_tests.py
runs them (``tests/support/deepep_envs.py``): a stacked all-gather and an all-to-all of FP8 and 1-D rows, uneven
splits and a rank without rows, against the values each rank sent."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from support import deepep_envs

from moe_ep_plugin.launch import spawn


def _collectives(seed: int) -> None:
    deepep_envs.nccl_like_collectives()
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = [torch.randint(0, 9, (world,), generator=torch.Generator().manual_seed(seed + r)) for r in range(world)]
    rows[0][:] = 0  # rank 0 sends nothing
    sent = [
        torch.randn(int(rows[r].sum()), 3, 128, generator=torch.Generator().manual_seed(seed + 100 + r)).to(
            torch.float8_e4m3fn
        )
        for r in range(world)
    ]

    stacked = torch.empty(world, 5, 4, dtype=torch.int64)
    dist.all_gather_into_tensor(stacked, torch.full((5, 4), rank, dtype=torch.int64))
    assert torch.equal(stacked, torch.arange(world).view(world, 1, 1).expand(world, 5, 4))

    recv_rows = [int(rows[src][rank]) for src in range(world)]
    got = torch.empty(sum(recv_rows), 3, 128, dtype=torch.float8_e4m3fn)
    dist.all_to_all_single(got, sent[rank], recv_rows, rows[rank].tolist())
    want = [sent[src][int(rows[src][:rank].sum()) : int(rows[src][: rank + 1].sum())] for src in range(world)]
    assert torch.equal(got.view(torch.uint8), torch.cat(want).view(torch.uint8))

    counts = torch.empty(world, dtype=torch.int32)
    dist.all_to_all_single(counts, rows[rank].to(torch.int32))
    assert counts.tolist() == recv_rows
    strided = torch.empty(world, 2, dtype=torch.int32)[:, 0]  # a non-contiguous output is filled too
    dist.all_to_all_single(strided, rows[rank].to(torch.int32))
    assert strided.tolist() == recv_rows


@pytest.mark.parametrize("world", [2, 3])
def test_nccl_like_collectives_on_gloo(world: int) -> None:
    spawn(_collectives, world, args=(int(time.time()) % 1000,), backend="gloo")
