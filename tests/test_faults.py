"""Buffer faults across ranks (issue 14 items 1–4) on the torch transport with 2–3 gloo ranks: ranks that disagree
on a dispatch's shape, layouts that contradict top-k, a too small ``num_worst_tokens``, bad constructor
arguments. Every rank must raise the same clear error before any row moves, and the group must stay usable."""

from __future__ import annotations

import re
import time

import pytest
import torch
import torch.distributed as dist
from support.reference import expected_dispatch, gather_all, routing

from moe_ep_plugin import Buffer
from moe_ep_plugin.deep_ep import ElasticBuffer
from moe_ep_plugin.launch import spawn

TIMEOUT_S = 20.0


def _healthy(buffer: Buffer, seed: int, experts_per_rank: int = 2) -> None:
    """A correct dispatch + combine after a fault: exact against the plain loop (the group is not dead)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(seed + rank)
    num_experts, n = experts_per_rank * world, 5 + rank
    x = torch.randn(n, 32, generator=gen)
    idx = routing("random", n, 2, num_experts, gen)
    xs, idxs = zip(*gather_all((x, idx)), strict=False)
    recv_x, _, _, counts, handle, _ = buffer.dispatch(x, topk_idx=idx, num_experts=num_experts)
    rows, _, _, _, ref_counts = expected_dispatch(xs, idxs, [None] * world, num_experts, rank, world)
    assert counts == ref_counts and recv_x.shape[0] == len(rows)
    if rows:
        assert torch.equal(recv_x, torch.stack(rows))
    combined = buffer.combine(recv_x, handle)[0]
    copies = torch.tensor([len({e // experts_per_rank for e in row if e >= 0}) for row in idx.tolist()], dtype=x.dtype)
    assert torch.equal(combined, x * copies.reshape(n, 1))  # each token's copies summed once per rank it went to


def _raises_everywhere(call, needle: str) -> None:
    start = time.monotonic()
    with pytest.raises(ValueError, match=needle):
        call()
    assert time.monotonic() - start < TIMEOUT_S  # raised at the exchange, not by a timeout


def _disagreeing_ranks() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    odd = rank == world - 1  # the last rank differs
    buffer = Buffer(transport="torch", timeout_s=TIMEOUT_S)
    gen = torch.Generator().manual_seed(11 + rank)
    n = 6
    x = torch.randn(n, 128, generator=gen).bfloat16()
    idx = routing("random", n, 2, 2 * world, gen)
    w = torch.rand(n, 2, generator=gen)
    last = rf"rank\(s\) \[{world - 1}\] differ from rank 0"
    cases = [
        ("num_experts", lambda: buffer.dispatch(x, topk_idx=idx, num_experts=(4 if odd else 2) * world)),
        ("hidden", lambda: buffer.dispatch(x[:, :64] if odd else x, topk_idx=idx, num_experts=2 * world)),
        ("x dtype", lambda: buffer.dispatch(x.float() if odd else x, topk_idx=idx, num_experts=2 * world)),
        ("top-k width", lambda: buffer.dispatch(x, topk_idx=idx[:, :1] if odd else idx, num_experts=2 * world)),
        (
            "topk_weights given",
            lambda: buffer.dispatch(x, topk_idx=idx, topk_weights=None if odd else w, num_experts=2 * world),
        ),
        ("FP8 rows on the wire", lambda: buffer.dispatch(x, topk_idx=idx, num_experts=2 * world, fp8_dispatch=odd)),
        ("num_experts", lambda: buffer.dispatch_experts(x, idx, None, (4 if odd else 2) * world)),
        ("hidden", lambda: buffer.dispatch_experts(x[:, :64] if odd else x, idx, w, 2 * world)),
    ]
    for field, call in cases:
        _raises_everywhere(call, rf"dispatch: the ranks disagree on {field}: {last} \({field}: rank 0 ")
    # several fields at once are all named
    _raises_everywhere(
        lambda: buffer.dispatch(x.float()[:, :64] if odd else x, topk_idx=idx, num_experts=2 * world),
        rf"disagree on hidden, x dtype: {last}",
    )
    _healthy(buffer, 1)
    # more experts than the count exchange carries inline (a second exchange), after a disagreement on them
    _raises_everywhere(
        lambda: buffer.dispatch(x, topk_idx=idx, num_experts=(200 if odd else 150) * world),
        rf"disagree on num_experts: {last}",
    )
    _healthy(buffer, 2, experts_per_rank=150)


def _contradicting_layouts() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    buffer = Buffer(transport="torch", timeout_s=TIMEOUT_S)
    gen = torch.Generator().manual_seed(23 + rank)
    num_experts, n = 2 * world, 8
    x = torch.randn(n, 16, generator=gen)
    idx = routing("random", n, 2, num_experts, gen)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, num_experts)
    one = rank == 1
    wrong_count = per_rank + 3 if one else per_rank  # wrong on rank 1 only
    none_in_rank = torch.zeros_like(in_rank)  # all False, with the counts of the real layout
    flipped = in_rank.clone()
    flipped[0] = ~flipped[0]
    flipped_counts = flipped.sum(0, dtype=torch.int32)  # consistent with itself, contradicting top-k
    cases = [
        (wrong_count, in_rank, "[1]"),
        (per_rank, none_in_rank if one else in_rank, "[1]"),
        (flipped_counts, flipped, str(list(range(world)))),
    ]
    for counts, layout, ranks in cases:
        _raises_everywhere(
            lambda c=counts, lay=layout: buffer.dispatch(
                x, num_tokens_per_rank=c, is_token_in_rank=lay, num_tokens_per_expert=per_expert, topk_idx=idx
            ),
            "num_tokens_per_rank/is_token_in_rank: on " + re.escape(f"rank(s) {ranks} "),
        )
    # without top-k only the counts can be checked: they must be is_token_in_rank.sum(0)
    _raises_everywhere(
        lambda: buffer.dispatch(
            x, num_tokens_per_rank=wrong_count, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert
        ),
        r"on rank\(s\) \[1\]",
    )
    # the layout get_dispatch_layout returned passes
    got = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx
    )[0]
    assert got.shape[0] == int(sum(counts[rank] for counts in gather_all(per_rank)))

    # num_worst_tokens smaller than the rows a rank receives: every rank raises, naming the rank(s) short
    received = [int(sum(r[j] for r in gather_all(per_rank))) for j in range(world)]
    worst = 1 if rank == 0 else 10**4
    if received[0] > 1:
        _raises_everywhere(
            lambda: buffer.dispatch(x, topk_idx=idx, num_experts=num_experts, num_worst_tokens=worst),
            rf"num_worst_tokens: smaller than the rows a rank receives \(rank 0: {received[0]} rows, "
            r"num_worst_tokens=1\)",
        )
    out = buffer.dispatch(x, topk_idx=idx, num_experts=num_experts, num_worst_tokens=max(received))
    assert out[0].shape[0] == max(received) and out[3] == []
    _healthy(buffer, 2)


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_that_disagree_raise_on_every_rank(world: int) -> None:
    spawn(_disagreeing_ranks, world, backend="gloo", timeout_s=120)


@pytest.mark.parametrize("world", [2, 3])
def test_layouts_that_contradict_topk_raise_on_every_rank(world: int) -> None:
    spawn(_contradicting_layouts, world, backend="gloo", timeout_s=120)


def _negative_counts_then_destroy(buffer: Buffer) -> None:
    """A negative ``num_tokens_per_rank`` on rank 1: every rank raises naming the argument and that rank (before:
    an ``index -13 is out of bounds`` RuntimeError on the rank computing its send order). Then ``buffer`` is
    destroyed and refuses every call."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(31 + rank)
    x = torch.randn(6, 16, generator=gen)
    idx = routing("random", 6, 2, 2 * world, gen)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, 2 * world)
    for column in range(world):
        counts = per_rank.clone()
        if rank == 1:
            counts[column] = -13
        _raises_everywhere(
            lambda c=counts: buffer.dispatch(
                x, num_tokens_per_rank=c, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx
            ),
            r"num_tokens_per_rank: counts must be >= 0; rank\(s\) \[1\] passed negative ones",
        )
    if buffer.transport_name == "torch":
        _healthy(buffer, 3)
    buffer.destroy()
    assert buffer.destroyed
    calls = [
        lambda: buffer.dispatch(x, topk_idx=idx, num_experts=2 * world),
        lambda: buffer.get_dispatch_layout(idx, 2 * world),
        lambda: buffer.dispatch_experts(x, idx, None, 2 * world),
        lambda: buffer.low_latency_dispatch(x.bfloat16(), idx, 8, 2 * world),
    ]
    for call in calls:
        with pytest.raises(RuntimeError, match=r"Buffer: used after destroy\(\)"):
            call()


