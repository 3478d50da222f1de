"""Expert-major slots, permute and unpermute (torch path) against plain loops over rows, columns and experts."""

from __future__ import annotations

import random

import pytest
import torch

from moe_ep_plugin.ops import fp8
from moe_ep_plugin.ops.permute import expert_slots, permute, unpermute, unpermute_onto


def routing(kind: str, n: int, k: int, num_local: int, gen: torch.Generator) -> torch.Tensor:
    """``[n, k]`` int64 local ids as dispatch leaves them: distinct per row, -1 for experts on other ranks
    ("foreign" keeps those as ids >= ``num_local``, which must count as none too)."""
    if kind == "one_expert":
        idx = torch.full((n, k), -1, dtype=torch.int64)
        idx[:, torch.randint(k, (), generator=gen)] = 0
        return idx
    if kind == "none":
        return torch.full((n, k), -1, dtype=torch.int64)
    # "random": top-k over twice the local experts (the other half lives on another rank), some columns empty
    idx = torch.rand(n, 2 * num_local, generator=gen).topk(min(k, 2 * num_local), dim=1).indices
    idx = torch.cat([idx, torch.full((n, k - idx.shape[1]), -1, dtype=torch.int64)], dim=1)
    idx[((idx >= num_local) & (kind != "foreign")) | (torch.rand(n, k, generator=gen) < 0.1)] = -1
    return idx


