"""The host side of the low-latency kernel transport on CPU over the recording fake library (tests/fake_kernels.py):
which library calls each low-latency call makes and when (the send half at the call, the receive half at the hook),
and that the parameter structs carry the caller's tensors, shapes, options and the alternating buffer sets."""
from __future__ import annotations

import pytest
import torch
from fake_kernels import CTX, STREAM, FakeLib, FakeRuntime, installed

from moe_ep_plugin.buffer import _check
from moe_ep_plugin.low_latency import LowLatencyMode
from moe_ep_plugin.ops import library
from moe_ep_plugin.transports.low_latency_nvlink import NVLinkLowLatency

ZERO_COPY = 0x7E5000000  # what the fake moe_ep_ll_combine_buffer answers
M, H, E, K = 8, 2048, 8, 3


def _mode(lib: FakeLib, rank: int = 1, world: int = 2) -> LowLatencyMode:
    transport = NVLinkLowLatency(None, torch.device("cpu"), 5.0, 1 << 40, runtime=FakeRuntime(lib, rank, world))
    lib.moe_ep_ll_combine_buffer = lambda *args: ZERO_COPY
    return LowLatencyMode(transport, rank, world, 1 << 40, torch.device("cpu"),
                          lambda name, t, dtypes, shape: _check(name, t, dtypes, shape, False))


def _params(call: tuple) -> dict:
    name, (ctx, params, stream) = call
    assert ctx == CTX and stream == STREAM
    p = params._obj
    return {field: getattr(p, field) or 0 for field, _ in p._fields_}


def _ll_calls(lib: FakeLib) -> list[str]:
    return [name for name, _ in lib.calls if name.startswith("moe_ep_ll_")]


@pytest.mark.parametrize("use_fp8,round_scale,use_ue8m0", [(False, False, False), (True, False, False),
                                                           (True, True, True)])
