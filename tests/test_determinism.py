"""Dispatch and combine are bitwise reproducible run to run: the same inputs give the same bits, whatever the
stream mode, on every transport (rows land at positions computed from the counts, never in arrival order; every
sum has a fixed order; the kernels' only atomics count integers). Inputs are unrounded random floats, so any
change of summation order would show. CPU: ``torch`` (3 ranks) and ``hierarchical`` (emulated 2x2); GPU:
the ``nvlink`` kernels, several ranks sharing the GPUs (skipped without one)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from support.gpu_marks import NEEDS_KERNELS
from support.reference import routing

from moe_ep_plugin import Buffer
from moe_ep_plugin.deep_ep import ElasticBuffer
from moe_ep_plugin.launch import spawn

MODES = ({}, {"async_finish": True}, {"previous_event": True, "allocate_on_comm_stream": True})


def _bits(value) -> list:
    """Every tensor in ``value`` (nested tuples, lists, None), as raw bytes for a bitwise comparison."""
    if isinstance(value, torch.Tensor):
        return [value.detach().cpu().contiguous().view(torch.uint8).clone()]
    if isinstance(value, (tuple, list)):
        return [b for item in value for b in _bits(item)]
    return []


def _run(buffer: Buffer, x, idx, w, num_experts: int, mode: dict) -> list:
    kw = dict(mode)
    if kw.pop("previous_event", False):
        kw["previous_event"] = buffer.capture()
    out = buffer.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=num_experts, **kw)
    out[-1].current_stream_wait()
    recv_x, _, recv_w, _, handle, _ = out
    combined = buffer.combine(recv_x * 1.37, handle, topk_weights=recv_w, **kw)
    combined[-1].current_stream_wait()
    experts = buffer.dispatch_experts(x, idx, w, num_experts, expert_alignment=4, **kw)
    experts[-1].current_stream_wait()
    back = buffer.combine_experts(experts[0] * 0.71, experts[4], expert_weights=experts[2], **kw)
    back[-1].current_stream_wait()
    return _bits((out[:3], combined[:2], experts[:3], back[:2]))


def _suite(seed: int, transport: str, ranks_per_node, device: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device(device) if device == "cpu" else torch.device("cuda", rank % torch.cuda.device_count())
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    buffer = Buffer(transport=transport, ranks_per_node=ranks_per_node, timeout_s=60, device=dev)
    elastic = ElasticBuffer(
        dist.group.WORLD,
        num_max_tokens_per_rank=128,
        hidden=256,
        transport=transport,
        ranks_per_node=ranks_per_node,
        device=dev,
    )
    num_experts = 4 * world
    for i in range(3):
        gen = torch.Generator().manual_seed(seed + 97 * i + rank)
        n = 20 + 11 * rank + 7 * i
        x = torch.randn(n, 256, generator=gen).bfloat16().to(dev)
        idx = routing(("random", "sparse", "one_expert")[i], n, 4, num_experts, gen).to(dev)
        w = torch.rand(n, 4, generator=gen).to(dev)
        first = _run(buffer, x, idx, w, num_experts, {})
        for mode in MODES:
            for _ in range(2):
                again = _run(buffer, x, idx, w, num_experts, mode)
                assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True)), (i, mode)
        runs = []
        for _ in range(2):  # the DeepEP V2 face: non-expanded and expanded dispatch, combines with weights
            recv, _, rw, h, _ = elastic.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=num_experts)
            c = elastic.combine(recv * 0.5, h, topk_weights=rw)
            ex, _, ew, eh, _ = elastic.dispatch(
                x, topk_idx=idx, topk_weights=w, num_experts=num_experts, do_expand=True, expert_alignment=8
            )
            ec = elastic.combine(ex * 3.1, eh, topk_weights=ew)
            runs.append(_bits((recv, rw, c[:2], ex, ew, ec[:2], h.recv_src_metadata, eh.recv_src_metadata)))
        assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True)), i


@pytest.mark.parametrize("transport,world,ranks_per_node", [("torch", 3, None), ("hierarchical", 4, 2)])
def test_bitwise_reproducible_on_cpu(transport: str, world: int, ranks_per_node) -> None:
    spawn(_suite, world, args=(int(time.time()) % 1000, transport, ranks_per_node, "cpu"), backend="gloo")


@pytest.mark.parametrize("world", [2, 4])
@NEEDS_KERNELS[0]
@NEEDS_KERNELS[1]
def test_bitwise_reproducible_on_nvlink(world: int) -> None:
    spawn(_suite, world, args=(int(time.time()) % 1000, "nvlink", None, "cuda"), backend="gloo")
