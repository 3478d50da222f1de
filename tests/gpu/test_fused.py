"""The fused expansion (``NVLinkTuning.fused_dispatch``: the expert-major dispatch kernel writes every received row
straight into its expert-major rows) and the fused reduction (``NVLinkTuning.fused_combine``: the push combine kernel
sums each token's expert rows itself) against the unfused paths (receive buffer + ``permute``; ``unpermute`` +
combine) on the same Buffer: expert-major rows bit for bit (BF16/FP32 as their bits, FP8 bytes), FP8 scales, probs,
``tokens_per_expert``, ``recv_slot``, and combined rows and weights bit for bit (both round each received row once,
then sum over ranks in fp32 in the same order). Fresh dispatches (twice each: the transport's first fused one
outgrows its empty guess and dispatches again, later ones fit it unless a rank's expert-major rows grew), cached
ones (the backward of combine_experts), the push and pull dispatch paths (the fused combine always pushes; the
unfused one pulls or pushes as its tuning says), every row form, alignment 1, 4 and 16, routes with -1 entries, a
rank without tokens; EP1 on its own GPU (also at DeepSeek-V3's shape) and 2 and 4 ranks sharing cuda:0 over gloo
(start an MPS daemon first, as for tests/gpu/test_nvlink.py). Skips without a GPU or the built kernel library.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Optional

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from moe_ep_plugin import Buffer  # noqa: E402
from moe_ep_plugin.config import Config, NVLinkTuning  # noqa: E402
from moe_ep_plugin.launch import spawn  # noqa: E402
from moe_ep_plugin.ops import fp8  # noqa: E402
from support.gpu_marks import NEEDS_KERNELS  # noqa: E402
from support.reference import routing  # noqa: E402
from test_nvlink import _fail_fast  # noqa: E402  (a failed rank leaves at once, its traceback printed)

pytestmark = NEEDS_KERNELS

# Row forms: (name, dispatch keywords, x from a BF16 [N, H] tensor)
FORMS = (
    ("bf16", {}, lambda x: x),
    ("fp32", {}, lambda x: x.float()),
    ("fp8 input", {}, lambda x: fp8.quantize(x)),
    ("fp8 in send path", dict(fp8_dispatch=True), lambda x: x),
    ("fp8 in send path, fp8 out", dict(fp8_dispatch=True, fp8_out=True), lambda x: x),
)
# Data paths at EP > 1 (EP1 always pushes its own rows): the default (BF16/FP32/FP8-input rows pulled, quantized
# rows pushed), everything pushed, and quantized rows pulled too; one sender warp on 2 SMs stresses the row lists.
PATHS = (
    ("default", 24, NVLinkTuning()),
    ("push", 24, NVLinkTuning(dispatch_pull=False)),
    ("pull quantized", 24, NVLinkTuning(quantizing_dispatch_pull=True)),
    ("2 SMs, 1 sender warp", 2, NVLinkTuning(dispatch_pull=False, dispatch_send_warps=1,
                                             quantizing_dispatch_send_warps=1, dequantizing_dispatch_send_warps=1)),
)


def _configs(num_sms: int, tuning: NVLinkTuning) -> tuple[Config, Config]:
    """(unfused, fused) Configs of one data path (the fused one fuses dispatch and combine)."""
    return (Config(num_sms=num_sms, nvlink=tuning),
            Config(num_sms=num_sms, nvlink=dataclasses.replace(tuning, fused_dispatch=True, fused_combine=True)))


def _bits(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A tensor's bytes (NaN-safe, -0.0 distinct), where it lies."""
    return None if t is None else t.detach().contiguous().view(torch.uint8)


def _same(what: str, got: Optional[torch.Tensor], want: Optional[torch.Tensor]) -> None:
    assert (got is None) == (want is None), f"{what}: one is None"
    if got is None:
        return
    assert (got.dtype, tuple(got.shape)) == (want.dtype, tuple(want.shape)), (
        f"{what}: {got.dtype} {tuple(got.shape)} != {want.dtype} {tuple(want.shape)}")
    if not torch.equal(_bits(got), _bits(want)):
        rows = (_bits(got).view(got.shape[0], -1) != _bits(want).view(want.shape[0], -1)).any(1).nonzero()
        raise AssertionError(f"{what}: {rows.numel()} rows differ, first {rows[:8].flatten().tolist()}")


