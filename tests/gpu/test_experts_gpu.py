"""moe_ep_plugin.experts on CUDA: torch's grouped matmul (one CUTLASS kernel per projection for BF16 on SM90+)
against the per-expert loop, forward and every gradient, with experts without rows; the weights contiguous
``[L, K, N]`` (the trainer's) or a transposed view of stacked ``nn.Linear`` weights ``[L, N, K]`` (the DeepSpeed
layer's, whose weight gradient is computed as ``grad_y^T x``). The grouped forward and backward make no host sync.
Skips without an SM90+ GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_experts import _random_counts, _run

from moe_ep_plugin import experts


def _unavailable() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if torch.cuda.get_device_capability() < (9, 0):
        return "torch's grouped matmul runs as one kernel on SM90+ only"
    if experts._grouped_mm is None:
        return f"torch {torch.__version__} has no grouped matmul"
    return None


pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))
L, H, FFN = 8, 256, 128


def _operands(rows: int, linear_layout: bool, gen: torch.Generator) -> tuple[list[int], tuple, torch.Tensor]:
    """Counts (3 experts without rows when there are rows), ``(x, w1, b1, w2, b2)`` BF16 on CUDA, ``grad_out``."""
    counts = _random_counts(L, rows, gen, 3) if rows else [0] * L

    def weight(k: int, n: int) -> torch.Tensor:
        if linear_layout:  # nn.Linear's [N, K] per expert, stacked, seen as [L, K, N]
            return (torch.randn(L, n, k, generator=gen) / k**0.5).cuda().bfloat16().transpose(1, 2)
        return (torch.randn(L, k, n, generator=gen) / k**0.5).cuda().bfloat16()

    tensors = (
        torch.randn(rows, H, generator=gen).cuda().bfloat16(),
        weight(H, FFN),
        torch.randn(L, FFN, generator=gen).cuda().bfloat16(),
        weight(FFN, H),
        torch.randn(L, H, generator=gen).cuda().bfloat16(),
    )
    return counts, tensors, torch.randn(rows, H, generator=gen).cuda().bfloat16()


def _ffn(counts: list[int], impl: str):
    return lambda x, w1, b1, w2, b2: experts.ffn_experts(x, w1, b1, F.gelu, w2, b2, counts, impl)


@pytest.mark.parametrize("linear_layout", [False, True])
@pytest.mark.parametrize("rows", [1000, 0])
def test_ffn_grouped_equals_loop_on_cuda(rows, linear_layout):
    gen = torch.Generator().manual_seed(rows + linear_layout)
    counts, tensors, grad_out = _operands(rows, linear_layout, gen)
    assert experts.resolve_impl("auto", tensors[0], tensors[1], tensors[3]) == "grouped"
    grouped, loop = (_run(_ffn(counts, impl), tensors, grad_out) for impl in ("grouped", "loop"))
    names = ("y", "grad_x", "grad_w1", "grad_b1", "grad_w2", "grad_b2")
    for name, got, want in zip(names, grouped, loop, strict=False):
        assert got.shape == want.shape, name
        if want.numel():  # two GEMM kernels, fp32 accumulation in other orders, BF16 results
            err = float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-6))
            assert err < 1e-2, f"{name}: relative error {err:.3g}"
    for name, grad in zip(names[2:], grouped[2:], strict=False):  # experts without rows: exactly zero, not garbage
        for le, c in enumerate(counts):
            if c == 0:
                assert not grad[le].any(), f"{name}[{le}]"
    if linear_layout:  # each expert's slice of the weight gradient is contiguous in nn.Linear's layout
        assert grouped[2].transpose(1, 2).is_contiguous() and grouped[4].transpose(1, 2).is_contiguous()


def test_grouped_ffn_makes_no_host_sync():
    counts, tensors, grad_out = _operands(1000, True, torch.Generator().manual_seed(5))
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    _ffn(counts, "grouped")(*leaves).backward(grad_out)  # warm-up: pinned memory, kernels loaded
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _ffn(counts, "grouped")(*leaves).backward(grad_out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
