"""The ``local`` transport's host work on its kernel path, on CPU over the recording stand-in library
(``tests/support/fake_kernels.py``): which kernels a call hands which inputs, how many host reads it makes, and what
it returns. What the kernels compute is tests/gpu's business."""

from __future__ import annotations

import ctypes
import random
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from support.fake_kernels import FakeLib, installed

from moe_ep_plugin.config import Config, round_up
from moe_ep_plugin.transports.base import DispatchArgs
from moe_ep_plugin.transports.local import LocalTransport


def _words(topk_idx: torch.Tensor, num_experts: int, alignment: int) -> list[int]:
    """What the slot kernel writes for the host: rows naming an expert, out-of-range ids (none here), aligned
    counts."""
    flat = topk_idx[topk_idx >= 0]
    counts = round_up(torch.bincount(flat, minlength=num_experts), alignment)
    return [int((topk_idx >= 0).any(1).sum()), 0, *counts.tolist()]


def _slot_kernel(lib: FakeLib, words: list[int]):
    """The fake ``moe_ep_expert_slots``: records the call, writes ``words`` and marks every slot empty."""

    def call(idx, n, k, num_local, alignment, slot, out_words, workspace, blocks, stream) -> int:
        lib.calls.append(("moe_ep_expert_slots", (n, k, num_local, alignment)))
        (ctypes.c_int64 * len(words)).from_address(out_words)[:] = words
        ctypes.memset(slot, 0xFF, 4 * n * k)
        return 0

    return call


@pytest.mark.parametrize("alignment", [1, 16])
@pytest.mark.parametrize("everyone", [True, False])
def test_fresh_expert_dispatch_is_the_kernels_and_one_read(alignment: int, everyone: bool) -> None:
    """The slot kernel on the caller's top-k, one host read (of the words it wrote), then the permute of ``x`` into
    exactly the rows that read counted; the handle's layout and received tokens are the read's."""
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    n, k, e, h = 64, 4, 8, 128
    topk_idx = torch.rand(n, e, generator=gen).topk(k, dim=1).indices
    if not everyone:
        topk_idx[torch.randint(n, (3,), generator=gen)] = -1  # tokens naming no expert
    x = torch.randn(n, h, generator=gen).bfloat16()
    words = _words(topk_idx, e, alignment)
    lib = FakeLib(1)
    lib.moe_ep_expert_slots = _slot_kernel(lib, words)
    props = type("Props", (), {"multi_processor_count": 4})()
    with (
        mock.patch.object(dist, "get_rank", lambda group: 0),
        mock.patch.object(dist, "get_world_size", lambda group: 1),
    ):
        transport = LocalTransport(None, torch.device("cpu"), 5.0)
    args = DispatchArgs(
        x=x,
        x_scales=None,
        topk_idx=topk_idx,
        topk_weights=None,
        num_tokens_per_rank=None,
        is_token_in_rank=None,
        num_experts=e,
        handle=None,
        num_worst_tokens=0,
        wire_fp8=False,
        fp8_out=False,
        round_scale=False,
        config=Config(),
    )
    reads = []
    read = transport._read
    with (
        installed(lib),
        mock.patch.object(torch.cuda, "get_device_properties", lambda device: props),
        mock.patch.object(transport, "_read", lambda words, a: reads.append(words.tolist()) or read(words, a)),
    ):
        result = transport.dispatch_experts(args, alignment)

    num_rows = sum(words[2:])
    assert reads == [words], seed  # one host read: the slot kernel's words
    slots = [call for name, call in lib.calls if name == "moe_ep_expert_slots"]
    permutes = [call for name, call in lib.calls if name == "moe_ep_permute"]
    assert slots == [(n, k, e, alignment)], seed  # the caller's top-k, all experts local
    # the permute's inputs: x itself, all n tokens, its K columns, rows of H BF16 values into the rows counted
    assert [(c[0], c[4], c[5], c[6], c[8]) for c in permutes] == [(x.data_ptr(), n, k, 2 * h, num_rows)], seed
    assert result.x.shape == (num_rows, h) and result.handle.expert_layout.tokens_per_expert == words[2:], seed
    assert result.handle.num_recv_tokens == words[0], seed
    if everyone:  # (otherwise the mask comes from the slots, which the fake kernel leaves empty)
        assert bool(result.handle.is_token_in_rank.all()), seed


