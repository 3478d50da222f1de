"""moe_ep_plugin.experts: grouped expert GEMMs equal the per-expert loop (outputs and every gradient), on CPU.

On CPU ATen's grouped matmul is the same per-group matmul, so the two paths must agree bit for bit; the loop
itself is checked against a plain per-row reference. The GPU half (the CUTLASS kernel) lives in
tests/gpu/test_experts_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_ep_plugin import experts


def _random_counts(num_experts: int, rows: int, gen: torch.Generator, empty: int) -> list[int]:
    """``rows`` spread over ``num_experts`` at random, with the first ``empty`` (shuffled) experts given none."""
    owners = torch.randperm(num_experts, generator=gen)[empty:]
    picks = owners[torch.randint(len(owners), (rows,), generator=gen)] if len(owners) else owners
    return torch.bincount(picks, minlength=num_experts).tolist()


def _row_reference_swiglu(x, gate_up, down, counts):
    """One token row at a time: the expert owning row ``i`` is the one whose block holds ``i``."""
    owner = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    out = []
    for i in range(x.shape[0]):
        gate, up = (x[i] @ gate_up[owner[i]]).chunk(2)
        out.append((F.silu(gate) * up) @ down[owner[i]])
    return torch.stack(out) if out else x.new_zeros(0, down.shape[-1])


def _run(fn, inputs, grad_out):
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) if t is not None else None for t in inputs]
    y = fn(*leaves)
    y.backward(grad_out)
    return [y.detach()] + [t.grad for t in leaves if t is not None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["random", "zero_rows", "all_one_expert", "no_rows", "one_expert"])
def test_swiglu_grouped_equals_loop(dtype, case):
    gen = torch.Generator().manual_seed(hash((case, str(dtype))) % 2**31)
    num_experts, hidden, inner = (1, 16, 8) if case == "one_expert" else (6, 16, 8)
    rows = {"no_rows": 0}.get(case, int(torch.randint(1, 40, (1,), generator=gen)))
    empty = {"zero_rows": 3, "all_one_expert": num_experts - 1}.get(case, 0)
    counts = _random_counts(num_experts, rows, gen, empty)
    assert sum(counts) == rows and (case != "zero_rows" or counts.count(0) >= 3)
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    gate_up = torch.randn(num_experts, hidden, 2 * inner, generator=gen).to(dtype)
    down = torch.randn(num_experts, inner, hidden, generator=gen).to(dtype)
    grad_out = torch.randn(rows, hidden, generator=gen).to(dtype)

    results = {
        impl: _run(lambda a, b, c: experts.swiglu_experts(a, b, c, counts, impl), (x, gate_up, down), grad_out)
        for impl in ("loop", "grouped", "auto")
    }
    for impl in ("grouped", "auto"):
        names = ("y", "grad_x", "grad_gate_up", "grad_down")
        for name, got, want in zip(names, results[impl], results["loop"], strict=False):
            assert torch.equal(got, want), (impl, name)
    # experts without rows get an exact zero gradient
    for le, c in enumerate(counts):
        if c == 0:
            assert not results["grouped"][2][le].any() and not results["grouped"][3][le].any()
    if dtype == torch.float32:
        # another summation order than the batched matmul: outputs of magnitude ~30 differ by a few fp32 ulps
        torch.testing.assert_close(
            results["loop"][0], _row_reference_swiglu(x, gate_up, down, counts), rtol=1e-5, atol=1e-4
        )


def test_ffn_with_biases_grouped_equals_loop():
    gen = torch.Generator().manual_seed(7)
    num_experts, hidden, inner = 5, 8, 12
    counts = _random_counts(num_experts, 33, gen, 2)
    tensors = (
        torch.randn(33, hidden, generator=gen),
        torch.randn(num_experts, hidden, inner, generator=gen),
        torch.randn(num_experts, inner, generator=gen),
        torch.randn(num_experts, inner, hidden, generator=gen),
        torch.randn(num_experts, hidden, generator=gen),
    )
    grad_out = torch.randn(33, hidden, generator=gen)
    results = {
        impl: _run(
            lambda x, w1, b1, w2, b2: experts.ffn_experts(x, w1, b1, F.gelu, w2, b2, counts, impl), tensors, grad_out
        )
        for impl in ("loop", "grouped")
    }
    names = ("y", "grad_x", "grad_w1", "grad_b1", "grad_w2", "grad_b2")
    for name, got, want in zip(names, results["grouped"], results["loop"], strict=False):
        if name.startswith("grad_b"):  # a segment sum over rows against one sum per chunk: the order differs
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
        else:
            assert torch.equal(got, want), name
    # the loop against one row at a time
    x, w1, b1, w2, b2 = tensors
    owner = torch.repeat_interleave(torch.arange(num_experts), torch.tensor(counts))
    ref = torch.stack([F.gelu(x[i] @ w1[owner[i]] + b1[owner[i]]) @ w2[owner[i]] + b2[owner[i]] for i in range(33)])
    torch.testing.assert_close(results["loop"][0], ref, rtol=1e-5, atol=1e-5)


def test_unaligned_widths_fall_back_to_the_loop_and_grouped_says_why():
    x, w = torch.randn(4, 6), torch.randn(2, 6, 5)  # 6 and 5 floats are not multiples of 16 bytes
    assert not experts.grouped_mm_supported(x, w)
    assert experts.resolve_impl("auto", x, w) == "loop"
    with pytest.raises(ValueError, match="impl: 'grouped' cannot run"):
        experts.resolve_impl("grouped", x, w)
    assert experts.resolve_impl("auto", torch.randn(4, 8), torch.randn(2, 8, 4)) == "grouped"
    assert not experts.grouped_mm_supported(torch.randn(4, 8), torch.randn(2, 8, 4, dtype=torch.float64))


def test_inputs_are_checked_with_named_errors():
    x, gate_up, down = torch.randn(5, 8), torch.randn(2, 8, 8), torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match="impl: expected one of"):
        experts.swiglu_experts(x, gate_up, down, [2, 3], "fast")
    with pytest.raises(ValueError, match="counts: expected 2 entries"):
        experts.swiglu_experts(x, gate_up, down, [5], "loop")
    with pytest.raises(ValueError, match="summing to the 5 rows"):
        experts.swiglu_experts(x, gate_up, down, [2, 2], "grouped")
    with pytest.raises(ValueError, match=r"counts\[1\]: expected a non-negative int"):
        experts.swiglu_experts(x, gate_up, down, [6, -1], "grouped")
    with pytest.raises(TypeError, match=r"counts\[0\]: expected an int"):
        experts.swiglu_experts(x, gate_up, down, [True, 4], "loop")
    with pytest.raises(TypeError, match="counts: expected a list of ints"):
        experts.swiglu_experts(x, gate_up, down, torch.tensor([2, 3]), "loop")


def test_offsets_are_the_inclusive_cumsum_in_int32():
    offs = experts.expert_offsets([3, 0, 4, 0], torch.device("cpu"))
    assert offs.dtype == torch.int32 and offs.tolist() == [3, 3, 7, 7]


def test_weight_gradient_keeps_the_linear_layout():
    """Weights passed as a transposed view of ``[L, N, K]`` (stacked nn.Linear weights) get their gradient in that
    layout: each expert's ``[N, K]`` slice contiguous, equal to the gradient of contiguous weights."""
    gen = torch.Generator().manual_seed(3)
    counts = _random_counts(4, 30, gen, 1)
    x, grad_out = torch.randn(30, 16, generator=gen), torch.randn(30, 8, generator=gen)
    linear_layout = torch.randn(4, 8, 16, generator=gen)  # [L, N, K]
    grads = []
    for weight in (linear_layout.transpose(1, 2), linear_layout.transpose(1, 2).contiguous()):
        weight = weight.detach().requires_grad_(True)
        experts.grouped_linear(x, weight, counts, "grouped").backward(grad_out)
        grads.append(weight.grad)
    assert grads[0].transpose(1, 2).is_contiguous() and grads[1].is_contiguous()
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-6, atol=1e-5)
