"""Drop-in matrix on the ``nvlink`` kernels (issue 13): every entry point × the five stream modes × the input forms
{BF16, FP32, FP8 tuple, FP8 in the send path, with FP8 out} × {with, without top-k} at EP 1–4, each checked
exactly against a plain loop over tokens (``tests/support/rounds.py``: rows and FP8 bytes bit for bit, metadata and
per-expert lists exactly, combine on exact grid values). Also the async per-expert list at DeepEP's shape
(4096 x 7168, top-8 of 256, EP 2), ranks that disagree (notify's metadata words) and dispatch without top-k's
counts from notify. Ranks share one GPU over a gloo group (``Buffer(device="cuda:0")``), as tests/gpu/test_nvlink.py
does with one GPU. Skips without a GPU or without the built kernel library.
"""

from __future__ import annotations

import itertools
import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from support import rounds  # noqa: E402
from support.gpu_marks import NEEDS_KERNELS  # noqa: E402
from support.reference import routing  # noqa: E402
from support.settle import settle  # noqa: E402

from moe_ep_plugin import Buffer  # noqa: E402
from moe_ep_plugin.launch import spawn  # noqa: E402

pytestmark = NEEDS_KERNELS


def _buffer() -> Buffer:
    return Buffer(dist.group.WORLD, transport="nvlink", timeout_s=60, device="cuda:0")


def _matrix(seed: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    buffer = _buffer()
    state = rounds.State()
    failures = []
    # MOE_EP_MATRIX_TRACE=1: each rank names every round before running it, so a fault's log says which call it was
    trace = os.environ.get("MOE_EP_MATRIX_TRACE", "0") not in ("", "0")
    # entries in order per (mode, form): the cached ones reuse the handle of the fresh one just before
    for i, (mode, form, entry) in enumerate(itertools.product(rounds.MODES, rounds.FORMS, rounds.ENTRIES)):
        rnd = rounds.draw(seed + i, world, entry=entry, mode=mode, form=form)
        if trace:
            print(f"[rank {rank}] round {i}: {rnd.describe()}", flush=True)
        errors = rounds.run(buffer, rnd, state, rank, world)
        if errors:
            failures.append(f"{rnd.describe()}: {errors}")
    torch.cuda.synchronize()
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_dropin_matrix(world: int) -> None:
    spawn(_matrix, world, args=(world * 100000,), backend="gloo", timeout_s=600)


def _fp8_rows_sent_not_kept() -> None:
    """FP8 (q, scales) rows whose scales are not 16-byte vectors (hidden 384, 640: 3 and 5 scales) sent to a peer and
    not kept here: the sender once wrote their scales at row -1 of this rank's received scales (an illegal address
    on a rank that receives nothing, the 4 bytes before the allocation otherwise). Every token goes to the last
    rank's last expert, so rank 0 receives nothing; every entry point, each checked exactly."""
    rank, world = dist.get_rank(), dist.get_world_size()
    buffer = _buffer()
    state = rounds.State()
    failures = []
    for i, (hidden, entry) in enumerate(itertools.product((384, 640), rounds.ENTRIES)):
        rnd = rounds.Round(
            seed=900 + i,
            entry=entry,
            mode="sync",
            form="fp8 tuple",
            hidden=hidden,
            topk=3,
            experts_per_rank=4,
            tokens=[37, 5][:world],
            routing="one_expert",
            alignment=1,
        )
        errors = rounds.run(buffer, rnd, state, rank, world)
        if errors:
            failures.append(f"{rnd.describe()}: {errors}")
    torch.cuda.synchronize()
    assert not failures, "\n".join(failures)


def test_fp8_rows_sent_not_kept() -> None:
    spawn(_fp8_rows_sent_not_kept, 2, backend="gloo", timeout_s=300)


def _async_counts_at_deepep_shape() -> None:
    """The case that failed: the async per-expert list right after a correct sync one, BF16 and FP8."""
    rank, world = dist.get_rank(), dist.get_world_size()
    buffer = _buffer()
    gen = torch.Generator().manual_seed(5 + rank)
    num_experts = 256
    idx = routing("random", 4096, 8, num_experts, gen).cuda()
    x = torch.randn(4096, 7168, generator=gen).bfloat16().cuda()
    local = num_experts // world
    everyone: list = [None] * world
    dist.all_gather_object(everyone, idx.cpu())
    want = [sum(int((i == rank * local + le).sum()) for i in everyone) for le in range(local)]
    for fp8_dispatch in (False, True):
        sync = buffer.dispatch(x, topk_idx=idx, num_experts=num_experts, fp8_dispatch=fp8_dispatch)[3]
        for mode in (
            dict(async_finish=True),
            dict(previous_event=buffer.capture(), async_finish=True),
            dict(previous_event=buffer.capture(), allocate_on_comm_stream=True),
        ):
            out = buffer.dispatch(x, topk_idx=idx, num_experts=num_experts, fp8_dispatch=fp8_dispatch, **mode)
            out[-1].current_stream_wait()
            assert sync == want and out[3] == want, (fp8_dispatch, mode)
            experts = buffer.dispatch_experts(x, idx, None, num_experts, fp8_dispatch=fp8_dispatch, **mode)
            experts[-1].current_stream_wait()
            assert experts[3] == want


def test_async_counts_at_deepep_shape() -> None:
    spawn(_async_counts_at_deepep_shape, 2, backend="gloo", timeout_s=600)


_DISAGREEING = ("hidden", "top-k width", "x dtype", "num_experts")


def _disagreeing_ranks(field: str) -> None:
    """notify's metadata words: every rank raises naming the field and the rank, for both notify kernels; each field
    on fresh processes and a fresh Buffer."""
    rank, world = dist.get_rank(), dist.get_world_size()
    odd = rank == world - 1
    x = torch.randn(64, 256).bfloat16().cuda()
    idx = routing("random", 64, 4, 8 * world, torch.Generator().manual_seed(rank)).cuda()
    call = {
        "hidden": lambda b: b.dispatch(x[:, :128] if odd else x, topk_idx=idx, num_experts=8 * world),
        "top-k width": lambda b: b.dispatch(x, topk_idx=idx[:, :2] if odd else idx, num_experts=8 * world),
        "x dtype": lambda b: b.dispatch_experts(x.float() if odd else x, idx, None, 8 * world),
        "num_experts": lambda b: b.dispatch(
            x, topk_idx=idx, num_experts=(16 if odd else 8) * world, num_worst_tokens=64 * world
        ),
    }[field]
    buffer = _buffer()
    with pytest.raises(ValueError, match=rf"disagree on {field}: rank\(s\) \[{world - 1}\] differ from rank 0"):
        call(buffer)
        settle(buffer)  # num_worst_tokens: no host read inside the dispatch
    buffer.destroy()


@pytest.mark.parametrize("field", _DISAGREEING)
def test_disagreeing_ranks_raise_on_every_rank(field: str) -> None:
    spawn(_disagreeing_ranks, 2, args=(field,), backend="gloo", timeout_s=300)