def test_worst_sized_dispatch_with_room_for_every_token_reads_nothing() -> None:
    """A row-major dispatch whose ``num_worst_tokens`` covers every token cannot cut a row off, so it makes no host
    read (``_read`` is the only one; no ``item``/``tolist`` either): the received tokens first, in token order,
    then zero rows with id -1; its combine and its cached dispatch agree with the counted dispatch's."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    n, k, e, h = 12, 2, 4, 64
    topk_idx = torch.randint(e, (n, k), generator=gen)
    topk_idx[[1, 5, 6]] = -1  # tokens naming no expert: not received
    x = torch.randn(n, h, generator=gen)
    weights = torch.rand(n, k, generator=gen)
    with (
        mock.patch.object(dist, "get_rank", lambda group: 0),
        mock.patch.object(dist, "get_world_size", lambda group: 1),
    ):
        transport = LocalTransport(None, torch.device("cpu"), 5.0)
    in_rank = (topk_idx >= 0).any(1, keepdim=True)

    def args(worst: int, handle=None) -> DispatchArgs:
        return DispatchArgs(
            x=x,
            x_scales=None,
            topk_idx=None if handle else topk_idx,
            topk_weights=None if handle else weights,
            num_tokens_per_rank=None,
            is_token_in_rank=in_rank,
            num_experts=e,
            handle=handle,
            num_worst_tokens=worst,
            wire_fp8=False,
            fp8_out=False,
            round_scale=False,
            config=Config(),
        )

    counted = transport.dispatch(args(0))
    with (
        mock.patch.object(LocalTransport, "_read", side_effect=AssertionError("host read")),
        mock.patch.object(torch.Tensor, "tolist", side_effect=AssertionError("host read")),
        mock.patch.object(torch.Tensor, "item", side_effect=AssertionError("host read")),
    ):
        worst = transport.dispatch(args(n + 3))
        again = transport.dispatch(args(n + 3, worst.handle))
        combined, combined_w = transport.combine(worst.recv_x * 2, worst.handle, worst.recv_topk_weights, (), Config())
    m = counted.recv_x.shape[0]
    assert m == n - 3 and worst.recv_x.shape[0] == n + 3 and worst.handle.num_recv_tokens is None
    assert torch.equal(worst.recv_x[:m], counted.recv_x) and not worst.recv_x[m:].any()
    assert torch.equal(worst.recv_topk_idx[:m], counted.recv_topk_idx) and bool((worst.recv_topk_idx[m:] == -1).all())
    assert torch.equal(worst.recv_topk_weights[:m], counted.recv_topk_weights)
    assert not worst.recv_topk_weights[m:].any() and worst.host_counts is None
    assert torch.equal(again.recv_x, worst.recv_x)
    expected, expected_w = transport.combine(
        counted.recv_x * 2, counted.handle, counted.recv_topk_weights, (), Config()
    )
    assert torch.equal(combined, expected) and torch.equal(combined_w, expected_w)


@pytest.mark.parametrize("n", [0, 6])
def test_read_free_dispatch_stores_rows_in_one_permute_and_none_without_rows(n: int) -> None:
    """The read-free dispatch (``num_worst_tokens`` with room for every token) stores every received row with one
    permute kernel; a rank without tokens launches none (an empty input's null pointer, which the kernel refuses)
    and gets zero rows and zero FP8 scales."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    e, h, worst = 4, 128, 8
    x = torch.randn(n, h, generator=gen).to(torch.float8_e4m3fn)
    scales = torch.rand(n, h // 128, generator=gen)
    topk_idx = torch.randint(e, (n, 2), generator=gen)
    with (
        mock.patch.object(dist, "get_rank", lambda group: 0),
        mock.patch.object(dist, "get_world_size", lambda group: 1),
    ):
        transport = LocalTransport(None, torch.device("cpu"), 5.0)
    args = DispatchArgs(
        x=x,
        x_scales=scales,
        topk_idx=topk_idx,
        topk_weights=None,
        num_tokens_per_rank=None,
        is_token_in_rank=torch.ones(n, 1, dtype=torch.bool),
        num_experts=e,
        handle=None,
        num_worst_tokens=worst,
        wire_fp8=False,
        fp8_out=False,
        round_scale=False,
        config=Config(),
    )
    lib = FakeLib(1)
    with installed(lib):
        result = transport.dispatch(args)
    permutes = [call for name, call in lib.calls if name == "moe_ep_permute"]
    assert len(permutes) == (1 if n else 0), lib.calls
    assert result.recv_x.shape == (worst, h) and result.recv_scales.shape == (worst, 1)
    if n:
        assert permutes[0][4] == n and permutes[0][8] == worst  # every token's row, into the worst-case rows
    else:
        assert not result.recv_x.view(torch.uint8).any() and not result.recv_scales.any()
