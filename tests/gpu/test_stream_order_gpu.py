"""Stream ordering of the Buffer's and the ``ElasticBuffer``'s calls on the GPU, with the race made likely on
purpose: the current stream is kept busy (``torch.cuda._sleep``) while the call is issued, so any step the call
makes on a stream its kernels do not wait for runs late, after the kernels read its output.

- ``ElasticBuffer`` cached dispatch with weights (expanded and not), in every stream mode of DeepEP's own
  ``tests/elastic/test_ep.py`` (``previous_event``, ``async_with_compute_stream``, ``allocate_on_comm_stream``):
  the weights carried in the cached layout equal the fresh dispatch's, bit for bit.
- Buffer calls back to back on two streams (a synchronous call on a busy stream, the next on another stream):
  calls share the transport's peer buffers and barriers, so the second waits for the first, and both results
  equal the same calls made on one stream.

Ranks share ``cuda:0`` over gloo (2 and 4), or one rank per GPU where several are visible. Skips without a GPU or
the kernel library.
"""

from __future__ import annotations

import itertools
import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from support.gpu_marks import GPUS, NEEDS_KERNELS  # noqa: E402

from moe_ep_plugin import Buffer  # noqa: E402
from moe_ep_plugin.deep_ep import ElasticBuffer  # noqa: E402
from moe_ep_plugin.launch import spawn  # noqa: E402

pytestmark = NEEDS_KERNELS
_RANKS = [min(GPUS, 8)] if GPUS >= 2 else [2, 4]
_BACKEND = "nccl" if GPUS >= 2 else "gloo"
# long enough that the current stream is still busy when the communication stream starts the call's kernels
_BUSY_CYCLES = 200_000_000
_TOKENS, _HIDDEN, _EXPERTS, _TOPK = 512, 2048, 32, 6


def _device() -> torch.device:
    return torch.device("cuda", 0 if dist.get_backend() != "nccl" else dist.get_rank() % GPUS)


def _routing(gen: torch.Generator, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k ``[T, K]`` of distinct experts with some -1 entries, and positive float32 weights."""
    scores = torch.rand(_TOKENS, _EXPERTS, generator=gen)
    idx = scores.topk(_TOPK, dim=1).indices
    idx[torch.rand(_TOKENS, _TOPK, generator=gen) < 0.1] = -1
    weights = torch.rand(_TOKENS, _TOPK, generator=gen) + 0.5
    return idx.to(device), weights.to(device)


def _cached_weights_case() -> None:
    device = _device()
    torch.cuda.set_device(device)
    shared = dist.get_backend() != "nccl"
    buf = ElasticBuffer(
        dist.group.WORLD,
        num_max_tokens_per_rank=_TOKENS,
        hidden=_HIDDEN,
        num_topk=_TOPK,
        transport="nvlink",
        device=device if shared else None,
    )
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    failures = []
    for do_expand, prev, async_, on_comm in itertools.product((False, True), (0, 1), (0, 1), (0, 1)):
        x = torch.randn(_TOKENS, _HIDDEN, generator=gen).to(device, torch.bfloat16)
        topk_idx, weights = _routing(gen, device)
        _, _, fresh_w, handle, event = buf.dispatch(
            x, topk_idx=topk_idx, topk_weights=weights, num_experts=_EXPERTS, do_expand=do_expand
        )
        torch.cuda.synchronize()
        # new weights for the cached call (what a backward carries); the fresh dispatch's reference of them
        new_w = torch.rand(_TOKENS, _TOPK, generator=gen).to(device) + 0.5
        _, _, expected, _, _ = buf.dispatch(
            x, topk_idx=topk_idx, topk_weights=new_w, num_experts=_EXPERTS, do_expand=do_expand
        )
        torch.cuda.synchronize()
        previous = buf.capture() if prev else None
        torch.cuda._sleep(_BUSY_CYCLES)  # the current stream busy: work queued on it after the event runs late
        _, _, got, _, event = buf.dispatch(
            x,
            handle=handle,
            topk_weights=new_w,
            do_expand=do_expand,
            previous_event=previous,
            async_with_compute_stream=bool(async_),
            allocate_on_comm_stream=bool(on_comm),
        )
        if async_:
            event.current_stream_wait()
        torch.cuda.synchronize()
        if not torch.equal(got, expected):
            failures.append(
                f"do_expand={do_expand} previous_event={prev} async={async_} on_comm={on_comm}: "
                f"{int((got != expected).sum())} of {got.numel()} weights differ"
            )
        del fresh_w
    dist.barrier()
    assert not failures, f"rank {dist.get_rank()}: " + "; ".join(failures)


def _two_streams_case() -> None:
    device = _device()
    torch.cuda.set_device(device)
    shared = dist.get_backend() != "nccl"
    buf = Buffer(dist.group.WORLD, transport="nvlink", device=device if shared else None)
    gen = torch.Generator().manual_seed(2000 + dist.get_rank())
    other = torch.cuda.Stream(device)
    for round_ in range(4):
        xs = [torch.randn(_TOKENS, _HIDDEN, generator=gen).to(device, torch.bfloat16) for _ in range(2)]
        routes = [_routing(gen, device) for _ in range(2)]
        # the reference: the two dispatches and their combines on one stream
        expected = []
        for x, (idx, w) in zip(xs, routes, strict=True):
            recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=_EXPERTS)
            combined, _, _ = buf.combine(recv_x, handle)
            expected.append((recv_x.clone(), combined.clone()))
        torch.cuda.synchronize()
        # the first pair on a busy current stream, the second pair on another stream, each synchronous
        torch.cuda._sleep(_BUSY_CYCLES // (round_ + 1))
        got = []
        first_x, _, _, _, first_handle, _ = buf.dispatch(
            xs[0], topk_idx=routes[0][0], topk_weights=routes[0][1], num_experts=_EXPERTS
        )
        first_combined, _, _ = buf.combine(first_x, first_handle)
        got.append((first_x, first_combined))
        with torch.cuda.stream(other):
            second_x, _, _, _, second_handle, _ = buf.dispatch(
                xs[1], topk_idx=routes[1][0], topk_weights=routes[1][1], num_experts=_EXPERTS
            )
            second_combined, _, _ = buf.combine(second_x, second_handle)
            got.append((second_x, second_combined))
        torch.cuda.synchronize()
        for which, ((ex, ec), (gx, gc)) in enumerate(zip(expected, got, strict=True)):
            assert torch.equal(ex, gx), f"rank {dist.get_rank()} round {round_}: dispatch {which} differs"
            assert torch.equal(ec, gc), f"rank {dist.get_rank()} round {round_}: combine {which} differs"
    dist.barrier()


@pytest.mark.parametrize("ranks", _RANKS, ids=lambda r: f"{r}ranks")
def test_elastic_cached_weights_wait_for_previous_event(ranks: int) -> None:
    spawn(_cached_weights_case, ranks, backend=_BACKEND, timeout_s=240.0)


@pytest.mark.parametrize("ranks", _RANKS, ids=lambda r: f"{r}ranks")
def test_calls_on_two_streams_are_ordered(ranks: int) -> None:
    spawn(_two_streams_case, ranks, backend=_BACKEND, timeout_s=240.0)
