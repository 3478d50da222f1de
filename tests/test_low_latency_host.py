"""The host side of the low-latency kernel transport on CPU over the recording fake library
(tests/support/fake_kernels.py), two gloo ranks each with its own fake: which library calls each low-latency call
makes and when (the send half at the call, the receive half at the hook), that the parameter structs carry the
caller's tensors, shapes, options and the alternating buffer sets, and that the calls laying the buffer out (the
first dispatch, a clean) agree on it over the group, so that a rank refusing one, or ranks disagreeing on its
shapes, raise the same error on every rank at that call."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from support.fake_kernels import CTX, STREAM, FakeLib, FakeRuntime, installed

from moe_ep_plugin.buffer import _check
from moe_ep_plugin.launch import spawn
from moe_ep_plugin.low_latency import LowLatencyMode
from moe_ep_plugin.ops import library
from moe_ep_plugin.transports.low_latency_nvlink import NVLinkLowLatency

ZERO_COPY = 0x7E5000000  # what the fake moe_ep_ll_combine_buffer answers
M, H, E, K = 8, 2048, 8, 3
REFUSED = r"{}: rank\(s\) \[1\] refused the call \(rank 1: {}"


def _mode(lib: FakeLib) -> LowLatencyMode:
    rank, world = dist.get_rank(), dist.get_world_size()
    transport = NVLinkLowLatency(
        None, torch.device("cpu"), 5.0, 1 << 40, runtime=FakeRuntime(lib, rank, world, dist.group.WORLD)
    )
    lib.moe_ep_ll_combine_buffer = lambda *args: ZERO_COPY
    return LowLatencyMode(
        transport,
        rank,
        world,
        1 << 40,
        torch.device("cpu"),
        lambda name, t, dtypes, shape: _check(name, t, dtypes, shape, False),
    )


def _params(call: tuple) -> dict:
    name, (ctx, params, stream) = call
    assert ctx == CTX and stream == STREAM
    p = params._obj
    return {field: getattr(p, field) or 0 for field, _ in p._fields_}


def _ll_calls(lib: FakeLib) -> list[str]:
    return [name for name, _ in lib.calls if name.startswith("moe_ep_ll_")]


def _dispatch(mode: LowLatencyMode, x: torch.Tensor, idx: torch.Tensor, m: int = M, e: int = E) -> tuple:
    return mode.dispatch(x, idx, m, e, None, None, False, False, False, False, False)


def _calls_and_parameters() -> None:
    for use_fp8, round_scale, use_ue8m0 in ((False, False, False), (True, False, False), (True, True, True)):
        lib = FakeLib(2)
        with installed(lib):
            mode = _mode(lib)
            n = 5
            x = torch.randn(n, H).bfloat16()
            idx = torch.randint(-1, E, (n, K))
            recv, count, handle, _, hook = mode.dispatch(
                x, idx, M, E, None, None, use_fp8, round_scale, use_ue8m0, False, True
            )
            assert _ll_calls(lib) == ["moe_ep_ll_dispatch_send"]  # the receive half waits for the hook
            hook()
            assert _ll_calls(lib) == ["moe_ep_ll_dispatch_send", "moe_ep_ll_dispatch_recv"]
            send, receive = (_params(c) for c in lib.calls if c[0].startswith("moe_ep_ll_dispatch"))
            assert send == receive
            data, scales = recv if use_fp8 else (recv, None)
            assert data.shape == (E // 2, 2 * M, H)
            assert data.dtype == (torch.float8_e4m3fn if use_fp8 else torch.bfloat16)
            want = dict(
                x=x.data_ptr(),
                topk_idx=idx.data_ptr(),
                recv_x=data.data_ptr(),
                recv_scales=0 if scales is None else scales.data_ptr(),
                recv_count=count.data_ptr(),
                src_info=handle[0].data_ptr(),
                layout_range=handle[1].data_ptr(),
                num_tokens=n,
                hidden=H,
                num_topk=K,
                num_experts=E,
                max_tokens=M,
                use_fp8=int(use_fp8),
                round_scale=int(round_scale),
                use_ue8m0=int(use_ue8m0),
                buffer_set=0,
                refusal=0,
            )
            assert {k: send[k] for k in want} == want and send["wait_stats"] != 0
            if use_fp8:
                assert scales.shape == (E // 2, 2 * M, H // (512 if use_ue8m0 else 128)) and scales.stride(1) == 1

            # plain combine (no hook: both halves at once), on the other buffer set
            y = torch.randn(E // 2, 2 * M, H).bfloat16()
            w = torch.rand(n, K)
            out = torch.empty(n, H).bfloat16()
            lib.calls.clear()
            got, _, none = mode.combine(y, idx, w, handle, False, False, False, False, out, None)
            assert got is out and none is None
            assert _ll_calls(lib) == ["moe_ep_ll_combine_send", "moe_ep_ll_combine_recv"]
            p = _params(lib.calls[0])
            want = dict(
                x=y.data_ptr(),
                topk_idx=idx.data_ptr(),
                topk_weights=w.data_ptr(),
                src_info=handle[0].data_ptr(),
                layout_range=handle[1].data_ptr(),
                out=out.data_ptr(),
                num_tokens=n,
                hidden=H,
                num_topk=K,
                num_experts=E,
                max_tokens=M,
                buffer_set=1,
            )
            assert {k: p[k] for k in want} == want

            # zero-copy: the combine reads the buffer set's own slots, whatever x is
            mode.sets.hand_out_zero_copy(handle)
            lib.calls.clear()
            mode.combine(y, idx, w, handle, False, True, False, False, None, None)
            p = _params(lib.calls[0])
            assert p["x"] == ZERO_COPY and p["buffer_set"] == 0


def _clean_and_errors() -> None:
    lib = FakeLib(2)
    with installed(lib):
        mode = _mode(lib)
        mode.clean(M, H, E)
        assert [name for name, _ in lib.calls] == ["moe_ep_ll_clean"]
        # every rank refuses this one: each takes part in the others' call without data, on the clean's layout
        with pytest.raises(ValueError, match="hidden size 1024 is not served"):
            mode.dispatch(
                torch.zeros(1, 1024).bfloat16(),
                torch.zeros(1, 1, dtype=torch.int64),
                M,
                E,
                None,
                None,
                True,
                False,
                False,
                False,
                False,
            )
        # a receive that timed out on the device: the next call raises, naming the stalled rank
        mode.transport.runtime.error[:] = [library.ERR_DISPATCH_TIMEOUT, 0, 3, 1]
        with pytest.raises(TimeoutError, match="from rank 0"):
            mode.dispatch(
                torch.zeros(1, H).bfloat16(),
                torch.zeros(1, 1, dtype=torch.int64),
                M,
                E,
                None,
                None,
                True,
                False,
                False,
                False,
                False,
            )


def _another_shape() -> None:
    lib = FakeLib(2)
    with installed(lib):
        mode = _mode(lib)
        x, idx = torch.zeros(2, H).bfloat16(), torch.zeros(2, 1, dtype=torch.int64)
        handle = _dispatch(mode, x, idx)[2]
        for m, e in ((2 * M, E), (M, 2 * E)):
            lib.calls.clear()
            with pytest.raises(ValueError, match=rf"x: the low-latency buffer is laid out for .*={M}, .*clean_low"):
                _dispatch(mode, x, idx, m, e)
            assert [
                (p["num_tokens"], p["max_tokens"], p["num_experts"], p["refusal"] != 0) for p in map(_params, lib.calls)
            ] == [(0, M, E, True)] * 2
        mode.clean(2 * M, H, E)
        with pytest.raises(ValueError, match="handle: the low-latency buffer is laid out for"):
            mode.combine(
                torch.zeros(E // 2, 2 * M, H).bfloat16(),
                idx,
                torch.ones(2, 1),
                handle,
                False,
                False,
                False,
                False,
                None,
                None,
            )
        _dispatch(mode, x, idx, 2 * M, E)
        assert _ll_calls(lib)[-2:] == ["moe_ep_ll_dispatch_send", "moe_ep_ll_dispatch_recv"]


def _refusals() -> None:
    """Rank 1 refuses calls rank 0 makes, each bounded well below the exchange's timeout."""
    bad = dist.get_rank() == 1
    x, idx = torch.zeros(2, H).bfloat16(), torch.zeros(2, 1, dtype=torch.int64)
    too_many = torch.zeros(M + 3, H).bfloat16(), torch.zeros(M + 3, 1, dtype=torch.int64)
    lib = FakeLib(2)
    with installed(lib):
        # The first dispatch lays the buffer out: a refusal there (more than M tokens, a hidden size no kernel
        # serves) joins the agreement, and both ranks raise it at that call, before any kernel ran.
        mode = _mode(lib)
        for args, cause in (
            (too_many, f"x: {M + 3} tokens exceed"),
            ((torch.zeros(2, 100).bfloat16(), idx), "x: hidden size 100 is not served"),
        ):
            start = time.monotonic()
            with pytest.raises(ValueError, match=REFUSED.format("low_latency_dispatch", cause)):
                _dispatch(mode, *(args if bad else (x, idx)))
            assert time.monotonic() - start < 4 and _ll_calls(lib) == []
        # Ranks that disagree on its shapes raise alike too.
        with pytest.raises(
            ValueError,
            match=r"num_max_dispatch_tokens_per_rank: ranks disagree in "
            rf"low_latency_dispatch: \[{M}, {2 * M}\] by rank",
        ):
            _dispatch(mode, x, idx, 2 * M if bad else M)
        # So does a clean, which lays the buffer out again.
        with pytest.raises(
            ValueError, match=REFUSED.format("clean_low_latency_buffer", "num_experts: expected a positive int, got 0")
        ):
            mode.clean(M, H, 0 if bad else E)
        assert _ll_calls(lib) == []

        # Laid out, a refused dispatch takes part in the peer's call without data, marked refused (1: a ValueError,
        # base.REFUSABLE; call 1: low_latency_dispatch, base.REFUSED_CALLS), on the set the peer takes.
        _dispatch(mode, x, idx)
        lib.calls.clear()
        if bad:
            with pytest.raises(ValueError, match=rf"^x: {M + 3} tokens exceed"):
                _dispatch(mode, *too_many)
        else:
            _dispatch(mode, x, idx)
        send, receive = (_params(c) for c in lib.calls if c[0].startswith("moe_ep_ll_"))
        assert send == receive and _ll_calls(lib) == ["moe_ep_ll_dispatch_send", "moe_ep_ll_dispatch_recv"]
        assert {k: send[k] for k in ("num_experts", "max_tokens", "buffer_set")} == dict(
            num_experts=E, max_tokens=M, buffer_set=1
        )
        assert (send["num_tokens"], send["refusal"]) == ((0, 1 | 1 << 8) if bad else (2, 0))
        assert (send["x"] == 0) == bad
        if not bad:  # what the peer's receive recorded: its next call raises it, naming rank 1
            mode.transport.runtime.error[:] = [library.ERR_REFUSED, 1 << 1, 1 | 1 << 8, 0]
            with pytest.raises(
                ValueError,
                match=r"low_latency_dispatch: rank\(s\) \[1\] refused the call \(a "
                r"ValueError on rank 1",
            ):
                _dispatch(mode, x, idx)

        # a combine refused on the layout of the dispatch before it, in the set that comes next
        mode = _mode(lib)
        handle = _dispatch(mode, x, idx)[2]
        lib.calls.clear()
        y = torch.zeros(E // 2, 2 * M, H).bfloat16()
        if bad:
            with pytest.raises(TypeError, match="topk_weights"):
                mode.combine(
                    y, idx, torch.ones(2, 1, dtype=torch.float64), handle, False, False, False, False, None, None
                )
        else:
            mode.combine(y, idx, torch.ones(2, 1), handle, False, False, False, False, None, None)
        assert _ll_calls(lib) == ["moe_ep_ll_combine_send", "moe_ep_ll_combine_recv"]
        send = _params(lib.calls[0])
        assert (send["buffer_set"], send["max_tokens"], send["refusal"]) == (1, M, 2 | 2 << 8 if bad else 0)

        # A rank that already recorded an error joins nothing: its own call raises it (here the refusal), and a
        # peer that recorded it too raises it at the agreement's start.
        lib.calls.clear()
        mode = _mode(lib)
        mode.transport.runtime.error[:] = [library.ERR_MISMATCH, 1, 1, 1]
        if bad:
            with pytest.raises(ValueError, match=rf"^x: {M + 3} tokens exceed"):
                _dispatch(mode, *too_many)
        else:
            with pytest.raises(ValueError, match="found by notify"):
                _dispatch(mode, x, idx)
        assert lib.calls == []


@pytest.mark.parametrize(
    "case", [_calls_and_parameters, _clean_and_errors, _another_shape, _refusals], ids=lambda f: f.__name__.strip("_")
)
def test_on_two_ranks(case) -> None:
    spawn(case, 2, backend="gloo", timeout_s=120.0)
