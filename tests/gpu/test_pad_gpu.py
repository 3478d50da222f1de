"""Drop-and-pad's kernels (csrc/kernels/drop_and_pad.cuh, through ``ops.pad``) against the torch ops that define them
(tests/test_pad_ops.py checks those against plain loops), bit for bit on fresh random inputs at the edges: no tokens,
every token marking one expert, more marked tokens than the capacity, capacity T, invalid slots, BF16 and FP32 rows,
Megatron-sized rows. Then drop-and-pad's dispatch and combine on the ``local`` transport (a group of one rank: the
fused path, forward and backward) against the chain it replaced (an index_select, reshapes, the token sums the
removed ``permute.sum_by_index`` gave, written out here), and its forward's kernel count under the profiler (three
launches: the pair selection, the gather, the token sums). The multi-rank path (the same kernels around the Buffer's
dispatch) is tests/gpu/test_drop_and_pad_gpu.py's and test_megatron_parity_gpu.py's. Outputs land in memory the test
filled with 0xFF first, so rows a kernel forgot to write show up. Skips without a GPU or the kernel library.
"""

from __future__ import annotations

import os
import random
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from support.gpu_marks import NEEDS_KERNELS  # noqa: E402

from moe_ep_plugin import Buffer  # noqa: E402
from moe_ep_plugin.launch import spawn  # noqa: E402
from moe_ep_plugin.ops import pad  # noqa: E402

pytestmark = NEEDS_KERNELS
DEVICE = "cuda"


def _poison() -> None:
    """Fill free cached memory with 0xFF so the next allocations start from it."""
    junk = torch.full((64 << 20,), 0xFF, dtype=torch.uint8, device=DEVICE)
    del junk


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).cpu() if t.is_floating_point() else t.cpu()


def _same(what: str, got: torch.Tensor | None, want: torch.Tensor | None, seed: int) -> None:
    assert (got is None) == (want is None), what
    if got is not None:
        assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got.dtype} {got.shape} {want.shape}"
        assert torch.equal(_bits(got), _bits(want)), f"{what} differs (seed {seed})"


# (map kind, tokens, experts, capacity)
SELECT_CASES = [
    ("random", 4096, 64, 640),
    ("random", 128, 8, 40),
    ("random", 1537, 3, 1537),  # capacity T, tokens past a block's chunk
    ("one_expert", 700, 16, 90),  # more marked than the capacity in expert 0, only padding elsewhere
    ("all", 33, 5, 7),
    ("none", 9, 2, 0),
    ("none", 0, 4, 0),
]


@pytest.mark.parametrize("kind,tokens,experts,capacity", SELECT_CASES)
def test_select_pairs_kernel_equals_torch(kind: str, tokens: int, experts: int, capacity: int) -> None:
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    if kind == "random":
        rmap = torch.rand(tokens, experts, generator=gen) < 0.3
    else:
        rmap = torch.zeros(tokens, experts, dtype=torch.bool)
        rmap[:, : {"one_expert": 1, "all": experts, "none": 0}[kind]] = True
    _poison()
    got = pad.select_pairs(rmap.to(DEVICE), capacity)
    want = pad.select_pairs(rmap, capacity)
    for name, g, w in zip(("tokens", "slot", "experts"), got, want, strict=True):
        _same(name, g, w, seed)


# (groups, local, capacity, block, hidden, dtype)
ARRANGE_CASES = [
    (1, 64, 640, 640, 7168, torch.bfloat16),
    (1, 8, 40, 48, 2048, torch.bfloat16),
    (4, 8, 40, 256, 1024, torch.bfloat16),
    (2, 3, 5, 16, 36, torch.float32),
    (3, 2, 0, 4, 64, torch.bfloat16),
]


