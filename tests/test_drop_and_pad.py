"""Drop-and-pad's fixed-capacity dispatch and combine (``megatron/drop_and_pad.py``) on gloo ranks against plain loops:
each expert takes the first ``C`` tokens of its column in a stable descending sort (``alltoall``'s permute), so maps
with more or fewer marked tokens than ``C`` are covered too; every local expert gets exactly ``G * C`` rows
(source rank, then token), padded to the alignment; the combine sums each token's pair rows in fp32 in expert
order. Gradients of the tokens and of the probs are checked exactly (integer-valued upstream gradients). World
sizes 1–4 on the ``torch`` transport (``local`` at one rank), 2 x 2 emulated nodes on ``hierarchical``, BF16 and FP32,
FP8 rows. At one rank the whole path, backward included, reads nothing on the host (``support.host_reads``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from support.host_reads import no_host_reads
from support.reference import gather_all

from moe_ep_plugin import Buffer
from moe_ep_plugin.launch import spawn
from moe_ep_plugin.megatron import drop_and_pad
from moe_ep_plugin.ops import fp8

HIDDEN = 128


def _routing_map(kind: str, tokens: int, experts: int, gen: torch.Generator) -> torch.Tensor:
    """``random``: about a third of the pairs marked (experts with more and fewer than C); ``one_expert``: every
    token marks expert 0 only; ``none``: no token marks anything (every row is padding)."""
    if kind == "random":
        return torch.rand(tokens, experts, generator=gen) < 0.35
    rmap = torch.zeros(tokens, experts, dtype=torch.bool)
    if kind == "one_expert":
        rmap[:, 0] = True
    return rmap


def _expert_tokens(rmap: torch.Tensor, e: int, capacity: int) -> list[int]:
    """The ``capacity`` tokens expert ``e`` takes: its marked tokens in order, then the unmarked ones in order."""
    column = rmap[:, e].tolist()
    return ([t for t, m in enumerate(column) if m] + [t for t, m in enumerate(column) if not m])[:capacity]


def _case(
    world: int,
    transport: str,
    ranks_per_node: int | None,
    dtype: torch.dtype,
    kind: str,
    capacity: int,
    alignment: int,
    use_fp8: bool,
    seed: int,
) -> None:
    rank = dist.get_rank()
    experts_per_rank, tokens = 3, 7
    experts = experts_per_rank * world
    gen = torch.Generator().manual_seed(seed * 101 + rank)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(dtype).requires_grad_()
    probs = torch.rand(tokens, experts, generator=gen).requires_grad_()
    rmap = _routing_map(kind, tokens, experts, gen)
    buffer = Buffer(transport=transport, ranks_per_node=ranks_per_node)
    layout = drop_and_pad.pad_layout(rmap, capacity, world, alignment)
    expert_x, expert_probs, handle = drop_and_pad.dispatch(buffer, x, probs, layout, fp8_dispatch=use_fp8)

    xs, maps, ps = gather_all(x.detach()), gather_all(rmap), gather_all(probs.detach())
    if use_fp8:  # what a sender's quantizer delivers
        xs = [fp8.dequantize(*fp8.quantize(t), t.dtype) for t in xs]
    block = -(-world * capacity // alignment) * alignment
    assert layout.block == block and expert_x.shape == (experts_per_rank * block, HIDDEN)
    sources = []  # (source rank, token, global expert) of every expert-major row, None for padding
    for le in range(experts_per_rank):
        e = rank * experts_per_rank + le
        rows = [(s, t, e) for s in range(world) for t in _expert_tokens(maps[s], e, capacity)]
        sources += rows + [None] * (block - len(rows))
    zero = torch.zeros(HIDDEN, dtype=dtype)
    assert torch.equal(expert_x.detach(), torch.stack([zero if p is None else xs[p[0]][p[1]] for p in sources]))
    assert torch.equal(
        expert_probs.detach(), torch.tensor([0.0 if p is None else float(ps[p[0]][p[1], p[2]]) for p in sources])
    )

    # Experts scale each row by an integer; the combine sums each token's rows in fp32 in expert order.
    scale = torch.arange(1, expert_x.shape[0] + 1, dtype=torch.float32).remainder(5).sub(2).to(dtype)
    y = expert_x * scale.unsqueeze(1)
    out = drop_and_pad.combine(buffer, y, handle, layout)
    ys, scales = gather_all(y.detach()), gather_all(scale)
    expected = torch.zeros(tokens, HIDDEN)
    for e in range(experts):  # expert order: the pairs of token t are summed in that order
        dest, le = divmod(e, experts_per_rank)
        for j, t in enumerate(_expert_tokens(maps[rank], e, capacity)):
            expected[t] += ys[dest][le * block + rank * capacity + j].float()
    assert out.dtype == dtype and torch.equal(out.detach(), expected.to(dtype))

    # Gradients (integers, so every sum is exact): d out -> each pair row; d expert_probs -> the probs it came from.
    grad_out = torch.randint(-3, 4, (tokens, HIDDEN), generator=gen).to(dtype)
    grad_probs = torch.randint(-3, 4, (expert_probs.shape[0],), generator=gen).float()
    torch.autograd.backward([out, expert_probs], [grad_out, grad_probs])
    grad_outs, grad_ps = gather_all(grad_out), gather_all(grad_probs)
    expected_x = torch.zeros(tokens, HIDDEN)
    expected_p = torch.zeros(tokens, experts)
    for e in range(experts):
        dest, le = divmod(e, experts_per_rank)
        for j, t in enumerate(_expert_tokens(maps[rank], e, capacity)):
            row = le * block + rank * capacity + j
            expected_x[t] += grad_outs[rank][t].float() * scales[dest][row].float()
            expected_p[t, e] += grad_ps[dest][row]
    assert torch.equal(x.grad, expected_x.to(dtype)) and torch.equal(probs.grad, expected_p)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_fixed_rows_equal_a_plain_loop(world: int) -> None:
    spawn(_suite, world, args=(world, "torch", None), backend="gloo")


def test_emulated_nodes() -> None:
    spawn(_suite, 4, args=(4, "hierarchical", 2), backend="gloo")


def _suite(world: int, transport: str, ranks_per_node: int | None) -> None:
    cases = [
        (torch.bfloat16, "random", 2, 1, False),
        (torch.float32, "random", 4, 3, False),
        (torch.bfloat16, "one_expert", 3, 4, False),
        (torch.float32, "none", 1, 1, False),
        (torch.bfloat16, "random", 2, 2, True),
    ]
    for seed, (dtype, kind, capacity, alignment, use_fp8) in enumerate(cases):
        _case(world, transport, ranks_per_node, dtype, kind, capacity, alignment, use_fp8, seed)


def _unequal_capacity() -> None:
    """A rank whose capacity differs from the others' sends more (or fewer) rows than the fixed layout holds."""
    rank = dist.get_rank()
    rmap = torch.ones(4, 4, dtype=torch.bool)
    layout = drop_and_pad.pad_layout(rmap, 3 if rank == 0 else 2, 2, 1)
    with pytest.raises(ValueError, match="num_worst_tokens"):
        drop_and_pad.dispatch(Buffer(transport="torch"), torch.randn(4, HIDDEN), torch.rand(4, 4), layout)


