"""A stand-in for the kernel library that records calls, for tests and host-time benchmarks on machines without a
GPU.

``NVLinkTransport``'s Python side runs on CPU tensors (their addresses serve its bookkeeping as well as device ones)
over :class:`FakeLib`: :func:`installed` points ``ops.permute``'s launches and both stream queries at it, and
:func:`nvlink_transport` passes the transport a :class:`FakeRuntime` over it (no process group, library or GPU).
The fake kernels compute nothing; what they write is what the host itself reads or indexes with: the host read of
a dispatch brings ``read_values`` and an expert-major dispatch fills ``recv_slot`` with -1 (no local expert), so
the host's indexing (``slot_weights``) stays in bounds.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from unittest import mock

import torch

from moe_ep_plugin.ops import library, permute
from moe_ep_plugin.transports.nvlink import NVLinkTransport, runtime
from moe_ep_plugin.transports.nvlink.runtime import NVLinkRuntime

CTX = 0xC7C000  # the library context, as moe_ep_create would return it
STREAM = 0x5EED00  # the current stream's handle, as the stream query returns it
DEVICE_INDEX = 3
SENTINEL = -77  # the read buffer past what a read brought: a read too long would carry it into the counts
READ_INTS = library.READ_BYTES // 4


class FakeLib:
    """Stands in for the kernel library (and for permute's): every ``moe_ep_*`` call returns 0 and, with
    ``record``, is appended to ``calls`` as ``(name, args)``; parameter structs arrive by reference and are recorded
    as ``{field: value}`` (NULL = 0), copied at the call. A host read brings ``read_values`` (as many as it asked
    for); ``moe_ep_pull_rows`` answers ``pull_rows``. With ``record``, what the host hands a combine by address
    only (its host counts, its weights) is read at the call, while it is alive, into ``combine_memory``. Without
    ``record`` (a benchmark) a call costs the Python call alone."""

    def __init__(self, num_ranks: int, record: bool = True) -> None:
        self.num_ranks = num_ranks
        self.record = record
        self.calls: list[tuple[str, tuple]] = []
        self.read_buffer = [SENTINEL] * READ_INTS
        self.read_values: list[int] = []
        self.pull_rows = 0
        self.combine_memory: dict[str, list | None] = {}
        # what the routing-map kernel writes: (topk_idx [T, K] int64, weights [T, K] float32) on CPU, copied as bytes
        self.routing_answer: tuple[torch.Tensor, torch.Tensor] | None = None
        self._read_ints: int | None = None

    def __getattr__(self, name: str):
        if not name.startswith("moe_ep_"):
            raise AttributeError(name)

        def call(*args) -> int:
            if self.record:  # host arrays (notify's meta words) as lists, copied at the call
                self.calls.append((name, tuple(list(a) if isinstance(a, ctypes.Array) else a for a in args)))
            return 0

        setattr(self, name, call)  # found on the instance from now on: no __getattr__ per call
        return call

    def _record(self, name: str, args: tuple) -> None:
        if self.record:
            self.calls.append((name, args))

    def moe_ep_routing_map_topk(
        self, routing_map: int, probs: int, n: int, num_experts: int, topk: int, idx: int, weights: int, stream: int
    ) -> int:
        self._record("moe_ep_routing_map_topk", (routing_map, probs, n, num_experts, topk, idx, weights, stream))
        assert self.routing_answer is not None, "set routing_answer before the routing-map kernel runs"
        answer_idx, answer_weights = self.routing_answer
        assert tuple(answer_idx.shape) == (n, topk), (tuple(answer_idx.shape), n, topk)
        ctypes.memmove(idx, answer_idx.data_ptr(), 8 * n * topk)
        ctypes.memmove(weights, answer_weights.data_ptr(), 4 * n * topk)
        return 0

    def moe_ep_read_start(self, ctx: int, src: int, nbytes: int, stream: int) -> int:
        self._record("moe_ep_read_start", (ctx, src, nbytes, stream))
        self._read_ints = nbytes // 4
        return 0

    def moe_ep_read_wait(self, ctx: int) -> int:
        self._record("moe_ep_read_wait", (ctx,))
        assert self._read_ints is not None, "read_wait without read_start"
        self.read_buffer[: self._read_ints] = self.read_values[: self._read_ints]
        self._read_ints = None
        return 0

    def moe_ep_pull_rows(self, ctx: int, row_bytes: int, num_topk: int) -> int:
        self._record("moe_ep_pull_rows", (ctx, row_bytes, num_topk))
        return self.pull_rows

    def moe_ep_dispatch(self, ctx: int, params, stream: int) -> int:
        p = params._obj
        if self.record:
            self.calls.append(("moe_ep_dispatch", (ctx, _fields(p), stream)))
        if p.expert_major and p.recv_slot:
            ctypes.memset(p.recv_slot, 0xFF, 4 * p.num_recv_rows * p.num_topk)
        return 0

    def moe_ep_combine(self, ctx: int, params, stream: int) -> int:
        if not self.record:
            return 0
        p = params._obj
        self.calls.append(("moe_ep_combine", (ctx, _fields(p), stream)))
        r = self.num_ranks
        self.combine_memory = {
            "host_counts": list((ctypes.c_int32 * (r * r)).from_address(p.host_counts)) if p.host_counts else None,
            "topk_weights": (
                list((ctypes.c_float * (p.num_recv_rows * p.num_topk)).from_address(p.topk_weights))
                if p.topk_weights
                else None
            ),
        }
        return 0


def _fields(struct: ctypes.Structure) -> dict[str, int]:
    return {name: getattr(struct, name) or 0 for name, _ in struct._fields_}


def _stream_of(index: int) -> int:
    # the transport asks for its device's stream, permute's launch for its tensor's device (-1: a CPU tensor)
    assert index in (DEVICE_INDEX, -1), index
    return STREAM


@contextlib.contextmanager
def routing_kernel_installed(lib: FakeLib) -> Iterator[FakeLib]:
    """While inside: ``ops.routing``'s one-kernel path serves CPU float32 probs too, through ``lib`` (which writes
    its ``routing_answer``), as it serves CUDA probs on the GPU machine."""
    from moe_ep_plugin.ops import routing

    with contextlib.ExitStack() as stack:
        for target, name, value in (
            (routing._ROUTING_KERNEL, "usable", lambda routing_map, probs: True),
            (routing.library, "load", lambda: lib),
            (routing, "current_stream_handle", _stream_of),
        ):
            stack.enter_context(mock.patch.object(target, name, value))
        yield lib


@contextlib.contextmanager
def installed(lib: FakeLib) -> Iterator[FakeLib]:
    """While inside: ``permute``'s launches reach ``lib`` and take CPU tensors, and the stream queries of both
    modules answer ``STREAM``. Restores what it replaced on exit."""
    with contextlib.ExitStack() as stack:
        for target, name, value in (
            (runtime, "current_stream_handle", _stream_of),
            (permute, "current_stream_handle", _stream_of),
            (permute, "_kernels", lambda: lib),
            (permute, "kernels_for", lambda t: True),
            # permute._launch: already on the tensor's device
            (torch.cuda, "current_device", lambda: -1),
        ):
            stack.enter_context(mock.patch.object(target, name, value))
        yield lib


class FakeRuntime(NVLinkRuntime):
    """The runtime of one rank over ``lib`` (a :class:`FakeLib`) on CPU tensors: what ``NVLinkRuntime.__init__``
    takes from the process group, the library and the GPU, given instead; every library call goes to ``lib``.
    ``group``: the process group its host exchanges run over (the low-latency form's agreement), if any."""

    def own_rows(self, rows: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
        return self.own_memory[: rows * hidden * dtype.itemsize].view(dtype).view(rows, hidden)

    def __init__(self, lib: FakeLib, rank: int, num_ranks: int, group: object = None) -> None:
        self.group, self.rank, self.num_ranks, self.timeout_s = group, rank, num_ranks, 5.0
        self.device, self.index = torch.device("cpu"), DEVICE_INDEX
        self.lib, self.ctx, self.error = lib, CTX, [0, 0, 0, 0]
        # the own region: host memory here, so that what unpermute writes there can be read back
        self.own_memory = torch.zeros(1 << 16, dtype=torch.uint8)
        self.region_bytes, self.own_region = 1 << 24, self.own_memory.data_ptr()
        self.read_buffer, self.device_sms = lib.read_buffer, 132
        lib.num_ranks = num_ranks


def nvlink_transport(lib: FakeLib, rank: int, num_ranks: int, recv_guess: int) -> NVLinkTransport:
    """An NVLinkTransport on CPU over ``lib`` (its runtime a :class:`FakeRuntime`) whose receive buffers start at
    ``recv_guess`` rows; to be used inside :func:`installed`."""
    t = NVLinkTransport(None, torch.device("cpu"), 5.0, runtime=FakeRuntime(lib, rank, num_ranks))
    t._recv_guess = recv_guess  # what earlier dispatches would have left: the most rows any rank received
    return t