@pytest.mark.parametrize("groups,local,capacity,block,hidden,dtype", ARRANGE_CASES)
def test_arrange_kernel_equals_torch(
    groups: int, local: int, capacity: int, block: int, hidden: int, dtype: torch.dtype
) -> None:
    seed = random.randrange(2**31)
    gen = torch.Generator(DEVICE).manual_seed(seed)
    shape = (groups, local, capacity, block)
    pairs = groups * local * capacity
    rows = torch.randn(pairs, hidden, generator=gen, device=DEVICE).to(dtype)
    probs = torch.rand(pairs, generator=gen, device=DEVICE)
    _poison()
    out, out_probs = pad.arrange(rows, *shape, probs=probs)
    want, want_probs = pad._torch_arrange(rows, *shape, None, probs, False)
    _same("arrange", out, want, seed)
    _same("arrange probs", out_probs, want_probs, seed)
    back, back_probs = pad.arrange(out, *shape, probs=out_probs, inverse=True)
    _same("inverse", back, pad._torch_arrange(out, *shape, None, out_probs, True)[0], seed)
    _same("inverse probs", back_probs, probs, seed)
    if groups == 1:  # the sender's pairs through their tokens, as drop-and-pad gathers them
        tokens_n = 2 * capacity + 3
        x = torch.randn(tokens_n, hidden, generator=gen, device=DEVICE).to(dtype)
        token_probs = torch.rand(tokens_n, local, generator=gen, device=DEVICE)
        tokens = torch.randint(tokens_n, (pairs,), generator=gen, device=DEVICE)
        got = pad.arrange(x, *shape, tokens=tokens, probs=token_probs)
        want = pad._torch_arrange(x, *shape, tokens, token_probs, False)
        _same("gather", got[0], want[0], seed)
        _same("gather probs", got[1], want[1], seed)


# (tokens, slots, rows, capacity, block, hidden, dtype)
SUM_CASES = [
    (4096, 64, 64 * 640, 640, 640, 7168, torch.bfloat16),
    (128, 8, 8 * 48, 40, 48, 2048, torch.bfloat16),
    (128, 8, 8 * 48, 40, 48, 2048, torch.float16),
    (300, 256, 900, 3, 3, 1024, torch.float32),
    (0, 4, 10, 2, 2, 128, torch.bfloat16),
    (7, 3, 0, 1, 4, 64, torch.float32),
]


@pytest.mark.parametrize("tokens,slots,rows_n,capacity,block,hidden,dtype", SUM_CASES)
def test_sum_pairs_kernel_equals_torch(
    tokens: int, slots: int, rows_n: int, capacity: int, block: int, hidden: int, dtype: torch.dtype
) -> None:
    """Random pairs: most -1 (dropped), some with rows past the end (ignored), rows named by several tokens."""
    seed = random.randrange(2**31)
    gen = torch.Generator(DEVICE).manual_seed(seed)
    rows = (torch.randn(rows_n, hidden, generator=gen, device=DEVICE) * 50).to(dtype)
    weights = torch.randn(rows_n, generator=gen, device=DEVICE)
    pairs = slots * capacity + 2
    slot = torch.randint(-1, pairs, (tokens, slots), generator=gen, device=DEVICE, dtype=torch.int32)
    slot = torch.where(torch.rand(tokens, slots, generator=gen, device=DEVICE) < 0.7, -1, slot)
    _poison()
    got, got_weights = pad.sum_pairs(rows, slot, capacity, block, weights)
    want, want_weights = pad._torch_sum_pairs(rows, slot, capacity, block, weights)
    _same("sum", got, want, seed)
    _same("weights", got_weights, want_weights, seed)
    _same("sum vs cpu", got, pad.sum_pairs(rows.cpu(), slot.cpu(), capacity, block)[0], seed)


def _token_sums(pairs: torch.Tensor, order: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``pairs`` ``[E * C, H]`` in pair order, ``order`` ``[E, C]`` each pair's token → ``[num_tokens, H]``
    ``pairs.dtype``: each token's pairs summed in ascending pair order in fp32 from 0.0, rounded once (0 for a token
    no pair names), as the removed ``permute.sum_by_index`` summed them. Expert by expert: an expert's ``C`` tokens
    are distinct, so each step adds at most one row to a token, and a token's pairs come in ascending ``p``."""
    experts, capacity = order.shape
    total = torch.zeros(num_tokens, pairs.shape[1], dtype=torch.float32, device=pairs.device)
    for e, rows in enumerate(pairs.reshape(experts, capacity, -1).float()):
        total[order[e]] += rows
    return total.to(pairs.dtype)