def _same_dispatch(what: str, got: tuple, want: tuple) -> None:
    """Two dispatch_experts results: rows, scales, probs, tokens_per_expert and the layout."""
    for name, i in (("expert_x", 0), ("expert_scales", 1), ("expert_probs", 2)):
        _same(f"{what}: {name}", got[i], want[i])
    assert got[3] == want[3], f"{what}: tokens_per_expert {got[3]} != {want[3]}"
    _same(f"{what}: recv_slot", got[4].expert_layout.recv_slot, want[4].expert_layout.recv_slot)
    _same(f"{what}: recv_src_idx", got[4].recv_src_idx, want[4].recv_src_idx)


def _inputs(seed: int, tokens: int, hidden: int, topk: int, num_experts: int, kind: str, device: torch.device):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    idx = routing(kind, tokens, topk, num_experts, gen)
    w = torch.rand(tokens, topk, generator=gen)
    return x.to(device), idx.to(device), w.to(device)


def _check(buffer: Buffer, seed: int, tokens: int, hidden: int, topk: int, num_experts: int, kind: str,
           alignment: int, form: tuple, path: tuple) -> None:
    """One case: fresh (twice), cached, and each handle's combine, fused against unfused."""
    name, keywords, make = form
    what = f"{name}, {path[0]}, tokens {tokens}, hidden {hidden}, top-{topk} of {num_experts}, {kind}, align {alignment}"
    unfused, fused = _configs(path[1], path[2])
    x, idx, w = _inputs(seed, tokens, hidden, topk, num_experts, kind, buffer.device)
    xin = make(x)
    want = buffer.dispatch_experts(xin, idx, w, num_experts, expert_alignment=alignment, config=unfused, **keywords)
    for attempt in ("fresh", "fresh again"):
        got = buffer.dispatch_experts(xin, idx, w, num_experts, expert_alignment=alignment, config=fused, **keywords)
        _same_dispatch(f"{what}, {attempt}", got, want)
    # the cached dispatch (what combine_experts' backward runs): gradients in the activations' dtype on each layout
    grad = torch.randn_like(x.float() if name == "fp32" else x)
    cached_want = buffer.dispatch_experts(grad, handle=want[4], config=unfused)
    cached_got = buffer.dispatch_experts(grad, handle=got[4], config=fused)
    for label, i in (("expert_x", 0), ("expert_scales", 1)):
        _same(f"{what}, cached: {label}", cached_got[i], cached_want[i])
    assert cached_got[2] is None and cached_want[2] is None
    # combine (with expert weights, as the backward of dispatch_experts runs it), in BF16 and FP32
    for dtype in (torch.bfloat16, torch.float32):
        y = torch.randn(want[0].shape[0], hidden, device=buffer.device).to(dtype)
        expert_weights = torch.rand(want[0].shape[0], device=buffer.device)
        got_out, got_w, _ = buffer.combine_experts(y, got[4], expert_weights, config=fused)
        want_out, want_w, _ = buffer.combine_experts(y, want[4], expert_weights, config=unfused)
        _same(f"{what}: combine {dtype}", got_out, want_out)
        _same(f"{what}: combined weights {dtype}", got_w, want_w)


def _cases(rank: int, world: int) -> list[tuple]:
    """(seed, tokens, hidden, topk, num_experts, routing, alignment): the last rank has no tokens in one case."""
    return [
        (11, 96 + 7 * rank, 1024, 8, 16 * world, "random", 1),
        (12, 0 if rank == world - 1 else 130, 7168, 8, 8 * world, "random", 16),
        (13, 64 + rank, 512, 4, 4 * world, "sparse", 16),
        (14, 37, 256, 2, 2 * world, "one_expert", 4),
    ]


def _suite() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    shared = dist.get_backend() != "nccl"
    buffer = Buffer(dist.group.WORLD, transport="nvlink", timeout_s=30.0, device="cuda:0" if shared else None)
    paths = PATHS if world > 1 else PATHS[:1] + PATHS[3:]  # nothing is pulled at EP1
    for case in _cases(rank, world):
        for form in FORMS:
            for path in paths:
                _check(buffer, case[0] * 100 + rank, *case[1:], form, path)
    if world == 1:  # DeepSeek-V3's shape (the Megatron benchmark's): every row expanded 8 times
        for form in FORMS:
            _check(buffer, 7, 4096, 7168, 8, 256, "random", 16, form, PATHS[0])
    torch.cuda.synchronize()
    dist.barrier()
    buffer.destroy()


def _entry() -> None:
    _fail_fast(_suite)


def test_fused_single_rank() -> None:
    spawn(_entry, 1, backend="nccl", timeout_s=300.0)


@pytest.mark.parametrize("ranks", [2, 4])
def test_fused_ranks_sharing_one_gpu(ranks: int) -> None:
    spawn(_entry, ranks, backend="gloo", timeout_s=600.0)