def reference_slots(idx: torch.Tensor, num_local: int, alignment: int) -> tuple[torch.Tensor, list[int]]:
    """The contract's layout by loops: experts in order, rows then columns in order, blocks padded to alignment."""
    n, k = idx.shape
    slot = torch.full((n, k), -1, dtype=torch.int32)
    counts, row = [], 0
    for e in range(num_local):
        start = row
        for r in range(n):
            for j in range(k):
                if idx[r, j] == e:
                    slot[r, j] = row
                    row += 1
        row = start + -(-(row - start) // alignment) * alignment
        counts.append(row - start)
    return slot, counts


def reference_words(idx: torch.Tensor, num_local: int, alignment: int) -> list[int]:
    """``expert_slots``'s words by loops: rows naming a local expert, ids outside ``[-1, L)``, aligned counts."""
    rows = sum(any(0 <= e < num_local for e in row) for row in idx.tolist())
    invalid = sum(not -1 <= e < num_local for row in idx.tolist() for e in row)
    return [rows, invalid] + reference_slots(idx, num_local, alignment)[1]


def reference_permute(
    x: torch.Tensor, slot: torch.Tensor, num_rows: int, w: torch.Tensor, s: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out_x = torch.zeros(num_rows, x.shape[1], dtype=torch.uint8)
    out_w = torch.zeros(num_rows)
    out_s = torch.zeros(num_rows, s.shape[1])
    for r in range(slot.shape[0]):
        for j in range(slot.shape[1]):
            if 0 <= slot[r, j] < num_rows:
                out_x[slot[r, j]] = x[r]
                out_w[slot[r, j]] = w[r, j]
                out_s[slot[r, j]] = s[r]
    return out_x, out_w, out_s


def reference_unpermute(y: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(slot.shape[0], y.shape[1], dtype=y.dtype)
    for r in range(slot.shape[0]):
        acc = torch.zeros(y.shape[1], dtype=torch.float32)
        for j in range(slot.shape[1]):
            if 0 <= slot[r, j] < y.shape[0]:
                acc = acc + y[slot[r, j]].float()
        out[r] = acc.to(y.dtype)
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize(
    "n,k,num_local,alignment,kind,dtype",
    [
        (0, 2, 3, 1, "random", torch.float32),
        (13, 1, 4, 1, "random", torch.bfloat16),
        (17, 3, 4, 4, "random", torch.float32),
        (9, 8, 8, 3, "random", torch.bfloat16),
        (21, 4, 5, 16, "one_expert", torch.bfloat16),
        (6, 2, 3, 2, "none", torch.float32),
        (25, 6, 16, 1, "foreign", fp8.FP8_DTYPE),
        (11, 8, 2, 128, "random", fp8.FP8_DTYPE),
    ],
)
def test_layout_matches_loops(n: int, k: int, num_local: int, alignment: int, kind: str, dtype: torch.dtype) -> None:
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    idx = routing(kind, n, k, num_local, gen)
    ref_slot, counts = reference_slots(idx, num_local, alignment)
    num_rows = sum(counts)
    hidden, num_scales = 256, 2
    x = (torch.randn(n, hidden, generator=gen) * 100).to(dtype)
    w = torch.rand(n, k, generator=gen)
    s = torch.rand(n, num_scales, generator=gen)

    slot, words = expert_slots(idx, num_local, alignment)
    assert slot.dtype == torch.int32 and torch.equal(slot, ref_slot), f"seed {seed}"
    assert words.tolist()[2:] == counts, f"seed {seed}"

    px, probs, scales = permute(x, slot, num_rows, w, s)
    ref_x, ref_w, ref_s = reference_permute(bits(x), slot, num_rows, w, s)
    assert px.dtype == dtype and px.shape == (num_rows, hidden)
    assert torch.equal(bits(px), ref_x) and torch.equal(probs, ref_w) and torch.equal(scales, ref_s), f"seed {seed}"
    assert permute(x, slot, num_rows)[1:] == (None, None)

    out_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    y = torch.randn(num_rows, hidden, generator=gen).to(out_dtype)
    back = unpermute(y, slot)
    assert back.dtype == out_dtype and torch.equal(bits(back), bits(reference_unpermute(y, slot))), f"seed {seed}"
    out = torch.full((n, hidden), 7.0, dtype=out_dtype)
    assert unpermute(y, slot, out=out) is out and torch.equal(bits(out), bits(back)), f"seed {seed}"


@pytest.mark.parametrize("kind", ["random", "foreign", "one_expert", "none"])
def test_expert_slots_words_match_loops(kind: str) -> None:
    """The words a one-rank dispatch reads, with ids below -1 and past the local experts among the routing."""
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    n, k, num_local, alignment = int(torch.randint(0, 40, (), generator=gen)), 5, 6, 4
    idx = routing(kind, n, k, num_local, gen)
    idx[torch.rand(n, k, generator=gen) < 0.05] = -7
    slot, words = expert_slots(idx, num_local, alignment)
    assert words.dtype == torch.int64 and words.tolist() == reference_words(idx, num_local, alignment), f"seed {seed}"
    assert torch.equal(slot, reference_slots(idx, num_local, alignment)[0]), f"seed {seed}"


def test_out_of_range_ids_and_slots_are_ignored() -> None:
    idx = torch.tensor([[0, 5], [-3, 1], [2, 0]])  # 5 is past the 3 local experts, -3 is no expert
    slot, words = expert_slots(idx, 3, 1)
    assert slot.tolist() == [[0, -1], [-1, 2], [3, 1]] and words.tolist() == [3, 2, 2, 1, 1]
    x = torch.arange(12.0).view(3, 4)
    bad = torch.tensor([[0, 7], [-2, 2], [1, 3]], dtype=torch.int32)  # 7 and 3 >= num_rows: dropped like -2
    px, probs, _ = permute(x, bad, 3, torch.arange(6.0).view(3, 2))
    assert torch.equal(px, x[[0, 2, 1]]) and probs.tolist() == [0.0, 4.0, 3.0]
    y = torch.arange(9.0).view(3, 3)
    assert torch.equal(unpermute(y, bad), y[[0, 2, 1]])
    assert unpermute(y[:0], bad).tolist() == [[0.0] * 3] * 3  # no rows at all: every slot is out of range


def test_arguments_are_validated() -> None:
    idx = torch.zeros(3, 2, dtype=torch.int64)
    with pytest.raises(TypeError, match="recv_topk_idx"):
        expert_slots(idx.int(), 1, 1)
    with pytest.raises(ValueError, match="recv_topk_idx"):
        expert_slots(idx[0], 1, 1)
    with pytest.raises(ValueError, match="alignment"):
        expert_slots(idx, 1, 0)
    with pytest.raises(ValueError, match="num_local_experts"):
        expert_slots(idx, 0, 1)
    with pytest.raises(TypeError, match="num_local_experts"):
        expert_slots(idx, [3], 1)
    x, slot = torch.zeros(3, 4), torch.zeros(3, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="recv_x"):
        permute(x[0], slot, 1)
    with pytest.raises(ValueError, match="recv_slot"):
        permute(x, torch.zeros(4, 2, dtype=torch.int32), 1)  # more slot rows than rows
    with pytest.raises(TypeError, match="recv_slot"):
        permute(x, slot.long(), 1)
    with pytest.raises(ValueError, match="num_rows"):
        permute(x, slot, -1)
    with pytest.raises(TypeError, match="num_rows"):
        permute(x, slot, True)
    with pytest.raises(ValueError, match="recv_weights"):
        permute(x, slot, 1, torch.zeros(3, 3))
    with pytest.raises(TypeError, match="recv_weights"):
        permute(x, slot, 1, torch.zeros(3, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="recv_scales"):
        permute(x, slot, 1, None, torch.zeros(2, 1))
    with pytest.raises(TypeError, match="y"):
        unpermute(x.to(fp8.FP8_DTYPE), slot)
    with pytest.raises(ValueError, match="recv_slot"):
        unpermute(x, slot[:, :0])
    with pytest.raises(ValueError, match="out"):
        unpermute(x, slot, out=torch.zeros(3, 4, dtype=torch.bfloat16))


def test_not_differentiable_on_any_path() -> None:
    x = torch.randn(4, 16, requires_grad=True)
    slot, _ = expert_slots(torch.tensor([[0], [1], [0], [-1]]), 2, 1)
    px, _, _ = permute(x, slot, 3)
    assert not px.requires_grad and not unpermute(px.detach().requires_grad_(), slot).requires_grad


def test_unpermute_onto_adds_valid_slots_in_column_order() -> None:
    """From a start row (a combine's biases), each valid slot's row in column order, fp32 step by step; a slot
    outside ``[0, M)`` adds nothing, not even +0.0 (a -0.0 start stays -0.0)."""
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    m, n, k, h = 6, 5, 3, 16
    y = torch.randn(m, h, generator=gen).bfloat16()
    slot = torch.randint(-1, m + 1, (n, k), generator=gen, dtype=torch.int32)  # -1 and m: no row
    slot[0] = -1
    start = torch.randn(n, h, generator=gen)
    start[0] = -0.0
    got = unpermute_onto(start, y, slot)
    for t in range(n):
        want = start[t].clone()
        for j in range(k):
            if 0 <= int(slot[t, j]) < m:
                want = want + y[int(slot[t, j])].float()
        assert torch.equal(got[t].view(torch.int32), want.view(torch.int32))
    assert bool(torch.signbit(got[0]).all()) and torch.equal(start[0], torch.full((h,), -0.0))


def test_permute_reads_the_first_n_rows_of_a_larger_buffer() -> None:
    """A receive buffer holding more rows than ``recv_slot`` names (a transport's guess): rows from N on are not
    read, on the rows and on their scales."""
    x, s = torch.arange(20.0).view(5, 4), torch.arange(10.0).view(5, 2)
    slot = torch.tensor([[1], [0]], dtype=torch.int32)
    px, probs, ps = permute(x, slot, 3, None, s)
    assert px.tolist() == [x[1].tolist(), x[0].tolist(), [0.0] * 4] and probs is None
    assert ps.tolist() == [s[1].tolist(), s[0].tolist(), [0.0] * 2]
