"""Expert-major permutation against a plain loop over rows and experts."""
from __future__ import annotations

import pytest
import torch

from moe_ep_plugin.permute import RowMap, permute, unpermute


def _random_routing(n: int, k: int, experts: int, gen: torch.Generator) -> torch.Tensor:
    idx = torch.full((n, k), -1, dtype=torch.int64)
    for r in range(n):
        picked = torch.randperm(experts, generator=gen)[:k]
        keep = torch.rand(picked.numel(), generator=gen) > 0.3
        idx[r, :int(keep.sum())] = picked[keep]
    return idx


@pytest.mark.parametrize("n,k,experts,alignment", [(0, 2, 3, 1), (13, 1, 4, 1), (17, 3, 4, 4), (9, 8, 8, 3), (5, 2, 1, 2)])
def test_permute_matches_loop(n: int, k: int, experts: int, alignment: int) -> None:
    gen = torch.Generator().manual_seed(n * 7 + k)
    x = torch.randn(n, 16, generator=gen, requires_grad=True)
    idx = _random_routing(n, k, experts, gen)
    w = torch.rand(n, k, generator=gen)
    counts = [int((idx == e).sum()) for e in range(experts)]
    aligned = [(c + alignment - 1) // alignment * alignment for c in counts]

    px, probs, tokens_per_expert, row_map = permute(x, idx, w, experts, aligned, alignment)

    ref_rows, ref_probs = [], []
    for e in range(experts):
        for r in range(n):
            for j in range(k):
                if idx[r, j] == e:
                    ref_rows.append(x[r].detach())
                    ref_probs.append(float(w[r, j]))
        ref_rows += [torch.zeros(16)] * (aligned[e] - counts[e])
        ref_probs += [0.0] * (aligned[e] - counts[e])
    assert tokens_per_expert.tolist() == aligned and tokens_per_expert.device.type == "cpu"
    assert torch.equal(px.detach(), torch.stack(ref_rows) if ref_rows else torch.zeros(0, 16))
    assert probs.tolist() == pytest.approx(ref_probs, abs=0)

    out = torch.randn(px.shape, generator=gen)
    back = unpermute(out, row_map)
    expected = torch.zeros(n, 16)
    pos = 0
    for e in range(experts):
        for r in range(n):
            for j in range(k):
                if idx[r, j] == e:
                    expected[r] += out[pos]
                    pos += 1
        pos += aligned[e] - counts[e]
    torch.testing.assert_close(back, expected, rtol=0, atol=1e-6)
    # summing in the input dtype: BF16 rows give the loop's sums up to BF16 rounding
    back16 = unpermute(out.bfloat16(), row_map, fp32_accumulation=False)
    assert back16.dtype == torch.bfloat16
    torch.testing.assert_close(back16.float(), expected, rtol=2e-2, atol=2e-2)

    # gradient of sum(unpermute(permute(x) * 2)) wrt x = 2 · (number of local experts of each row)
    unpermute(px * 2, row_map).sum().backward()
    per_row = (idx >= 0).sum(1, keepdim=True).float() * 2
    torch.testing.assert_close(x.grad, per_row.expand(n, 16))


def test_permute_validates_arguments() -> None:
    x, idx = torch.zeros(3, 4), torch.zeros(3, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="num_tokens_per_expert"):
        permute(x, idx, None, 2, [6], 1)
    with pytest.raises(ValueError, match="recv_topk_idx"):
        permute(x, idx[:2], None, 1, [6], 1)
    with pytest.raises(ValueError, match="alignment"):
        permute(x, idx, None, 1, [6], 0)
    with pytest.raises(ValueError, match="multiples of alignment"):
        permute(x, idx, None, 1, [6], 4)
    with pytest.raises(TypeError, match="row_map"):
        unpermute(x, "not a map")
    with pytest.raises(ValueError, match="expert_out"):
        unpermute(x, RowMap(torch.zeros(5, dtype=torch.int64), 3, False))