def _negative_counts_on_both_transports() -> None:
    _negative_counts_then_destroy(Buffer(transport="torch", timeout_s=TIMEOUT_S))
    _negative_counts_then_destroy(Buffer(transport="hierarchical", ranks_per_node=1, timeout_s=TIMEOUT_S))


@pytest.mark.parametrize("world", [2, 3])
def test_negative_counts_and_a_destroyed_buffer(world: int) -> None:
    spawn(_negative_counts_on_both_transports, world, backend="gloo", timeout_s=120)


def _one_rank_bad_input(transport: str, ranks_per_node: int | None) -> None:
    """Bad input on the last rank only, in a fresh dispatch (both forms, and DeepEP V2's ``ElasticBuffer.dispatch``)
    or the layout before one: every rank raises the cause with its class, naming that rank, at the count exchange
    (not after a timeout); the group stays usable."""
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = rank == world - 1
    buffer = Buffer(transport=transport, ranks_per_node=ranks_per_node, timeout_s=TIMEOUT_S)
    gen = torch.Generator().manual_seed(41 + rank)
    num_experts, n = 2 * world, 6
    x = torch.randn(n, 32, generator=gen).bfloat16()
    idx = routing("random", n, 2, num_experts, gen)
    w = torch.rand(n, 2, generator=gen)
    cases = [
        (
            TypeError,
            "x: expected dtype",
            lambda: buffer.dispatch(x.double() if bad else x, topk_idx=idx, num_experts=num_experts),
        ),
        (
            ValueError,
            "topk_idx: expected shape",
            lambda: buffer.dispatch(x, topk_idx=idx[:3] if bad else idx, num_experts=num_experts),
        ),
        (
            TypeError,
            "topk_weights: expected dtype",
            lambda: buffer.dispatch(x, topk_idx=idx, topk_weights=w.double() if bad else w, num_experts=num_experts),
        ),
        (ValueError, "num_experts: ", lambda: buffer.dispatch(x, topk_idx=idx, num_experts=0 if bad else num_experts)),
        (
            TypeError,
            "x: expected dtype",
            lambda: buffer.dispatch_experts(x.double() if bad else x, idx, w, num_experts),
        ),
    ]

    def layout_then_dispatch():
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx.float() if bad else idx, num_experts)
        return buffer.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx
        )

    cases.append((TypeError, "get_dispatch_layout: topk_idx: expected dtype", layout_then_dispatch))
    # DeepEP V2's ElasticBuffer checks its own arguments before its Buffer's dispatch: refused alike
    elastic = ElasticBuffer(
        dist.group.WORLD,
        num_max_tokens_per_rank=n,
        hidden=32,
        num_topk=2,
        transport=transport,
        ranks_per_node=ranks_per_node,
        num_cpu_timeout_secs=TIMEOUT_S,
    )
    x2, idx2 = torch.cat([x, x]), torch.cat([idx, idx])
    cases += [
        (
            ValueError,
            f"x: {2 * n} tokens, more than num_max_tokens_per_rank={n}",
            lambda: elastic.dispatch(x2 if bad else x, topk_idx=idx2 if bad else idx, num_experts=num_experts),
        ),
        (
            ValueError,
            "num_sms: expected a non-negative int",
            lambda: elastic.dispatch(x, topk_idx=idx, num_experts=num_experts, num_sms=-1 if bad else 0),
        ),
    ]
    for cls, cause, call in cases:
        start = time.monotonic()
        with pytest.raises(
            cls, match=re.escape(f"dispatch: rank(s) [{world - 1}] refused the call (rank {world - 1}: {cause}")
        ):
            call()
        assert time.monotonic() - start < TIMEOUT_S  # the cause, not a peer's timeout
    _healthy(buffer, 5)
    recv_x = elastic.dispatch(x, topk_idx=idx, num_experts=num_experts)[0]
    assert recv_x.shape[0] == sum(int((i // 2 == rank).any(1).sum()) for i in gather_all(idx)), "ElasticBuffer usable"


@pytest.mark.parametrize(
    "transport,world,ranks_per_node",
    [("torch", 2, None), ("torch", 3, None), ("hierarchical", 2, 1), ("hierarchical", 4, 2)],
)
def test_bad_input_on_one_rank_raises_the_cause_on_every_rank(
    transport: str, world: int, ranks_per_node: int | None
) -> None:
    spawn(_one_rank_bad_input, world, args=(transport, ranks_per_node), backend="gloo", timeout_s=120)


def _constructor_arguments() -> None:
    for bad in ("10", True, None.__class__):
        with pytest.raises(TypeError, match="timeout_s: expected a number of seconds"):
            Buffer(transport="torch", timeout_s=bad)
    with pytest.raises(ValueError, match="timeout_s"):
        Buffer(transport="torch", timeout_s=-1)
    assert Buffer(transport="torch", timeout_s=3).timeout_s == 3


def test_constructor_arguments() -> None:
    spawn(_constructor_arguments, 1, backend="gloo")