def test_calls_and_parameters(use_fp8: bool, round_scale: bool, use_ue8m0: bool) -> None:
    lib = FakeLib(2)
    with installed(lib):
        mode = _mode(lib)
        n = 5
        x = torch.randn(n, H).bfloat16()
        idx = torch.randint(-1, E, (n, K))
        recv, count, handle, _, hook = mode.dispatch(x, idx, M, E, None, None, use_fp8, round_scale, use_ue8m0,
                                                     False, True)
        assert _ll_calls(lib) == ["moe_ep_ll_dispatch_send"]  # the receive half waits for the hook
        hook()
        assert _ll_calls(lib) == ["moe_ep_ll_dispatch_send", "moe_ep_ll_dispatch_recv"]
        send, receive = (_params(c) for c in lib.calls if c[0].startswith("moe_ep_ll_dispatch"))
        assert send == receive
        data, scales = recv if use_fp8 else (recv, None)
        assert data.shape == (E // 2, 2 * M, H) and data.dtype == (torch.float8_e4m3fn if use_fp8 else torch.bfloat16)
        want = dict(x=x.data_ptr(), topk_idx=idx.data_ptr(), recv_x=data.data_ptr(),
                    recv_scales=0 if scales is None else scales.data_ptr(), recv_count=count.data_ptr(),
                    src_info=handle[0].data_ptr(), layout_range=handle[1].data_ptr(), num_tokens=n, hidden=H,
                    num_topk=K, num_experts=E, max_tokens=M, use_fp8=int(use_fp8), round_scale=int(round_scale),
                    use_ue8m0=int(use_ue8m0), buffer_set=0)
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
        want = dict(x=y.data_ptr(), topk_idx=idx.data_ptr(), topk_weights=w.data_ptr(),
                    src_info=handle[0].data_ptr(), layout_range=handle[1].data_ptr(), out=out.data_ptr(),
                    num_tokens=n, hidden=H, num_topk=K, num_experts=E, max_tokens=M, buffer_set=1)
        assert {k: p[k] for k in want} == want

        # zero-copy: the combine reads the buffer set's own slots, whatever x is
        mode.sets.hand_out_zero_copy(handle)
        lib.calls.clear()
        mode.combine(y, idx, w, handle, False, True, False, False, None, None)
        p = _params(lib.calls[0])
        assert p["x"] == ZERO_COPY and p["buffer_set"] == 0


def test_clean_and_errors_reach_the_library_in_order() -> None:
    lib = FakeLib(2)
    with installed(lib):
        mode = _mode(lib)
        mode.clean(M, H, E)
        assert [name for name, _ in lib.calls] == ["moe_ep_ll_clean"]
        with pytest.raises(ValueError, match="hidden size 1024 is not served"):
            mode.dispatch(torch.zeros(1, 1024).bfloat16(), torch.zeros(1, 1, dtype=torch.int64), M, E, None, None,
                          True, False, False, False, False)
        # a receive that timed out on the device: the next call raises, naming the stalled rank
        mode.transport.runtime.error[:] = [2, 0, 3, 1]
        with pytest.raises(TimeoutError, match="from rank 0"):
            mode.dispatch(torch.zeros(1, H).bfloat16(), torch.zeros(1, 1, dtype=torch.int64), M, E, None, None,
                          True, False, False, False, False)


def test_another_shape_needs_a_clean_first() -> None:
    """The kernels place a set's slots and signals by (M, hidden, experts): a call with other shapes is refused
    before any row is sent (the rank takes part without data on the buffer's layout, marked refused) until
    clean_low_latency_buffer lays the buffer out for them."""
    lib = FakeLib(2)
    with installed(lib):
        mode = _mode(lib)
        x, idx = torch.zeros(2, H).bfloat16(), torch.zeros(2, 1, dtype=torch.int64)
        handle = mode.dispatch(x, idx, M, E, None, None, False, False, False, False, False)[2]
        for m, e in ((2 * M, E), (M, 2 * E)):
            lib.calls.clear()
            with pytest.raises(ValueError, match=rf"x: the low-latency buffer is laid out for .*={M}, .*clean_low"):
                mode.dispatch(x, idx, m, e, None, None, False, False, False, False, False)
            assert [(p["num_tokens"], p["max_tokens"], p["num_experts"], p["refusal"] != 0)
                    for p in map(_params, lib.calls)] == [(0, M, E, True)] * 2
        mode.clean(2 * M, H, E)
        with pytest.raises(ValueError, match="handle: the low-latency buffer is laid out for"):
            mode.combine(torch.zeros(E // 2, 2 * M, H).bfloat16(), idx, torch.ones(2, 1), handle, False, False,
                         False, False, None, None)
        mode.dispatch(x, idx, 2 * M, E, None, None, False, False, False, False, False)
        assert _ll_calls(lib)[-2:] == ["moe_ep_ll_dispatch_send", "moe_ep_ll_dispatch_recv"]



def test_a_refusing_rank_takes_part_without_data() -> None:
    """A rank whose low-latency call is refused runs the call's send and receive halves without data, its refusal
    word (the refusing error's class | the call << 8) in the parameters, on the buffer's layout and the set its
    peers take, so that every rank's receive records the refusal; a peer's next call raises it, of the refusing
    rank's class, naming that rank and the call. Without a layout (the first call, with shapes of its own that are
    not valid) it joins nothing, and neither when it already recorded an error."""
    lib = FakeLib(2)
    with installed(lib):
        mode = _mode(lib)
        too_many = torch.zeros(M + 3, H).bfloat16(), torch.zeros(M + 3, 1, dtype=torch.int64)
        with pytest.raises(ValueError, match=rf"x: {M + 3} tokens exceed"):  # the first call: its own shapes serve
            mode.dispatch(*too_many, M, E, None, None, False, False, False, False, False)
        assert _ll_calls(lib) == ["moe_ep_ll_dispatch_send", "moe_ep_ll_dispatch_recv"]
        send, receive = (_params(c) for c in lib.calls if c[0].startswith("moe_ep_ll_"))
        assert send == receive
        # 1: a ValueError (base.REFUSABLE); call 1: low_latency_dispatch (base.REFUSED_CALLS)
        assert {k: send[k] for k in ("num_tokens", "hidden", "num_experts", "max_tokens", "buffer_set",
                                     "refusal")} == dict(num_tokens=0, hidden=H, num_experts=E, max_tokens=M,
                                                         buffer_set=0, refusal=1 | 1 << 8)
        assert all(send[k] == 0 for k in ("x", "topk_idx", "recv_x", "recv_count", "src_info", "layout_range"))

        peer = _mode(lib, rank=0)
        peer.transport.runtime.error[:] = [library.ERR_REFUSED, 1 << 1, 1 | 1 << 8, 0]
        with pytest.raises(ValueError, match=r"low_latency_dispatch: rank\(s\) \[1\] refused the call \(a "
                                             r"ValueError on rank 1"):
            peer.dispatch(torch.zeros(2, H).bfloat16(), torch.zeros(2, 1, dtype=torch.int64), M, E, None, None,
                          False, False, False, False, False)

        # a combine refused on the layout of the dispatch before it, in the set that comes next
        mode = _mode(lib)
        x, idx = torch.zeros(2, H).bfloat16(), torch.zeros(2, 1, dtype=torch.int64)
        handle = mode.dispatch(x, idx, M, E, None, None, False, False, False, False, False)[2]
        lib.calls.clear()
        with pytest.raises(TypeError, match="topk_weights"):
            mode.combine(torch.zeros(E // 2, 2 * M, H).bfloat16(), idx, torch.ones(2, 1, dtype=torch.float64),
                         handle, False, False, False, False, None, None)
        assert _ll_calls(lib) == ["moe_ep_ll_combine_send", "moe_ep_ll_combine_recv"]
        send = _params(lib.calls[0])
        assert (send["buffer_set"], send["max_tokens"], send["refusal"]) == (1, M, 2 | 2 << 8)

        lib.calls.clear()
        fresh = _mode(lib)
        with pytest.raises(ValueError, match="hidden size"):  # no layout yet, and its own shapes do not serve
            fresh.dispatch(torch.zeros(2, 100).bfloat16(), idx, M, E, None, None, False, False, False, False, False)
        fresh.transport.runtime.error[:] = [library.ERR_MISMATCH, 1, 1, 1]
        with pytest.raises(ValueError, match=rf"x: {M + 3} tokens exceed"):
            fresh.dispatch(*too_many, M, E, None, None, False, False, False, False, False)
        assert _ll_calls(lib) == []