def test_unequal_capacities_raise_on_every_rank() -> None:
    spawn(_unequal_capacity, 2, backend="gloo")


def test_capacity_beyond_the_tokens_raises() -> None:
    with pytest.raises(ValueError, match="moe_expert_capacity_factor: a capacity of 5 tokens per expert needs 1 to 4"):
        drop_and_pad.pad_layout(torch.ones(4, 2, dtype=torch.bool), 5, 1, 1)


def _reads_nothing() -> None:
    """One rank (``local``): the layout, dispatch, combine and backward of every row form with each way a tensor
    reaches a Python value patched to raise."""
    for seed, (dtype, use_fp8) in enumerate(
        [(torch.bfloat16, False), (torch.float16, False), (torch.float32, False), (torch.bfloat16, True)]
    ):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(7, HIDDEN, generator=gen).to(dtype).requires_grad_()
        probs = torch.rand(7, 6, generator=gen).requires_grad_()
        rmap = _routing_map("random", 7, 6, gen)
        buffer = Buffer(transport="torch")
        with no_host_reads():
            layout = drop_and_pad.pad_layout(rmap, 3, 1, 4)
            expert_x, expert_probs, handle = drop_and_pad.dispatch(buffer, x, probs, layout, fp8_dispatch=use_fp8)
            out = drop_and_pad.combine(buffer, expert_x * 2, handle, layout)
            torch.autograd.backward((out, expert_probs), (torch.ones_like(out), torch.ones_like(expert_probs)))
        assert buffer.transport_name == "local" and x.grad.shape == x.shape and probs.grad.shape == probs.shape


def test_one_rank_reads_nothing_on_the_host() -> None:
    spawn(_reads_nothing, 1, backend="gloo")