def _pre_fusion(
    x: torch.Tensor,
    probs: torch.Tensor,
    rmap: torch.Tensor,
    capacity: int,
    block: int,
    scale: torch.Tensor,
    grad_out: torch.Tensor,
    grad_probs: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """Drop-and-pad at one rank as the chain before the fusion computed it (Buffer's ``local`` transport hands the
    pairs back unchanged): the stable sort, an index_select of the pairs, zero rows after each expert's ``C``,
    :func:`_token_sums` for the token sums; the gradients by the same ops in reverse."""
    num_tokens, experts = rmap.shape
    order = rmap.t().to(torch.int8).argsort(dim=1, descending=True, stable=True)[:, :capacity]
    tokens = order.reshape(-1)

    def expert_major(t: torch.Tensor) -> torch.Tensor:
        blocks = t.reshape(experts, capacity, *t.shape[1:])
        padding = blocks.new_zeros(experts, block - capacity, *t.shape[1:])
        return torch.cat([blocks, padding], dim=1).reshape(experts * block, *t.shape[1:])

    def pair_order(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(experts, block, *t.shape[1:])[:, :capacity].reshape(experts * capacity, *t.shape[1:])

    expert_x = expert_major(x.index_select(0, tokens))
    expert_probs = expert_major(probs.t().gather(1, order).reshape(-1).float())
    out = _token_sums(pair_order(expert_x * scale.unsqueeze(1)), order, num_tokens)
    grad_y = expert_major(grad_out.index_select(0, tokens)) * scale.unsqueeze(1)
    grad_x = _token_sums(pair_order(grad_y), order, num_tokens)
    grad_p = torch.zeros(experts, num_tokens, device=x.device)
    grad_p = grad_p.scatter_add(1, order, pair_order(grad_probs).view(experts, capacity)).t().to(probs.dtype)
    return expert_x, expert_probs, out, grad_x, grad_p


ONE_RANK_CASES = [
    (128, 8, 40, 16, torch.bfloat16),
    (4096, 64, 512, 128, torch.bfloat16),
    (300, 4, 300, 1, torch.float32),
]


def _one_rank_equals_the_pre_fusion_chain() -> None:
    from moe_ep_plugin.megatron import drop_and_pad

    torch.cuda.set_device(0)
    buffer = Buffer(transport="nvlink", device=DEVICE)  # local: a group of one rank
    assert buffer.transport_name == "local"
    for tokens, experts, capacity, alignment, dtype in ONE_RANK_CASES:
        seed = random.randrange(2**31)
        gen = torch.Generator(DEVICE).manual_seed(seed)
        hidden = 1024
        x = torch.randn(tokens, hidden, generator=gen, device=DEVICE).to(dtype).requires_grad_()
        probs = torch.rand(tokens, experts, generator=gen, device=DEVICE).requires_grad_()
        rmap = torch.rand(tokens, experts, generator=gen, device=DEVICE) < 0.25
        layout = drop_and_pad.pad_layout(rmap, capacity, 1, alignment)
        scale = torch.randn(experts * layout.block, generator=gen, device=DEVICE).to(dtype)
        grad_out = torch.randn(tokens, hidden, generator=gen, device=DEVICE).to(dtype)
        grad_probs = torch.randn(experts * layout.block, generator=gen, device=DEVICE)
        expert_x, expert_probs, handle = drop_and_pad.dispatch(buffer, x, probs, layout)
        out = drop_and_pad.combine(buffer, expert_x * scale.unsqueeze(1), handle, layout)
        grad_x, grad_p = torch.autograd.grad((out, expert_probs), (x, probs), (grad_out, grad_probs))
        got = (expert_x, expert_probs, out, grad_x, grad_p)
        want = _pre_fusion(x.detach(), probs.detach(), rmap, capacity, layout.block, scale, grad_out, grad_probs)
        for name, g, w in zip(("expert_x", "expert_probs", "combined", "grad x", "grad probs"), got, want, strict=True):
            _same(f"{name} at {tokens} tokens", g.detach(), w, seed)

    # the forward's kernels: the pair selection, the gather, the token sums (the chain before made about sixty)
    x, probs, rmap = x.detach(), probs.detach(), rmap

    def forward() -> torch.Tensor:
        layout = drop_and_pad.pad_layout(rmap, capacity, 1, alignment)
        rows, _, handle = drop_and_pad.dispatch(buffer, x, probs, layout)
        return drop_and_pad.combine(buffer, rows, handle, layout)

    forward()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        forward()
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"drop-and-pad forward on the local transport: {len(kernels)} kernels: {kernels}", flush=True)
    assert len(kernels) == 3, kernels


def test_one_rank_equals_the_pre_fusion_chain_in_three_kernels() -> None:
    """Dispatch and combine on the ``local`` transport (BF16 and FP32 rows, float32 probs, no FP8), forward and
    backward, equal the chain before the fusion bit for bit; the forward is three kernel launches (the profiler).
    ``moe_ep_plugin.megatron`` needs megatron-core; the kernel tests above do not."""
    pytest.importorskip("megatron.core", reason="moe_ep_plugin.megatron needs megatron-core")
    spawn(_one_rank_equals_the_pre_fusion_chain, 1, backend="gloo", timeout_s=300)
