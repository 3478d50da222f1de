"""Drop-in behaviour for DeepEP normal-mode code (issue 13), on CPU: the stream ordering of every host value,
dispatch without top-k, the handle read as DeepEP's tuple, and allocations that ignore torch's default dtype and
device. Plain-loop references from tests/support/reference.py."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
import torch.distributed as dist
from support.reference import expected_dispatch, gather_all, routing

from moe_ep_plugin import Buffer, autograd
from moe_ep_plugin.event import EventOverlap
from moe_ep_plugin.handle import NoEquivalent
from moe_ep_plugin.launch import spawn
from moe_ep_plugin.transports.base import DispatchResult
from moe_ep_plugin.transports.torch_transport import TorchTransport


# ---- stream ordering, with fake CUDA streams and a transport that leaves its counts on the "device" ----
class _Streams:
    """Stands in for torch.cuda's streams and events: records every wait, event, record_stream and count read."""

    def __init__(self) -> None:
        self.compute, self.comm = _Stream("compute", self), _Stream("comm", self)
        self.current = self.compute
        self.log: list[tuple] = []

    def stream(self, s: _Stream):
        @contextlib.contextmanager
        def switch():
            before, self.current = self.current, s
            try:
                yield
            finally:
                self.current = before

        return switch()


class _Stream:
    def __init__(self, name: str, streams: _Streams) -> None:
        self.name, self._streams = name, streams

    def wait_event(self, event: _Event) -> None:
        self._streams.log.append(("wait_event", self.name, event.stream))

    def wait_stream(self, other: _Stream) -> None:
        self._streams.log.append(("wait_stream", self.name, other.name))


class _Event:
    def __init__(self, streams: _Streams, stream: str | None = None) -> None:
        self._streams, self.stream = streams, stream

    def record(self, stream: _Stream | None = None) -> None:
        self.stream = (stream or self._streams.current).name
        self._streams.log.append(("record", self.stream))


class _DeviceCounts(DispatchResult):
    """A result whose per-expert counts are still on the device (as the nvlink transport returns them)."""

    def counts_list(self) -> list[int]:
        self.streams.log.append(("counts read", self.streams.current.name))
        return self.num_recv_tokens_per_expert.tolist()


class _DeviceCountsTransport(TorchTransport):
    """The torch transport, but its dispatch results leave the host counts unread (test double)."""

    streams: _Streams

    def dispatch(self, args):
        result = super().dispatch(args)
        fields = {f: getattr(result, f) for f in DispatchResult.__dataclass_fields__}
        fields["host_counts"] = None
        out = _DeviceCounts(**fields)
        out.streams = self.streams
        return out


def _stream_ordering() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    buffer = Buffer(transport="torch", timeout_s=30)
    streams = _Streams()
    transport = _DeviceCountsTransport(buffer.group, buffer.device, 30)
    transport.streams = streams
    buffer.transport = transport
    buffer._comm_stream = streams.comm
    recorded: list[tuple[int, str]] = []
    mp = pytest.MonkeyPatch()
    mp.setattr(torch.cuda, "current_stream", lambda *a: streams.current)
    mp.setattr(torch.cuda, "stream", streams.stream)
    mp.setattr(torch.cuda, "Event", lambda *a, **k: _Event(streams))
    mp.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    mp.setattr(torch.Tensor, "record_stream", lambda t, s: recorded.append((t.data_ptr(), s.name)), raising=False)
    try:
        gen = torch.Generator().manual_seed(7 + rank)
        num_experts, n = 2 * world, 6 + rank
        x = torch.randn(n, 32, generator=gen)
        idx = routing("random", n, 2, num_experts, gen).to(torch.int32)  # int32: converted inside, after the event
        w = torch.rand(n, 2, generator=gen)
        xs, idxs, ws = zip(*gather_all((x, idx.long(), w)), strict=False)
        ref_counts = expected_dispatch(xs, idxs, ws, num_experts, rank, world)[4]
        modes = [
            dict(),
            dict(async_finish=True),
            dict(previous_event=EventOverlap(_Event(streams, "compute"))),
            dict(previous_event=EventOverlap(_Event(streams, "compute")), async_finish=True),
            dict(previous_event=EventOverlap(_Event(streams, "compute")), allocate_on_comm_stream=True),
        ]
        last = None  # the stream the previous call ran on
        for mode in modes:
            streams.log.clear()
            recorded.clear()
            _, _, _, counts, handle, event = buffer.dispatch(
                x, topk_idx=idx, topk_weights=w, num_experts=num_experts, **mode
            )
            assert counts == ref_counts, mode
            overlapped = "previous_event" in mode or mode.get("async_finish")
            log = streams.log
            here = "comm" if overlapped else "compute"
            # a call on another stream than the last call's waits for that stream first (shared peer buffers)
            ordering = [("wait_stream", here, last)] if last not in (None, here) else []
            last = here
            if not overlapped:  # sync without an event: the current stream
                assert log == [*ordering, ("counts read", "compute")], log
                continue
            waited = "wait_event" if "previous_event" in mode else "wait_stream"
            first = [(waited, "comm", "compute"), *ordering]
            log = log[len(first) - 1 :] if log[: len(first)] == first else log
            # the comm stream waits first, then the read happens on it (after the dispatch), then its end is recorded
            assert log[0] == first[-1] and log[1] == ("counts read", "comm") and log[2] == ("record", "comm"), log
            if mode.get("async_finish"):
                assert len(log) == 3 and event.event is not None  # the compute stream never waited: the caller does
            else:
                assert log[3] == ("wait_event", "compute", "comm") and event.event is None
            # the caller's inputs are marked as used by comm, every output (handle included) as used by compute
            comm_used = {p for p, s in recorded if s == "comm"}
            compute_used = {p for p, s in recorded if s == "compute"}
            assert {x.data_ptr(), idx.data_ptr(), w.data_ptr()} <= comm_used
            assert {handle.rank_prefix_matrix.data_ptr(), handle.send_pos.data_ptr()} <= compute_used
            # combine of that handle: the handle's tensors are inputs read on the comm stream
            recorded.clear()
            buffer.combine(torch.zeros(handle.num_recv_rows, 32), handle, **mode)
            comm_used = {p for p, s in recorded if s == "comm"}
            assert {handle.rank_prefix_matrix.data_ptr(), handle.transport_state.send_idx.data_ptr()} <= comm_used
        # dispatch_experts: its host list comes from inside the launched function too
        for mode in modes[1:]:
            streams.log.clear()
            result = buffer.dispatch_experts(x, idx, w, num_experts, **mode)
            assert result[3] == ref_counts and streams.log[1] == ("counts read", "comm"), streams.log
    finally:
        mp.undo()


