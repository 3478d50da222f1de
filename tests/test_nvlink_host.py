"""NVLinkTransport's host logic on CPU, over a stand-in kernel library: the host reads each dispatch and combine
makes, the inputs each kernel is handed (sizes, flags: the ones ``plan`` decides, tested on their own at the end),
the orderings correctness needs (a count read before the launch sized by it, a barrier before the own region is
written), and that every address a kernel is handed is one an earlier call wrote or a returned tensor covers.

The transport's Python side only runs on GPUs, so nothing else in CI executes it. Here it runs on CPU tensors (their
addresses serve the bookkeeping as well as device ones) over a fake library (``tests/support/fake_kernels.py``) that
records every call and answers the one host read of a dispatch with counts the test chooses; ``permute``'s kernels go
through the same fake. What the kernels compute is tests/gpu's business.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from unittest import mock

import pytest
import torch
from support.fake_kernels import CTX, STREAM, FakeLib, installed, nvlink_transport

from moe_ep_plugin.config import Config, NVLinkTuning
from moe_ep_plugin.handle import DispatchHandle
from moe_ep_plugin.ops import library, permute
from moe_ep_plugin.transports.base import DispatchArgs
from moe_ep_plugin.transports.nvlink import NVLinkTransport
from moe_ep_plugin.transports.nvlink.plan import (
    Roles,
    combine_roles,
    dispatch_roles,
    most_received,
    send_blocks,
)

# at(i, offset=0): address of int32 element `offset` of notify's output i (0 rank prefix matrix, then info; 1
# send_offset; 2 send_pos; 3 send_list; 4 expert_pos), or of the guessed receive metadata (5 recv_src_idx, 6
# recv_slot), as the recorded calls name them
At = Callable[..., int]

# The scenario: rank 1 of 2, 5 tokens of hidden 64 in BF16 (rows of 128 bytes), top-2 of 4 experts (2 local),
# expert blocks aligned to 4 rows.
R, ME, N, H, K, E, ALIGNMENT = 2, 1, 5, 64, 2, 4, 4
L = E // R
TOPK = [[0, 3], [2, -1], [1, 2], [3, 0], [-1, 2]]
# 24 SMs: the copy engines stay off (below 20 by default); push dispatches get 5 sender warps, so that they differ
# from pull_dispatch_send_warps and the record tells which the host chose
TUNING = NVLinkTuning(dispatch_send_warps=5)
CONFIG = Config(num_sms=24, nvlink=TUNING)
# rows rank i sends to rank j (host_counts[i * R + j]) and their inclusive prefix over source ranks: rank 1 receives
# 4 + 5 = 9 rows, rank 0 3 + 2 = 5
COUNTS = [3, 4, 2, 5]
PREFIX = [3, 4, 5, 9]
NUM_RECV = 9
TOKENS_PER_EXPERT = [8, 12]  # aligned to 4
NUM_ROWS = 20
INFO = [NUM_RECV, 0, NUM_ROWS] + TOKENS_PER_EXPERT  # what the read brings of info (the exact counts stay behind)
# expert-major row of each received (row, column): every row 0..19 once but 3 and 18 (padding), -1 = not local
RECV_SLOT = [[0, 8], [1, -1], [2, 9], [-1, 10], [4, 11], [5, 12], [6, -1], [13, 14], [15, 16]]


def _calls(lib: FakeLib, name: str) -> list[tuple]:
    """The arguments of every recorded call of C function ``name``, in call order."""
    return [args for called, args in lib.calls if called == name]


def _first(lib: FakeLib, name: str) -> int:
    """Where the first call of ``name`` sits among the recorded calls."""
    return next(i for i, (called, _) in enumerate(lib.calls) if called == name)


def _params(struct: type, **fields: int) -> dict[str, int]:
    """A parameter struct as the fake records it: every field 0 but ``fields``."""
    params = {name: 0 for name, _ in struct._fields_}
    assert fields.keys() <= params.keys(), fields.keys() - params.keys()
    params.update(fields)
    return params


@pytest.fixture
def fake() -> Iterator[FakeLib]:
    """The fake library, reached by the transport (its ``_lib``) and by ``permute``'s launches, with CPU tensors
    standing in for CUDA ones."""
    with installed(FakeLib(R)) as lib:
        yield lib


def _transport(lib: FakeLib, guess: int, rank: int = ME, num_ranks: int = R) -> NVLinkTransport:
    return nvlink_transport(lib, rank, num_ranks, guess)


def _config(num_sms: int = 24, **tuning: int) -> Config:
    return Config(num_sms=num_sms, nvlink=dataclasses.replace(TUNING, **tuning))


def _inputs(weights: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    torch.manual_seed(0)
    x = torch.randn(N, H).to(torch.bfloat16)
    w = torch.rand(N, K) if weights else None
    return x, torch.tensor(TOPK, dtype=torch.int64), w


def _args(
    x: torch.Tensor,
    topk_idx: torch.Tensor | None,
    weights: torch.Tensor | None,
    handle: DispatchHandle | None = None,
    per_rank: torch.Tensor | None = None,
    in_rank: torch.Tensor | None = None,
    num_experts: int = E,
) -> DispatchArgs:
    return DispatchArgs(
        x=x,
        x_scales=None,
        topk_idx=topk_idx,
        topk_weights=weights,
        num_tokens_per_rank=per_rank,
        is_token_in_rank=in_rank,
        num_experts=num_experts,
        handle=handle,
        num_worst_tokens=0,
        wire_fp8=False,
        fp8_out=False,
        round_scale=False,
        config=CONFIG,
    )


def _check_view(t: torch.Tensor, address: int, shape: tuple[int, ...]) -> None:
    """``t``: a contiguous int32 ``shape`` at ``address`` (where a kernel was told to write it)."""
    assert (t.data_ptr(), tuple(t.shape), t.dtype, t.is_contiguous()) == (address, shape, torch.int32, True)


def _notify_experts_at(lib: FakeLib, num_ranks: int = R) -> At:
    """``at`` from the first recorded ``moe_ep_notify_experts`` and the first dispatch after it. The one host
    read takes the rank prefix matrix and info together, so info must directly follow the matrix."""
    name, args = next(call for call in lib.calls if call[0] == "moe_ep_notify_experts")
    rpm, send_pos, send_list, expert_pos, send_offset, info = args[7], args[8], args[9], args[11], args[12], args[13]
    assert info == rpm + 4 * num_ranks * num_ranks, "info must follow the rank prefix matrix (one host read)"
    dispatched = next(a[1] for n, a in lib.calls if n == "moe_ep_dispatch")
    parts = [rpm, send_offset, send_pos, send_list, expert_pos, dispatched["recv_src_idx"], dispatched["recv_slot"]]
    return lambda i, offset=0: parts[i] + 4 * offset


def _expert_dispatch(
    x: torch.Tensor, topk_idx: torch.Tensor, weights: torch.Tensor | None, at: At, **fields: int
) -> dict[str, int]:
    """The parameters of an expert-major pull dispatch of ``x`` (``at``: addresses in notify's allocation); the
    receive side and the guess come in ``fields``."""
    return _params(
        library.DispatchParams,
        x=x.data_ptr(),
        topk_idx=topk_idx.data_ptr(),
        topk_weights=0 if weights is None else weights.data_ptr(),
        rank_prefix_matrix=at(0),
        send_list=at(3),
        num_tokens=N,
        hidden=H,
        x_elem_bytes=2,
        num_topk=K,
        num_local_experts=L,
        list_stride=N,
        num_sms=24,
        num_send_warps=TUNING.pull_dispatch_send_warps,
        send_pos=at(2),
        expert_major=1,
        expert_pos=at(4),
        send_offset=at(1),
        expert_info=at(0, R * R),
        alignment=ALIGNMENT,
        pull=1,
        **fields,
    )


def _permute_call(recv_x: int, recv_slot: int, n: int, num_rows: int, out_x: int, covered: int) -> tuple:
    return ("moe_ep_permute", (recv_x, recv_slot, 0, 0, n, K, H * 2, 0, num_rows, out_x, 0, 0, covered, STREAM))


def _meta(weights: object) -> list[int]:
    """The words notify exchanges for a BF16 dispatch of the test's shape (transports/base.py dispatch_meta)."""
    return [E, H, 1, K, int(weights is not None), 0, 0, 0]


def _fresh(lib: FakeLib, t: NVLinkTransport, prefix: list[int] = PREFIX, info: list[int] = INFO):
    """A fresh ``dispatch_experts`` whose host read brings ``prefix`` + ``info`` → ``(result, x, topk_idx,
    weights, at)``."""
    x, topk_idx, weights = _inputs()
    lib.read_values = prefix + info
    result = t.dispatch_experts(_args(x, topk_idx, weights), ALIGNMENT)
    return result, x, topk_idx, weights, _notify_experts_at(lib)


def test_fresh_dispatch_experts(fake: FakeLib) -> None:
    """notify → read start → speculative dispatch → read wait → permute; the handle's tensors lie where notify and
    the dispatch kernel were told to write them."""
    t = _transport(fake, guess=16)
    result, x, topk_idx, weights, at = _fresh(fake, t)
    assert len({at(i) for i in range(7)}) == 7 and 0 not in {at(i) for i in range(7)}
    handle = result.handle
    in_rank = handle.is_token_in_rank
    assert (tuple(in_rank.shape), in_rank.dtype) == ((N, R), torch.bool)
    [(_, dispatched, _)] = _calls(fake, "moe_ep_dispatch")
    recv_x, probs = dispatched["recv_x"], dispatched["expert_probs"]
    [permuted] = _calls(fake, "moe_ep_permute")
    covered = permuted[12]
    assert _calls(fake, "moe_ep_notify_experts") == [
        (
            CTX,
            topk_idx.data_ptr(),
            N,
            K,
            E,
            ALIGNMENT,
            N,
            at(0),
            at(2),
            at(3),
            in_rank.data_ptr(),
            at(4),
            at(1),
            at(0, R * R),
            _meta(weights),
            STREAM,
        )
    ]
    # one host read: the rank prefix matrix and info together
    assert _calls(fake, "moe_ep_read_start") == [(CTX, at(0), 4 * (R * R + 3 + L), STREAM)]
    assert _calls(fake, "moe_ep_read_wait") == [(CTX,)]
    # the dispatch runs into the guessed 16 rows before the read; the permute takes the rows the read counted
    assert dispatched == _expert_dispatch(
        x,
        topk_idx,
        weights,
        at,
        recv_x=recv_x,
        recv_src_idx=at(5),
        recv_slot=at(6),
        expert_probs=probs,
        num_recv_rows=16,
        speculative_rows=1,
    )
    assert _first(fake, "moe_ep_dispatch") < _first(fake, "moe_ep_read_wait") < _first(fake, "moe_ep_permute")
    assert permuted == _permute_call(recv_x, at(6), NUM_RECV, NUM_ROWS, result.x.data_ptr(), covered)[1]
    assert "moe_ep_barrier" not in {name for name, _ in fake.calls}  # nobody exceeded the guess
    assert 0 not in (recv_x, probs, covered)
    assert (tuple(result.x.shape), result.x.dtype, result.x_scales) == ((NUM_ROWS, H), torch.bfloat16, None)
    assert (result.probs.data_ptr(), tuple(result.probs.shape), result.probs.dtype) == (
        probs,
        (NUM_ROWS,),
        torch.float32,
    )
    _check_view(handle.rank_prefix_matrix, at(0), (R, R))
    _check_view(handle.send_pos, at(2), (N, R))
    _check_view(handle.recv_src_idx, at(5), (NUM_RECV,))
    layout = handle.expert_layout
    _check_view(layout.recv_slot, at(6), (NUM_RECV, K))
    assert (layout.tokens_per_expert, layout.num_rows, layout.alignment) == (TOKENS_PER_EXPERT, NUM_ROWS, ALIGNMENT)
    assert (handle.num_tokens, handle.num_recv_tokens, handle.num_recv_rows) == (N, NUM_RECV, NUM_RECV)
    assert (handle.num_experts, handle.rank, handle.num_ranks) == (E, ME, R)
    state = handle.transport_state
    assert (state.send_list.data_ptr(), state.send_list.shape[1], state.host_counts) == (at(3), N, COUNTS)
    assert (
        state.expert.topk_idx is topk_idx,
        state.expert.expert_pos.data_ptr(),
        state.expert.send_offset.data_ptr(),
    ) == (True, at(4), at(1))
    assert t._recv_guess == 16  # nobody received more than the guess


@pytest.mark.parametrize(
    "prefix, info, most",
    [
        # only the peer received more than the guess of 8 (10 rows); this rank's 7 fit
        ([6, 3, 10, 7], [7, 0, 16, 8, 8], 10),
        # this rank received more (9 rows)
        ([1, 5, 3, 9], INFO, 9),
    ],
    ids=["peer-over-guess", "own-over-guess"],
)
def test_dispatch_experts_again_when_a_rank_exceeds_the_guess(
    fake: FakeLib, prefix: list[int], info: list[int], most: int
) -> None:
    """When any rank received more rows than the guess, every rank waits at a barrier and dispatches again into
    buffers of exactly its received rows, and the guess grows to the most any rank received."""
    t = _transport(fake, guess=8)
    result, x, topk_idx, weights, at = _fresh(fake, t, prefix, info)
    num_recv, num_rows = info[0], info[2]
    handle, layout = result.handle, result.handle.expert_layout
    [(_, first, _), (_, second, _)] = _calls(fake, "moe_ep_dispatch")
    [permuted] = _calls(fake, "moe_ep_permute")
    assert len(_calls(fake, "moe_ep_read_wait")) == 1  # still one host read
    assert first == _expert_dispatch(
        x,
        topk_idx,
        weights,
        at,
        recv_x=first["recv_x"],
        recv_src_idx=at(5),
        recv_slot=at(6),
        expert_probs=first["expert_probs"],
        num_recv_rows=8,
        speculative_rows=1,
    )
    # again after a barrier (every rank's first kernel is done with the buffers), into exactly the rows received
    assert second == _expert_dispatch(
        x,
        topk_idx,
        weights,
        at,
        recv_x=second["recv_x"],
        recv_src_idx=handle.recv_src_idx.data_ptr(),
        recv_slot=layout.recv_slot.data_ptr(),
        expert_probs=result.probs.data_ptr(),
        num_recv_rows=num_recv,
    )
    assert _calls(fake, "moe_ep_barrier") == [(CTX, STREAM)]
    names = [name for name, _ in fake.calls]
    assert (
        names.index("moe_ep_read_wait")
        < names.index("moe_ep_barrier")
        < len(names) - 1 - names[::-1].index("moe_ep_dispatch")
        < names.index("moe_ep_permute")
    )
    assert (
        permuted
        == _permute_call(
            second["recv_x"], layout.recv_slot.data_ptr(), num_recv, num_rows, result.x.data_ptr(), permuted[12]
        )[1]
    )
    assert t._recv_guess == most
    assert (handle.num_recv_tokens, handle.num_recv_rows) == (num_recv, num_recv)
    assert (tuple(result.x.shape), tuple(result.probs.shape)) == ((num_rows, H), (num_rows,))
    assert (layout.tokens_per_expert, layout.num_rows) == (info[3:], num_rows)
    # recv_src_idx and recv_slot of exactly num_recv rows where the second kernel wrote them (not the guessed ones)
    _check_view(handle.recv_src_idx, second["recv_src_idx"], (num_recv,))
    _check_view(layout.recv_slot, second["recv_slot"], (num_recv, K))
    assert {second["recv_src_idx"], second["recv_slot"]}.isdisjoint({at(5), at(6)})
    _check_view(handle.rank_prefix_matrix, at(0), (R, R))


def test_cached_dispatch_experts(fake: FakeLib) -> None:
    """A cached dispatch: barrier, the dispatch kernel on the handle's layout (the forward's top-k, no weights, no
    guess), permute; no notify, no read."""
    t = _transport(fake, guess=16)
    fresh, x, topk_idx, _, at = _fresh(fake, t)
    handle = fresh.handle
    fake.calls.clear()
    x2 = torch.randn(N, H).to(torch.bfloat16)
    result = t.dispatch_experts(_args(x2, None, None, handle=handle, num_experts=handle.num_experts), ALIGNMENT)
    [(_, dispatched, _)] = _calls(fake, "moe_ep_dispatch")
    recv_x = dispatched["recv_x"]
    [permuted] = _calls(fake, "moe_ep_permute")
    names = {name for name, _ in fake.calls}
    assert "moe_ep_read_start" not in names and "moe_ep_notify_experts" not in names  # no host read, no notify
    assert _calls(fake, "moe_ep_barrier") == [(CTX, STREAM)] and _first(fake, "moe_ep_barrier") == 0
    assert dispatched == _expert_dispatch(
        x2, topk_idx, None, at, recv_x=recv_x, recv_src_idx=at(5), recv_slot=at(6), num_recv_rows=NUM_RECV
    )
    assert permuted == _permute_call(recv_x, at(6), NUM_RECV, NUM_ROWS, result.x.data_ptr(), permuted[12])[1]
    assert result.handle is handle and result.probs is None and tuple(result.x.shape) == (NUM_ROWS, H)
    assert t._recv_guess == 16


def _combine_handle(lib: FakeLib, t: NVLinkTransport, dtype: torch.dtype = torch.bfloat16):
    """A fresh expert-major handle whose recv_slot holds ``RECV_SLOT`` (the kernel's part), the calls cleared →
    ``(handle, at, y [M, H] dtype, expert_weights [M], their [N_recv, K] slot weights)``."""
    fresh, _, _, _, at = _fresh(lib, t)
    handle = fresh.handle
    handle.expert_layout.recv_slot.copy_(torch.tensor(RECV_SLOT, dtype=torch.int32))
    lib.calls.clear()
    y = torch.randn(NUM_ROWS, H).to(dtype)
    expert_weights = torch.rand(NUM_ROWS)
    expected = [[expert_weights[s].item() if s >= 0 else 0.0 for s in row] for row in RECV_SLOT]
    return handle, at, y, expert_weights, sum(expected, [])


def _combine(
    at: At,
    x: int,
    out: torch.Tensor,
    out_weights: torch.Tensor | None,
    topk_weights: int,
    handle: DispatchHandle,
    num_sms: int = 24,
    **fields: int,
) -> dict[str, int]:
    """The parameters of a combine of the scenario's received rows at ``x``; the mode's fields in ``fields``. The
    summing order comes from the dispatch's own top-k ids (the handle keeps them)."""
    return _params(
        library.CombineParams,
        x=x,
        topk_weights=topk_weights,
        rank_prefix_matrix=at(0),
        send_pos=at(2),
        out=out.data_ptr(),
        out_weights=0 if out_weights is None else out_weights.data_ptr(),
        num_tokens=N,
        hidden=H,
        dtype=permute.DTYPE_CODES[out.dtype],  # the element type the kernel sums (MOE_EP_DTYPE_*)
        num_topk=K if out_weights is not None else 0,
        num_recv_rows=NUM_RECV,
        num_sms=num_sms,
        topk_idx=handle.topk_idx.data_ptr(),
        idx_topk=K,
        num_local_experts=L,
        **fields,
    )


def _unpermute_call(y: torch.Tensor, at: At, out: int) -> tuple:
    code = permute.DTYPE_CODES[y.dtype]
    return ("moe_ep_unpermute", (y.data_ptr(), at(6), NUM_RECV, K, H, NUM_ROWS, code, out, STREAM))


PUSH = dict(num_send_warps=TUNING.combine_send_warps, num_send_blocks=TUNING.combine_send_blocks)


@pytest.mark.parametrize(
    "min_bytes, pull_rows, asks",
    [
        (TUNING.pull_combine_min_bytes, 1000, False),  # rows far below the pull threshold
        (NUM_RECV * H * 2 + 1, 1000, False),  # one byte short of it
        (0, NUM_RECV - 1, True),  # the most any rank received does not fit the region
    ],
    ids=["below-threshold", "one-byte-short", "region-too-small"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_combine_experts_push(fake: FakeLib, min_bytes: int, pull_rows: int, asks: bool, dtype: torch.dtype) -> None:
    """Push: unpermute into a tensor, then the start barrier and the combine of that tensor; both kernels are
    handed the rows' element type (FP16 rows as BF16 ones, each with its own code)."""
    t = _transport(fake, guess=16)
    fake.pull_rows = pull_rows
    handle, at, y, expert_weights, weights = _combine_handle(fake, t, dtype)
    out, out_weights = t.combine_experts(y, handle, expert_weights, (), _config(pull_combine_min_bytes=min_bytes))
    [unpermuted] = _calls(fake, "moe_ep_unpermute")
    recv_y = unpermuted[7]
    [(_, combined, _)] = _calls(fake, "moe_ep_combine")
    assert len(_calls(fake, "moe_ep_pull_rows")) == asks  # the region's capacity asked only where a pull could fit
    assert unpermuted == _unpermute_call(y, at, recv_y)[1]
    assert combined == _combine(at, recv_y, out, out_weights, combined["topk_weights"], handle, **PUSH)
    assert _calls(fake, "moe_ep_barrier") == [(CTX, STREAM)] and _first(fake, "moe_ep_barrier") < _first(
        fake, "moe_ep_combine"
    )
    assert recv_y not in (0, t._rt.own_region)
    assert fake.combine_memory == {"host_counts": None, "topk_weights": weights}
    assert (tuple(out.shape), out.dtype, tuple(out_weights.shape), out_weights.dtype) == (
        (N, H),
        dtype,
        (N, K),
        torch.float32,
    )


@pytest.mark.parametrize("min_bytes", [0, NUM_RECV * H * 2], ids=["no-threshold", "at-threshold"])
def test_combine_experts_pull_into_own_region(fake: FakeLib, min_bytes: int) -> None:
    """Pull: the start barrier, unpermute straight into the own region, the combine reading it there
    (``x_in_region``) with no second barrier from the host; every warp reduces."""
    t = _transport(fake, guess=16)
    fake.pull_rows = NUM_RECV  # exactly the most any rank received fits
    handle, at, y, expert_weights, weights = _combine_handle(fake, t)
    out, out_weights = t.combine_experts(y, handle, expert_weights, (), _config(pull_combine_min_bytes=min_bytes))
    region = t._rt.own_region
    [(_, combined, _)] = _calls(fake, "moe_ep_combine")
    assert _calls(fake, "moe_ep_unpermute") == [_unpermute_call(y, at, region)[1]]
    assert combined == _combine(
        at,
        region,
        out,
        out_weights,
        combined["topk_weights"],
        handle,
        host_counts=combined["host_counts"],
        pull=1,
        x_in_region=1,
    )
    # one barrier, the host's, before the own region is written: peers may still read it until then
    assert _calls(fake, "moe_ep_barrier") == [(CTX, STREAM)]
    assert _first(fake, "moe_ep_barrier") < _first(fake, "moe_ep_unpermute") < _first(fake, "moe_ep_combine")
    assert fake.combine_memory == {"host_counts": COUNTS, "topk_weights": weights}


def test_combine_experts_pull_without_the_kernel(fake: FakeLib) -> None:
    """A pull combine whose rows the unpermute kernel cannot take: after the host's start barrier torch unpermutes
    straight into the own region (its rows there are the unpermuted rows), which the combine reads in place."""
    t = _transport(fake, guess=16)
    fake.pull_rows = 1000
    handle, at, y, expert_weights, weights = _combine_handle(fake, t)
    with mock.patch.object(permute, "kernels_for", lambda t: False):
        out, out_weights = t.combine_experts(y, handle, expert_weights, (), _config(pull_combine_min_bytes=0))
    [(_, combined, _)] = _calls(fake, "moe_ep_combine")
    assert _calls(fake, "moe_ep_unpermute") == []
    assert combined == _combine(
        at,
        t._rt.own_region,
        out,
        out_weights,
        combined["topk_weights"],
        handle,
        host_counts=combined["host_counts"],
        pull=1,
        x_in_region=1,
    )
    assert _calls(fake, "moe_ep_barrier") == [(CTX, STREAM)]
    slot = torch.tensor(RECV_SLOT)
    expected = torch.stack([sum((y[s].float() for s in row if s >= 0), torch.zeros(H)) for row in slot]).bfloat16()
    assert torch.equal(t._rt.own_rows(NUM_RECV, H, torch.bfloat16), expected)
    assert fake.combine_memory == {"host_counts": COUNTS, "topk_weights": weights}


@pytest.mark.parametrize("num_sms, below", [(16, 20), (22, 24)], ids=["default-16-sms", "raised-threshold"])
def test_combine_experts_copy_engine_before_pull(fake: FakeLib, num_sms: int, below: int) -> None:
    """With fewer SMs than ``copy_engine_combine_below_sms`` the copy engines carry every row, even where a pull
    would fit: unpermute into a tensor, barrier, the combine with the copy engine, the host counts and no sender
    warps (pull_rows not even asked)."""
    t = _transport(fake, guess=16)
    fake.pull_rows = 1000
    handle, at, y, expert_weights, weights = _combine_handle(fake, t)
    config = _config(num_sms, pull_combine_min_bytes=0, copy_engine_combine_below_sms=below)
    out, out_weights = t.combine_experts(y, handle, expert_weights, (), config)
    [unpermuted] = _calls(fake, "moe_ep_unpermute")
    recv_y = unpermuted[7]
    [(_, combined, _)] = _calls(fake, "moe_ep_combine")
    assert _calls(fake, "moe_ep_pull_rows") == []
    assert unpermuted == _unpermute_call(y, at, recv_y)[1]
    assert combined == _combine(
        at,
        recv_y,
        out,
        out_weights,
        combined["topk_weights"],
        handle,
        host_counts=combined["host_counts"],
        copy_engine=1,
        copy_piece_rows=TUNING.copy_piece_rows,
        copy_streams=TUNING.copy_streams,
        num_sms=num_sms,
        num_send_warps=0,
        num_send_blocks=0,
    )
    assert recv_y not in (0, t._rt.own_region)
    assert fake.combine_memory == {"host_counts": COUNTS, "topk_weights": weights}


def test_a_kernel_that_trapped_raises_its_record(fake: FakeLib) -> None:
    """A kernel wait that timed out records the stalled rank and traps; the host read inside the dispatch then
    fails (the CUDA context is lost) and the dispatch raises the recorded TimeoutError naming the rank, not the
    library's CUDA error. The next call raises it before launching anything; destroy leaves the device alone."""
    t = _transport(fake, guess=16)
    record = t._rt.error

    def trapped(ctx: int) -> int:
        record[:] = [library.ERR_DISPATCH_TIMEOUT, 0, 3, ME]
        return 719  # cudaErrorLaunchFailure: what a trap makes every later CUDA call return

    fake.moe_ep_read_wait = trapped
    x, topk_idx, weights = _inputs()
    message = r"rank 1/2: dispatch rows from rank 0 \(chunk 3\) did not arrive within 5 s"
    with pytest.raises(TimeoutError, match=message):
        t.dispatch_experts(_args(x, topk_idx, weights), ALIGNMENT)
    launched = len(fake.calls)
    with pytest.raises(TimeoutError, match=message):
        t.dispatch(_args(x, topk_idx, weights))
    t.destroy()
    assert len(fake.calls) == launched


def test_a_refusing_rank_joins_the_notify_with_its_code(fake: FakeLib) -> None:
    """A rank that refused its fresh dispatch joins its peers' notify with no tokens and its refusal code in the last
    meta word, then waits for that notify with a host read. Every rank's notify then records the refusal, which a
    peer raises, of the refusing rank's error class, naming that rank; a rank with an error already recorded joins
    nothing (its peers' next calls end on their own records)."""
    t = _transport(fake, guess=16)
    fake.read_values = [0] * (R * R + 2)
    t.refuse("dispatch", TypeError("x: expected dtype in [...], got torch.float64"))
    # it joins the notify and waits for it with one host read; it launches nothing else
    assert {name for name, _ in fake.calls} == {"moe_ep_notify_dispatch", "moe_ep_read_start", "moe_ep_read_wait"}
    assert len(_calls(fake, "moe_ep_read_wait")) == 1
    # (ctx, counts, invalid, in_rank, tokens, list stride, prefix, send_pos, send_list, info, meta, per-expert, E, ...)
    notify = fake.calls[0][1]
    assert notify[3:6] == (0, 0, 1) and notify[11:13] == (0, 0)
    assert notify[10] == [0] * (library.META_WORDS - 1) + [2]  # 2: a TypeError (base.REFUSABLE)
    peer = _transport(fake, guess=16, rank=0)
    peer._rt.error[:] = [library.ERR_REFUSED, 1 << ME, 2, 0]
    with pytest.raises(TypeError, match=r"dispatch: rank\(s\) \[1\] refused the call \(a TypeError on rank 1"):
        peer.dispatch(_args(*_inputs()))
    fake.calls.clear()
    t._rt.error[:] = [library.ERR_MISMATCH, 1, 1, ME]
    t.refuse("dispatch", ValueError("x: bad"))
    assert fake.calls == []


@pytest.mark.parametrize(
    "guess, prefix, info",
    [
        (16, PREFIX, [NUM_RECV, 0]),
        (8, [6, 3, 10, 7], [7, 0]),  # the peer received 10 > 8 rows: both dispatch again
    ],
    ids=["fits-guess", "peer-over-guess"],
)
def test_fresh_dispatch(fake: FakeLib, guess: int, prefix: list[int], info: list[int]) -> None:
    """The normal dispatch: notify (counts, out-of-range ids) → read start → speculative dispatch → read wait (and
    when a rank exceeded the guess, barrier → dispatch again); outputs and handle views at the launched addresses."""
    t = _transport(fake, guess=guess)
    x, topk_idx, weights = _inputs()
    in_rank = torch.tensor([[any(0 <= e < E and e // L == r for e in row) for r in range(R)] for row in TOPK])
    per_rank = in_rank.sum(0, dtype=torch.int32)
    fake.read_values = prefix + info
    result = t.dispatch(_args(x, topk_idx, weights, per_rank=per_rank, in_rank=in_rank))
    num_recv, again = info[0], guess < max(prefix[R:])
    handle = result.handle
    notified = fake.calls[0][1]
    parts = [notified[6], notified[7], notified[8]]  # rank prefix matrix (then info), send_pos, send_list
    assert notified[9] == parts[0] + 4 * R * R, "info must follow the rank prefix matrix (one host read)"

    def at(i: int, offset: int = 0) -> int:
        return parts[i] + 4 * offset

    def dispatched(params: dict[str, int], rows: int, speculative: int) -> tuple:
        return (
            "moe_ep_dispatch",
            (
                CTX,
                _params(
                    library.DispatchParams,
                    x=x.data_ptr(),
                    topk_idx=topk_idx.data_ptr(),
                    topk_weights=weights.data_ptr(),
                    rank_prefix_matrix=at(0),
                    send_list=at(2),
                    recv_x=params["recv_x"],
                    recv_topk_idx=params["recv_topk_idx"],
                    recv_topk_weights=params["recv_topk_weights"],
                    recv_src_idx=params["recv_src_idx"],
                    recv_expert_count=params["recv_expert_count"],
                    num_tokens=N,
                    hidden=H,
                    x_elem_bytes=2,
                    num_topk=K,
                    num_local_experts=L,
                    list_stride=N,
                    num_recv_rows=rows,
                    num_sms=24,
                    num_send_warps=TUNING.pull_dispatch_send_warps,
                    send_pos=at(1),
                    alignment=1,
                    speculative_rows=speculative,
                    pull=1,
                ),
                STREAM,
            ),
        )

    launched = [("moe_ep_dispatch", call) for call in _calls(fake, "moe_ep_dispatch")]
    first, last = launched[0][1][1], launched[-1][1][1]
    assert _calls(fake, "moe_ep_notify_dispatch") == [
        (
            CTX,
            per_rank.data_ptr(),
            notified[2],
            in_rank.data_ptr(),
            N,
            N,
            at(0),
            at(1),
            at(2),
            at(0, R * R),
            _meta(weights),
            0,
            E,
            STREAM,
        )
    ]
    # one host read (prefix matrix and info), waited for after the speculative launch into the guessed rows
    assert _calls(fake, "moe_ep_read_start") == [(CTX, at(0), 4 * (R * R + 2), STREAM)]
    assert len(_calls(fake, "moe_ep_read_wait")) == 1
    assert launched == [dispatched(first, guess, 1)] + [dispatched(last, num_recv, 0)] * again
    assert len(_calls(fake, "moe_ep_barrier")) == again  # the second launch waits for every rank's first
    assert 0 not in (
        notified[2],
        *(last[name] for name in ("recv_x", "recv_topk_idx", "recv_topk_weights", "recv_src_idx", "recv_expert_count")),
    )
    for tensor, name, shape in (
        (result.recv_x, "recv_x", (num_recv, H)),
        (result.recv_topk_idx, "recv_topk_idx", (num_recv, K)),
        (result.recv_topk_weights, "recv_topk_weights", (num_recv, K)),
        (result.num_recv_tokens_per_expert, "recv_expert_count", (L,)),
        (handle.recv_src_idx, "recv_src_idx", (num_recv,)),
    ):
        assert (tensor.data_ptr(), tuple(tensor.shape)) == (last[name], shape), name
    assert result.recv_scales is None
    _check_view(handle.rank_prefix_matrix, at(0), (R, R))
    _check_view(handle.send_pos, at(1), (N, R))
    assert handle.is_token_in_rank is in_rank and handle.expert_layout is None
    assert (handle.num_recv_tokens, handle.num_recv_rows) == (num_recv, num_recv)
    state = handle.transport_state
    assert (state.send_list.data_ptr(), state.send_list.shape[1], state.expert) == (at(2), N, None)
    assert state.host_counts == [prefix[0], prefix[1], prefix[2] - prefix[0], prefix[3] - prefix[1]]
    assert t._recv_guess == max(guess, max(prefix[R:]))


# ---- plan: the decisions as plain functions ----


def test_most_received_is_the_largest_column_sum() -> None:
    for r in (1, 2, 3, 4):
        counts = torch.randint(0, 50, (r * r,)).tolist()
        assert most_received(counts, r) == max(sum(counts[i * r + j] for i in range(r)) for j in range(r))


@pytest.mark.parametrize("blocks, num_sms, expected", [(0, 24, 0), (10, 24, 10), (23, 24, 23), (24, 24, 0), (10, 8, 0)])
def test_send_blocks_only_when_receivers_keep_blocks(blocks: int, num_sms: int, expected: int) -> None:
    assert send_blocks(blocks, num_sms) == expected


@pytest.mark.parametrize(
    "wire_fp8, fp8_out, expected",
    [
        (False, False, (True, 6)),  # BF16 pulls
        (True, True, (False, 11)),  # quantizing pushes (slower pulled)
        (True, False, (False, 10)),  # quantizing with dequantizing receivers
    ],
    ids=["bf16-pull", "quantize", "quantize-dequantize"],
)
def test_dispatch_roles(wire_fp8: bool, fp8_out: bool, expected: tuple[bool, int]) -> None:
    assert dispatch_roles(TUNING, wire_fp8, fp8_out) == expected


def test_dispatch_roles_follow_the_tuning() -> None:
    tuning = dataclasses.replace(TUNING, dispatch_pull=False, quantizing_dispatch_pull=True, pull_dispatch_send_warps=3)
    assert dispatch_roles(tuning, False, False) == (False, 5)
    assert dispatch_roles(tuning, True, True) == (True, 3)


@pytest.mark.parametrize(
    "num_sms, most, row_bytes, capacity, expected, asks",
    [
        (24, 100, 1 << 18, 1000, (True, False, 0, 0), True),  # 25 MiB of rows that fit: pull
        (24, 100, 1 << 17, 1000, (False, False, 6, 10), False),  # 12.5 MiB: below 16 MiB, push
        (24, 128, 1 << 17, 1000, (True, False, 0, 0), True),  # exactly 16 MiB: pull
        (24, 100, 1 << 18, 99, (False, False, 6, 10), True),  # does not fit the own region: push
        (24, None, 1 << 18, 1000, (False, False, 6, 10), False),  # counts not on the host: push
        (18, 100, 1 << 18, 1000, (False, True, 0, 0), False),  # below 20 SMs: copy engines, before pull
        (18, None, 1 << 18, 1000, (False, False, 6, 10), False),  # ... which need the counts too
        (8, 100, 16, 1000, (False, True, 0, 0), False),  # 8 SMs: copy engines; 10 send blocks would not fit
    ],
    ids=[
        "pull",
        "push-small",
        "pull-at-threshold",
        "push-no-room",
        "push-no-counts",
        "copy-engine",
        "copy-engine-no-counts",
        "copy-engine-8-sms",
    ],
)
def test_combine_roles(
    num_sms: int, most: int | None, row_bytes: int, capacity: int, expected: Roles, asks: bool
) -> None:
    asked: list = []

    def pull_capacity() -> int:
        asked.append(True)
        return capacity

    assert combine_roles(TUNING, num_sms, most, row_bytes, pull_capacity) == expected
    assert bool(asked) == asks  # the capacity (a library call) is asked only when the size would pull


def test_combine_roles_follow_the_tuning() -> None:
    off = dataclasses.replace(
        TUNING, copy_engine_combine_below_sms=0, combine_pull=False, combine_send_blocks=0, combine_send_warps=9
    )
    assert combine_roles(off, 8, 100, 1 << 20, lambda: 10**9) == (False, False, 9, 0)


@pytest.mark.parametrize(
    "field, value, error",
    [
        ("dispatch_send_warps", 0, ValueError),
        ("dispatch_send_warps", 16, ValueError),
        ("combine_send_blocks", -1, ValueError),
        ("copy_streams", 5, ValueError),
        ("copy_piece_rows", 0, ValueError),
        ("combine_pull", 1, TypeError),
        ("pull_combine_min_bytes", 1.5, TypeError),
    ],
)
def test_tuning_is_validated(field: str, value: object, error: type) -> None:
    with pytest.raises(error, match=f"NVLinkTuning.{field}"):
        NVLinkTuning(**{field: value})


@pytest.mark.parametrize(
    "value, error", [(0, ValueError), (-2, ValueError), (7, ValueError), (24.0, TypeError), (True, TypeError)]
)
def test_one_num_sms_rule(value: object, error: type) -> None:
    """Config and Buffer.set_num_sms reject the same SM counts (a positive even int), naming their argument."""
    from moe_ep_plugin import Buffer

    with pytest.raises(error, match="Config.num_sms"):
        Config(num_sms=value)
    with pytest.raises(error, match="new_num_sms"):
        Buffer.set_num_sms(value)
    assert Config(num_sms=8).num_sms == 8
