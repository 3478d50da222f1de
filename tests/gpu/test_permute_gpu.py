"""The permute kernels (csrc/permute.cu) against the torch path on the same CUDA tensors, bit for bit.

Also against the CPU results (which tests/test_permute.py checks against plain loops), on fresh random inputs:
N = 0, K = 1..8, alignment 1/16/128, BF16/FP32/FP8 rows, scales and weights, all rows to one expert, ids past
the local experts, and the shapes the kernels refuse (rows not a multiple of 16 bytes, unaligned pointers,
> 1024 local experts), which must fall back to torch with the same bits. Outputs land in freshly poisoned
memory, so padding rows that the kernel forgot to zero show up. Skips without a GPU or the built kernel library.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_permute import routing

from moe_ep_plugin.ops import fp8, library
from moe_ep_plugin.ops import permute as P


def _unavailable() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if P._kernels() is None:
        return f"kernel library without the permute kernels: {library.unavailable_reason() or 'rebuild it'}"
    return None


pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))

# (N, K, local experts, alignment, hidden, dtype, routing, x storage offset in elements)
CASES = [
    (0, 4, 8, 1, 256, torch.bfloat16, "random", 0),
    (1, 1, 1, 1, 128, torch.float32, "random", 0),
    (37, 2, 4, 16, 2048, torch.bfloat16, "random", 0),
    (37, 2, 4, 16, 2048, torch.float16, "random", 0),
    (513, 8, 32, 128, 7168, torch.float16, "random", 0),
    (50, 4, 4, 16, 100, torch.float16, "random", 0),  # 200-byte rows: torch path
    (513, 8, 32, 128, 7168, torch.bfloat16, "random", 0),
    (300, 6, 16, 16, 4096, fp8.FP8_DTYPE, "random", 0),
    (1000, 8, 8, 128, 512, fp8.FP8_DTYPE, "one_expert", 0),
    (257, 3, 5, 1, 1028, torch.float32, "foreign", 0),
    (64, 5, 7, 16, 96, torch.float32, "none", 0),
    (4096, 8, 128, 1, 7168, torch.bfloat16, "random", 0),
    (50, 4, 4, 16, 100, torch.bfloat16, "random", 0),  # 200-byte rows: torch path
    (50, 4, 4, 1, 256, torch.bfloat16, "random", 1),  # rows start 2 bytes off 16-byte alignment: torch path
    (200, 8, 1500, 16, 128, torch.float32, "random", 0),  # more local experts than the slot kernel keeps
]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _same(name: str, a: torch.Tensor | None, b: torch.Tensor | None, seed: int) -> None:
    assert (a is None) == (b is None), f"{name}: {type(a)} vs {type(b)}"
    if a is None:
        return
    assert a.dtype == b.dtype and a.shape == b.shape, f"{name}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    if not torch.equal(_bits(a).cpu(), _bits(b).cpu()):
        rows = (_bits(a).cpu() != _bits(b).cpu()).reshape(a.shape[0], -1).any(dim=1).nonzero().flatten()
        raise AssertionError(
            f"{name} (seed {seed}): {rows.numel()} of {a.shape[0]} rows differ, first {rows[:5].tolist()}"
        )


def _poison(num_bytes: int) -> None:
    """Fills cached-allocator memory with 0xFF and frees it, so the next outputs start out as garbage."""
    junk = torch.full((num_bytes + (1 << 20),), 0xFF, dtype=torch.uint8, device="cuda")
    del junk


def _with_offset(t: torch.Tensor, offset: int) -> torch.Tensor:
    """A contiguous copy of ``t`` whose data starts ``offset`` elements into its storage."""
    storage = torch.empty(t.numel() + offset, dtype=t.dtype, device=t.device)
    out = storage[offset:].view(t.shape)
    out.copy_(t)
    return out


@pytest.mark.parametrize("n,k,num_local,alignment,hidden,dtype,kind,offset", CASES)
def test_kernels_match_torch(
    n: int, k: int, num_local: int, alignment: int, hidden: int, dtype: torch.dtype, kind: str, offset: int
) -> None:
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    idx_cpu = routing(kind, n, k, num_local, gen)
    local = idx_cpu[(idx_cpu >= 0) & (idx_cpu < num_local)]
    counts = [int(c) for c in (torch.bincount(local, minlength=num_local) + alignment - 1) // alignment * alignment]
    num_rows = sum(counts)
    x_cpu = (torch.randn(n, hidden, generator=gen) * 100).to(dtype)
    w_cpu = torch.rand(n, k, generator=gen)
    s_cpu = torch.rand(n, hidden // 128 + 1, generator=gen)
    out_dtype = dtype if dtype in (torch.float32, torch.float16) else torch.bfloat16
    # Wide exponent range, so the fixed summation order shows in the rounded bits (FP16: below its 65504 maximum).
    top = 1e3 if out_dtype == torch.float16 else 1e4
    y_cpu = (torch.randn(num_rows, hidden, generator=gen) * torch.rand(num_rows, 1, generator=gen).pow(8) * top).to(
        out_dtype
    )
    idx, w, s, y = idx_cpu.cuda(), w_cpu.cuda(), s_cpu.cuda(), y_cpu.cuda()
    x = _with_offset(x_cpu.cuda(), offset)

    _poison(n * k * 4)
    slot = P.expert_slots(idx, num_local, alignment)[0]
    _same("recv_slot vs torch", slot, P._torch_expert_slots(idx, num_local, alignment)[0], seed)
    slot_cpu = P.expert_slots(idx_cpu, num_local, alignment)[0]
    _same("recv_slot vs cpu", slot, slot_cpu, seed)
    bad = idx.clone()
    bad[torch.rand(n, k, device="cuda") < 0.05] = -7  # ids below -1: counted in the words, never placed
    words = P.expert_slots(bad, num_local, alignment)[1]
    _same("words vs cpu", words, P.expert_slots(bad.cpu(), num_local, alignment)[1], seed)

    _poison(num_rows * hidden * x.element_size())
    got = P.permute(x, slot, num_rows, w, s)
    want = P._torch_permute(x.contiguous(), slot, num_rows, w, s)
    on_cpu = P.permute(x_cpu, slot_cpu, num_rows, w_cpu, s_cpu)
    for name, a, b, c in zip(("x", "probs", "scales"), got, want, on_cpu, strict=False):
        _same(f"permute {name} vs torch", a, b, seed)
        _same(f"permute {name} vs cpu", a, c, seed)
    _same("permute x without weights/scales", P.permute(x, slot, num_rows)[0], want[0], seed)

    _poison(n * hidden * y.element_size())
    back = P.unpermute(y, slot)
    _same("unpermute vs torch", back, P._torch_unpermute(y, slot), seed)
    _same("unpermute vs cpu", back, P.unpermute(y_cpu, slot_cpu), seed)
    _poison(n * hidden * y.element_size())
    out = torch.empty_like(back)
    _same("unpermute into out vs torch", P.unpermute(y, slot, out=out), back, seed)
    torch.cuda.synchronize()


def test_kernels_on_a_side_stream_and_second_device() -> None:
    """Work is queued on the caller's current stream and device (not the default ones)."""
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    idx_cpu = routing("random", 700, 8, 16, gen)
    counts = [int(c) for c in torch.bincount(idx_cpu[idx_cpu >= 0], minlength=16)]
    x = torch.randn(700, 1024, generator=gen).bfloat16()
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        idx_dev = idx_cpu.to(device)
        x_dev = x.to(device)
        slot = P.expert_slots(idx_dev, 16, 1)[0]
        px = P.permute(x_dev, slot, sum(counts))[0]
        back = P.unpermute(px, slot)
    stream.synchronize()
    slot_cpu = P.expert_slots(idx_cpu, 16, 1)[0]
    assert torch.equal(slot.cpu(), slot_cpu)
    assert torch.equal(back.cpu(), P.unpermute(P.permute(x, slot_cpu, sum(counts))[0], slot_cpu))