@pytest.mark.parametrize("world", [1, 2])
def test_host_values_are_read_on_the_comm_stream_after_their_work(world: int) -> None:
    spawn(_stream_ordering, world, backend="gloo")


# ---- dispatch without top-k ----
def _layout(n: int, world: int, num_experts: int, gen: torch.Generator, kind: str):
    """Random is_token_in_rank (all to rank 0 with ``kind='one'``) and per-expert counts that need not follow it."""
    if kind == "one":
        in_rank = torch.zeros(n, world, dtype=torch.bool)
        in_rank[:, 0] = True
    else:
        in_rank = torch.rand(n, world, generator=gen) < 0.5
    per_expert = torch.randint(0, 5, (num_experts,), generator=gen, dtype=torch.int32)
    return in_rank.sum(0, dtype=torch.int32), in_rank, per_expert


def _without_topk(seed: int, transport: str, ranks_per_node: int | None) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    buffer = Buffer(transport=transport, ranks_per_node=ranks_per_node, timeout_s=60)
    for case, (tokens, kind) in enumerate(
        [(lambda r: 5 + 3 * r, "random"), (lambda r: 0 if r == 0 else 4, "random"), (lambda r: 6, "one")]
    ):
        gen = torch.Generator().manual_seed(seed * 100 + case * 10 + rank)
        n, h, num_experts = tokens(rank), 48, 3 * world
        x = torch.randn(n, h, generator=gen).bfloat16()
        per_rank, in_rank, per_expert = _layout(n, world, num_experts, gen, kind)
        everyone = gather_all((x, in_rank, per_expert))
        recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
            x,
            num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            expert_alignment=2,
        )
        rows = [(src, t) for src, (sx, sin, _) in enumerate(everyone) for t in range(sx.shape[0]) if sin[t, rank]]
        assert recv_idx is None and recv_w is None
        assert recv_x.shape == (len(rows), h)
        for i, (src, t) in enumerate(rows):
            assert torch.equal(recv_x[i], everyone[src][0][t])
        assert handle.recv_src_idx.tolist() == [t for _, t in rows]
        local = num_experts // world
        summed = [sum(int(e[2][rank * local + le]) for e in everyone) for le in range(local)]
        assert counts == [(c + 1) // 2 * 2 for c in summed]
        # combine, with and without weights: each token sums its copies over the ranks it went to
        y = recv_x.float() * (rank + 1)
        wts = torch.rand(len(rows), 2, generator=gen)
        combined, combined_w, _ = buffer.combine(y, handle, topk_weights=wts)
        plain, none_w, _ = buffer.combine(y, handle)
        assert none_w is None and torch.equal(plain, combined)
        back = gather_all((y, wts, handle.recv_src_idx))
        ref = torch.zeros(n, h)
        ref_w = torch.zeros(n, 2)
        for r_, (ry, rw, rsrc) in enumerate(back):
            first = sum(int(everyone[s][1][:, r_].sum()) for s in range(rank))
            for j in range(int(in_rank[:, r_].sum())):
                t = int(rsrc[first + j])
                ref[t] += ry[first + j]
                ref_w[t] += rw[first + j]
        assert torch.allclose(combined, ref, rtol=1e-6, atol=1e-6) and torch.allclose(combined_w, ref_w, atol=1e-6)
        # a cached dispatch of that handle, and autograd without top-k: the gradient is the combine
        again = buffer.dispatch(x, handle=handle)[0]
        assert torch.equal(again, recv_x)
        xg = x.float().requires_grad_(True)
        r_x, r_idx, r_w, r_counts, r_handle = autograd.dispatch(
            buffer, xg, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert
        )
        assert r_idx is None and r_w is None and r_counts == summed
        g = torch.randn(r_x.shape, generator=gen)
        r_x.backward(g)
        grad_ref = buffer.combine(g, r_handle)[0]
        assert torch.equal(xg.grad, grad_ref)
    with pytest.raises(ValueError, match="topk_idx: required"):
        buffer.dispatch(
            torch.zeros(2, 8),
            num_tokens_per_rank=torch.zeros(world, dtype=torch.int32),
            is_token_in_rank=torch.zeros(2, world, dtype=torch.bool),
        )
    with pytest.raises(ValueError, match="topk_weights: needs topk_idx"):
        buffer.dispatch(
            torch.zeros(2, 8),
            num_tokens_per_rank=torch.zeros(world, dtype=torch.int32),
            is_token_in_rank=torch.zeros(2, world, dtype=torch.bool),
            num_tokens_per_expert=torch.zeros(world, dtype=torch.int32),
            topk_weights=torch.ones(2, 1),
        )
    dist.barrier()


@pytest.mark.parametrize(
    "transport,world,ranks_per_node",
    [("torch", 1, None), ("torch", 2, None), ("torch", 3, None), ("hierarchical", 4, 2), ("hierarchical", 3, 1)],
)
def test_dispatch_without_topk(transport: str, world: int, ranks_per_node: int | None) -> None:
    spawn(_without_topk, world, args=(int(time.time()) % 1000, transport, ranks_per_node), backend="gloo")


# ---- the handle as DeepEP's tuple; default dtype and device; repeated expert ids ----
def _handle_defaults_duplicates() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(3 + rank)
    num_experts, n, h = 2 * world, 7, 128
    x = torch.randn(n, h, generator=gen).bfloat16()
    idx = routing("random", n, 3, num_experts, gen)
    w = torch.rand(n, 3, generator=gen)
    buffer = Buffer(transport="torch", timeout_s=60)
    reference = buffer.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=num_experts)
    handle = reference[4]

    # DeepEP's (rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx,
    # is_token_in_rank, send_head)
    assert len(handle) == 6
    rpm, cpm, rcpm, src, in_rank, send_head = handle
    assert rpm is handle.rank_prefix_matrix and src is handle.recv_src_idx and in_rank is handle.is_token_in_rank
    assert handle[0] is rpm and handle[-2] is in_rank and handle[3] is src
    for position, value in ((1, cpm), (2, rcpm), (5, send_head)):
        assert isinstance(value, NoEquivalent)
        with pytest.raises(NotImplementedError, match=rf"handle\[{position}\] \("):
            _ = value.shape  # reading any attribute must raise
        with pytest.raises(NotImplementedError, match=rf"handle\[{position}\]"):
            handle[position].sum()
    with pytest.raises(IndexError, match="6 positions"):
        handle[6]
    with pytest.raises(TypeError, match="int"):
        handle["rank_prefix_matrix"]

    # default dtype BF16 and default device meta: nothing the library allocates follows them
    ref_combined = buffer.combine(reference[0], handle)[0]
    ref_experts = buffer.dispatch_experts(x, idx, w, num_experts, expert_alignment=4)
    m = 8
    ll_args = dict(
        num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(m, h, world, num_experts),
        low_latency_mode=True,
        num_qps_per_rank=2,
        transport="torch",
        timeout_s=60,
    )
    ll = Buffer(**ll_args)
    ref_ll = ll.low_latency_dispatch(x, idx, m, num_experts, use_fp8=False)
    ref_ll_combined = ll.low_latency_combine(ref_ll[0], idx, w, ref_ll[2])[0]
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device("meta")
    try:
        fresh = Buffer(transport="torch", timeout_s=60)
        layout = fresh.get_dispatch_layout(idx, num_experts)
        got = fresh.dispatch(
            x,
            num_tokens_per_rank=layout[0],
            is_token_in_rank=layout[3],
            num_tokens_per_expert=layout[2],
            topk_idx=idx,
            topk_weights=w,
        )
        combined = fresh.combine(got[0], got[4])[0]
        experts = fresh.dispatch_experts(x, idx, w, num_experts, expert_alignment=4)
        back = fresh.combine_experts(experts[0], experts[4], experts[2])
        # a refusal: rank 0's expert ids as float; every rank raises naming it
        with pytest.raises(TypeError, match=r"topk_idx"):
            fresh.dispatch(x, topk_idx=idx.float() if rank == 0 else idx, num_experts=num_experts)
        fresh_ll = Buffer(**ll_args)
        got_ll = fresh_ll.low_latency_dispatch(x, idx, m, num_experts, use_fp8=False)
        ll_combined = fresh_ll.low_latency_combine(got_ll[0], idx, w, got_ll[2])[0]
    finally:
        torch.set_default_device(None)
        torch.set_default_dtype(torch.float32)
    for a, b in zip(got[:3], reference[:3], strict=False):
        assert a.device.type == "cpu" and a.dtype == b.dtype and torch.equal(a, b)
    assert got[3] == reference[3] and torch.equal(combined, ref_combined)
    assert torch.equal(experts[0], ref_experts[0]) and torch.equal(experts[2], ref_experts[2])
    assert experts[3] == ref_experts[3] and back[0].device.type == "cpu" and back[1].dtype == torch.float32
    assert got_ll[0].device.type == "cpu" and torch.equal(got_ll[1], ref_ll[1])
    for e, count in enumerate(ref_ll[1].tolist()):  # the received rows (padding rows are left unset)
        assert torch.equal(got_ll[0][e, :count], ref_ll[0][e, :count])
    assert torch.equal(ll_combined, ref_ll_combined)

    # a repeated expert id in one row is two (token, expert) pairs: the row travels once, counts twice, and the
    # expert-major layout holds it twice (DeepEP counts such pairs alike)
    dup = torch.full((n, 2), num_experts - 1, dtype=torch.int64)
    recv_x, recv_idx, _, counts, dup_handle, _ = buffer.dispatch(x, topk_idx=dup, num_experts=num_experts)
    xs = gather_all(x)
    last = rank == world - 1
    assert recv_x.shape[0] == (n * world if last else 0)
    assert counts == ([0, 2 * n * world] if last else [0, 0])
    ex = buffer.dispatch_experts(x, dup, None, num_experts)
    assert ex[3] == counts and ex[0].shape[0] == sum(counts)
    if last:
        assert torch.equal(ex[0][0::2], torch.cat(xs)) and torch.equal(ex[0][1::2], torch.cat(xs))
    dist.barrier()


