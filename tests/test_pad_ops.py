"""``ops.pad`` (drop-and-pad's fixed-capacity layout) against plain loops over tokens on the CPU, where its torch ops
run (the definition the kernels match; tests/gpu/test_pad_gpu.py compares them): random maps and the edges (no tokens,
every token marking one expert, more marked tokens than the capacity, capacity 0 and T, invalid slots), and on the
kernel path at one rank, over the recording stand-in library, drop-and-pad's forward is three library calls and its
backward two more, with no torch kernel between them."""

from __future__ import annotations

import random

import pytest
import torch
from support.fake_kernels import FakeLib, installed
from torch.utils._python_dispatch import TorchDispatchMode

from moe_ep_plugin import Buffer
from moe_ep_plugin.launch import spawn
from moe_ep_plugin.megatron import drop_and_pad
from moe_ep_plugin.ops import pad


def _map(kind: str, tokens: int, experts: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "random":
        return torch.rand(tokens, experts, generator=gen) < 0.4
    rmap = torch.zeros(tokens, experts, dtype=torch.bool)
    if kind == "one_expert":
        rmap[:, 0] = True
    elif kind == "all":
        rmap[:] = True
    return rmap


def _loop_select(rmap: torch.Tensor, capacity: int) -> tuple[list[int], list[list[int]]]:
    """Each expert's marked tokens in order, then its unmarked ones, the first ``capacity`` taken."""
    tokens_n, experts = rmap.shape
    tokens, slot = [], [[-1] * experts for _ in range(tokens_n)]
    for e in range(experts):
        column = rmap[:, e].tolist()
        taken = ([t for t in range(tokens_n) if column[t]] + [t for t in range(tokens_n) if not column[t]])[:capacity]
        tokens += taken
        for c, t in enumerate(taken):
            slot[t][e] = e * capacity + c
    return tokens, slot


CASES = [  # (map kind, tokens, experts, capacity)
    ("random", 13, 5, 4),
    ("random", 9, 3, 9),  # capacity T: every token taken by every expert
    ("one_expert", 11, 4, 3),  # more marked tokens than the capacity (expert 0), none elsewhere
    ("all", 6, 3, 2),
    ("none", 7, 2, 0),  # capacity 0: no pairs
    ("none", 0, 3, 0),  # no tokens
]


@pytest.mark.parametrize("kind,tokens,experts,capacity", CASES)
def test_select_pairs_equals_a_loop(kind: str, tokens: int, experts: int, capacity: int) -> None:
    seed = random.randrange(2**31)
    rmap = _map(kind, tokens, experts, torch.Generator().manual_seed(seed))
    got_tokens, got_slot, got_experts = pad.select_pairs(rmap, capacity)
    want_tokens, want_slot = _loop_select(rmap, capacity)
    assert got_tokens.dtype == torch.int64 and got_tokens.tolist() == want_tokens, f"seed {seed}"
    assert got_slot.dtype == torch.int32 and got_slot.tolist() == want_slot, f"seed {seed}"
    assert got_experts.tolist() == [e for e in range(experts) for _ in range(capacity)]


def _loop_arrange(
    rows: torch.Tensor, probs: torch.Tensor | None, shape: tuple[int, int, int, int], tokens: list[int] | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Expert-major rows built one (expert, group, token) at a time, zeros after each expert's ``G * C``."""
    groups, local, capacity, block = shape
    out = torch.zeros(local * block, rows.shape[1], dtype=rows.dtype)
    out_probs = torch.zeros(local * block)
    for lo in range(local):
        for g in range(groups):
            for c in range(capacity):
                q = (g * local + lo) * capacity + c
                src = q if tokens is None else tokens[q]
                out[lo * block + g * capacity + c] = rows[src]
                if probs is not None:
                    out_probs[lo * block + g * capacity + c] = probs[q] if tokens is None else probs[src, lo]
    return out, None if probs is None else out_probs


@pytest.mark.parametrize("shape", [(1, 4, 3, 3), (1, 4, 3, 8), (3, 2, 2, 7), (2, 3, 0, 2), (2, 1, 5, 10)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_arrange_equals_a_loop(shape: tuple[int, int, int, int], dtype: torch.dtype) -> None:
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    groups, local, capacity, block = shape
    pairs = groups * local * capacity
    rows = torch.randn(pairs, 16, generator=gen).to(dtype)
    probs = torch.rand(pairs, generator=gen)
    out, out_probs = pad.arrange(rows, *shape, probs=probs)
    want, want_probs = _loop_arrange(rows, probs, shape, None)
    assert torch.equal(out, want) and torch.equal(out_probs, want_probs), f"seed {seed}"
    back, back_probs = pad.arrange(out, *shape, probs=out_probs, inverse=True)
    assert torch.equal(back, rows) and torch.equal(back_probs, probs), f"seed {seed}"
    assert pad.arrange(rows, *shape)[1] is None
    if groups == 1:  # a sender's pairs, read through their tokens
        tokens_n = 6
        x = torch.randn(tokens_n, 16, generator=gen).to(dtype)
        token_probs = torch.rand(tokens_n, local, generator=gen)
        tokens = torch.randint(tokens_n, (pairs,), generator=gen)
        out, out_probs = pad.arrange(x, *shape, tokens=tokens, probs=token_probs)
        want, want_probs = _loop_arrange(x, token_probs, shape, tokens.tolist())
        assert torch.equal(out, want) and torch.equal(out_probs, want_probs), f"seed {seed}"


def _loop_sum(
    rows: torch.Tensor, slot: torch.Tensor, capacity: int, block: int, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's valid pairs in column order, their rows summed in fp32 from 0.0, rounded once; the weights picked
    alike."""
    out = torch.zeros(slot.shape[0], rows.shape[1])
    out_weights = torch.zeros(slot.shape)
    for t in range(slot.shape[0]):
        acc = torch.zeros(rows.shape[1])
        for k in range(slot.shape[1]):
            p = int(slot[t, k])
            row = p // capacity * block + p % capacity
            if p >= 0 and row < rows.shape[0]:
                acc = acc + rows[row].float()
                out_weights[t, k] = 0.0 + float(weights[row])
        out[t] = acc
    return out.to(rows.dtype), out_weights


# (tokens, slots, rows, capacity, block)
SUM_CASES = [(9, 5, 12, 3, 3), (9, 5, 24, 3, 8), (4, 1, 3, 1, 1), (0, 3, 4, 2, 2), (5, 3, 0, 2, 4), (6, 40, 50, 5, 5)]


@pytest.mark.parametrize("tokens,slots,rows_n,capacity,block", SUM_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_sum_pairs_equals_a_loop(
    tokens: int, slots: int, rows_n: int, capacity: int, block: int, dtype: torch.dtype
) -> None:
    """Random pairs, some -1 (a dropped pair) and some past the rows (ignored), several per row."""
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    rows = (torch.randn(rows_n, 32, generator=gen) * 100).to(dtype)
    weights = torch.randn(rows_n, generator=gen)
    if rows_n:
        weights[0] = -0.0  # comes out +0.0, as a sum into zeros gives it
    slot = torch.randint(-1, rows_n + 2, (tokens, slots), generator=gen, dtype=torch.int32)
    out, out_weights = pad.sum_pairs(rows, slot, capacity, block, weights)
    want, want_weights = _loop_sum(rows, slot, capacity, block, weights)
    assert out.dtype == dtype and torch.equal(out.view(torch.uint8), want.view(torch.uint8)), f"seed {seed}"
    assert torch.equal(out_weights.view(torch.int32), want_weights.view(torch.int32)), f"seed {seed}"
    assert pad.sum_pairs(rows, slot, capacity, block)[1] is None


def test_bad_inputs_name_the_argument() -> None:
    rmap = torch.ones(4, 2, dtype=torch.bool)
    with pytest.raises(TypeError, match="routing_map: expected bool"):
        pad.select_pairs(rmap.int(), 2)
    with pytest.raises(ValueError, match="capacity: expected a non-negative int <= 4"):
        pad.select_pairs(rmap, 5)
    rows = torch.zeros(6, 8)
    with pytest.raises(ValueError, match="block: expected an int >= 6"):
        pad.arrange(rows, 2, 1, 3, 5)
    with pytest.raises(ValueError, match="tokens: only for the forward"):
        pad.arrange(rows, 1, 2, 3, 3, tokens=torch.zeros(6, dtype=torch.int64), inverse=True)
    with pytest.raises(TypeError, match="probs: expected torch.float32"):
        pad.arrange(rows, 1, 2, 3, 3, probs=torch.zeros(6, dtype=torch.float64))
    with pytest.raises(TypeError, match="slot: expected int32"):
        pad.sum_pairs(rows, torch.zeros(2, 2, dtype=torch.int64), 1, 1)
    with pytest.raises(ValueError, match="block: expected an int >= 3"):
        pad.sum_pairs(rows, torch.zeros(2, 2, dtype=torch.int32), 3, 2)
    with pytest.raises(ValueError, match="weights: expected shape \\[6\\]"):
        pad.sum_pairs(rows, torch.zeros(2, 2, dtype=torch.int32), 1, 1, torch.zeros(5))


class _TorchKernels(TorchDispatchMode):
    """Records the torch ops that would launch a kernel on CUDA (allocations and views launch none)."""

    _FREE = frozenset({"empty", "empty_strided", "empty_like", "view", "_unsafe_view", "unsqueeze", "squeeze", "t"})

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in self._FREE and name not in ("ones_like", "detach", "alias", "as_strided", "expand", "slice"):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def _three_kernels() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=gen).bfloat16().requires_grad_()
    probs = torch.rand(64, 8, generator=gen).requires_grad_()
    rmap = torch.rand(64, 8, generator=gen) < 0.3
    buffer = Buffer(transport="torch")  # local: a group of one rank
    lib = FakeLib(1)
    with installed(lib), _TorchKernels() as torch_ops:
        layout = drop_and_pad.pad_layout(rmap, 16, 1, 8)
        expert_x, expert_probs, handle = drop_and_pad.dispatch(buffer, x, probs, layout)
        out = drop_and_pad.combine(buffer, expert_x, handle, layout)
        forward = [name for name, _ in lib.calls]
        torch.autograd.backward([out, expert_probs], [torch.ones_like(out), torch.ones_like(expert_probs)])
    assert buffer.transport_name == "local" and handle is None and torch_ops.ops == [], torch_ops.ops
    assert forward == ["moe_ep_pad_select", "moe_ep_pad_arrange", "moe_ep_pad_sum"], forward
    assert [name for name, _ in lib.calls[3:]] == ["moe_ep_pad_arrange", "moe_ep_pad_sum"], lib.calls


def test_forward_at_one_rank_is_three_kernels() -> None:
    """The kernel path on the ``local`` transport (the stand-in library on CPU tensors): the pair selection, the
    gather into the expert-major rows and the token sums; in the backward the gather of the output's gradient, then
    the token sums of the rows' gradient. No torch op launches anything between them (the chain before the fusion:
    56 torch ops and 4 library calls forward, 95 in all with the backward)."""
    spawn(_three_kernels, 1, backend="gloo")