@pytest.mark.parametrize("world", [1, 2])
def test_handle_tuple_default_dtype_device_and_repeated_ids(world: int) -> None:
    spawn(_handle_defaults_duplicates, world, backend="gloo")


# ---- the soak's round checker (tests/support/rounds.py): exact on random rounds, and it sees a wrong value ----
def _rounds(seed: int) -> None:
    from support import rounds

    rank, world = dist.get_rank(), dist.get_world_size()
    buffer = Buffer(transport="torch", timeout_s=60)
    state = rounds.State()
    entries = iter(rounds.ENTRIES * 2)
    for i in range(len(rounds.ENTRIES) * 2):
        rnd = rounds.draw(seed + i, world, entry=next(entries), mode=rounds.MODES[i % len(rounds.MODES)])
        rnd.tokens = [min(t, 40) for t in rnd.tokens]
        assert rounds.run(buffer, rnd, state, rank, world) == [], rnd.describe()
    # a transport off by one row in combine and in the per-expert counts: the checker reports both
    cls = type(buffer.transport)  # torch, or local at one rank
    original_combine, original_dispatch = cls.combine, cls.dispatch

    def bad_combine(self, *args):
        out, weights = original_combine(self, *args)
        return out + 1 if out.shape[0] else out, weights

    def bad_dispatch(self, args):
        result = original_dispatch(self, args)
        if result.host_counts:
            result.host_counts = [c + 1 for c in result.host_counts]
        return result

    mp = pytest.MonkeyPatch()
    mp.setattr(cls, "combine", bad_combine)
    mp.setattr(cls, "dispatch", bad_dispatch)
    try:
        rnd = rounds.draw(seed, world, entry="dispatch", mode="sync", form="bf16", topk=2)
        rnd.tokens, rnd.alignment = [5] * world, 1  # alignment 1: an aligned count could hide the extra one
        errors = rounds.run(buffer, rnd, rounds.State(), rank, world)
    finally:
        mp.undo()
    assert "combine" in errors and "num_recv_tokens_per_expert_list" in errors, errors


@pytest.mark.parametrize("world", [1, 3])
def test_round_checker(world: int) -> None:
    spawn(_rounds, world, args=(int(time.time()) % 1000 * 100,), backend="gloo")
