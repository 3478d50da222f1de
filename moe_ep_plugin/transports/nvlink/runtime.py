"""One rank's side of the nvlink transport's peer memory: availability, CUDA-IPC set-up, the library calls on its
context (barriers, notify, dispatch, combine), the host reads, the error record and destroy.

Every rank owns one peer-visible buffer (``cudaMalloc``, mapped into the other ranks with CUDA IPC) with a
staging region per source rank. Every wait on a peer has a deadline (``timeout_s``); when one expires the kernel
records what stalled in a host-mapped record and traps, which ends the process's CUDA context (the timed-out
call's outputs can then not be read as data, only raise). :meth:`NVLinkRuntime.check_error` raises the record as
``TimeoutError`` naming the rank: at the start of every call, and whenever a library call fails (the host read
inside a dispatch fails so when the kernels before it trapped).
"""

from __future__ import annotations

import ctypes
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist

from ...event import current_stream_handle
from ...ops import library
from ..base import META_FIELDS, REFUSABLE, REFUSED_CALLS, metadata_error
from .plan import DEFAULT_ROW_BYTES, DEFAULT_ROWS


class DeviceArray:
    """A raw device allocation seen by ``torch.as_tensor`` (``__cuda_array_interface__``); keeps ``owner`` alive."""

    def __init__(self, ptr: int, shape: tuple[int, ...], typestr: str, owner: object) -> None:
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": shape, "typestr": typestr, "version": 3}
        self.owner = owner


class NVLinkRuntime:
    """The library context of one rank of ``group`` on ``device``: a peer buffer of at least ``num_nvl_bytes``
    (the default staging when smaller), opened by every peer. Collective to create and to :meth:`destroy`."""

    _own_rows_key: tuple[int, int, torch.dtype] | None = None  # the shape of the view :meth:`own_rows` keeps

    def __init__(self, group: dist.ProcessGroup, device: torch.device, timeout_s: float, num_nvl_bytes: int) -> None:
        self.rank, self.num_ranks, self.timeout_s = dist.get_rank(group), dist.get_world_size(group), timeout_s
        self.group = group
        self.lib = library.load()
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        self.index = index
        staging_offset = self.lib.moe_ep_staging_offset()  # header, expert counts and flags come first
        nbytes = max(int(num_nvl_bytes), staging_offset + self.num_ranks * DEFAULT_ROWS * DEFAULT_ROW_BYTES)
        with torch.cuda.device(self.device):
            ctx = self.lib.moe_ep_create(self.rank, self.num_ranks, index, nbytes, int(timeout_s * 1e9))
        if not ctx:
            raise RuntimeError(
                "moe_ep_plugin kernels: creating the peer buffer failed: "
                + self.lib.moe_ep_last_error().decode(errors="replace")
            )
        self.ctx = ctx
        handle = ctypes.create_string_buffer(64)
        library.check(self.lib.moe_ep_ipc_handle(ctx, handle), "cudaIpcGetMemHandle")
        handles: list = [None] * self.num_ranks
        dist.all_gather_object(handles, handle.raw, group=group)
        with torch.cuda.device(self.device):
            library.check(self.lib.moe_ep_open_peers(ctx, b"".join(handles)), "opening peer buffers")
        self.error = self.lib.moe_ep_error_info(ctx)
        self.region_bytes = int(self.lib.moe_ep_region_bytes(ctx))
        self.own_region = int(self.lib.moe_ep_own_region(ctx))  # where a pull combine's rows sit (16-byte aligned)
        self.read_buffer = self.lib.moe_ep_read_buffer(ctx)  # pinned int32 host memory of the host reads
        self.device_sms = torch.cuda.get_device_properties(self.device).multi_processor_count

    def peer_region(self, peer: int) -> int:
        """Device address of this rank's region in peer ``peer``'s buffer, through this rank's CUDA-IPC mapping of
        it (``region_bytes`` long): benchmarks/sm_sweep.py's copy kernel writes there."""
        address = self.lib.moe_ep_peer_region(self.ctx, peer)
        if not address:
            raise ValueError(f"peer: {peer!r} is no rank of this group (0..{self.num_ranks - 1})")
        return int(address)

    def own_rows(self, rows: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
        """``[rows, hidden]`` ``dtype`` over this rank's own region, where a pull combine reads its rows (the caller
        checked they fit). The last view is kept: a training step asks for the same shape every layer."""
        key = (rows, hidden, dtype)
        if self._own_rows_key != key:
            # bytes, then reinterpreted: the array interface has no BF16 type string
            raw = DeviceArray(self.own_region, (rows * hidden * dtype.itemsize,), "|u1", None)
            self._own_rows = torch.as_tensor(raw, device=self.device).view(dtype).view(rows, hidden)
            self._own_rows_key = key
        return self._own_rows

    @staticmethod
    def unavailable_reason(group: dist.ProcessGroup, device: torch.device) -> str | None:
        """Why the kernels cannot serve ``group`` (None when they can). Collective: every rank must call it."""
        local = None
        if not torch.cuda.is_available():
            local = "CUDA is not available"
        elif dist.get_world_size(group) > library.MAX_RANKS:
            local = f"more than {library.MAX_RANKS} ranks"
        else:
            local = library.unavailable_reason()
        index = device.index if device.index is not None else torch.cuda.current_device()
        info = (socket.gethostname(), index, local)
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, info, group=group)
        for host, _, reason in gathered:
            if reason is not None:
                return reason
            if host != gathered[0][0]:
                return "the ranks span several hosts"
        for _, peer, _ in gathered:
            if peer != index and not torch.cuda.can_device_access_peer(index, peer):
                return f"GPU {index} has no peer access to GPU {peer}"
        return None

    def check_error(self) -> None:
        """Raise if a kernel on this rank recorded a failure. Sticky: after a timeout the kernel trapped, so this
        process's CUDA context is lost and the process must end; after another error the buffer is unusable."""
        code = self.error[0]
        if code == 0:
            return
        a, b = self.error[1], self.error[2]
        where = f"moe_ep_plugin[nvlink] rank {self.rank}/{self.num_ranks}"
        if code == library.ERR_BARRIER_TIMEOUT:
            raise TimeoutError(
                f"{where}: rank {a} did not reach the start-of-operation barrier within "
                f"{self.timeout_s:g} s (it never joined, or called a different operation)"
            )
        if code == library.ERR_DISPATCH_TIMEOUT:
            raise TimeoutError(
                f"{where}: dispatch rows from rank {a} (chunk {b}) did not arrive within {self.timeout_s:g} s"
            )
        if code == library.ERR_COMBINE_TIMEOUT:
            raise TimeoutError(
                f"{where}: combine rows from rank {a} (chunk {b}) did not arrive within {self.timeout_s:g} s"
            )
        if code == library.ERR_WORST_TOKENS:
            raise ValueError(
                f"{where}: num_worst_tokens={b} is smaller than the {a} rows this rank received; "
                "the outputs of that dispatch are incomplete"
            )
        if code == library.ERR_MISMATCH:
            raise metadata_error(
                [f for f in range(len(META_FIELDS)) if b >> f & 1],
                [i for i in range(self.num_ranks) if a >> i & 1],
                " (found by notify; this buffer is unusable now: destroy it and make a new one)",
            )
        if code == library.ERR_REFUSED:
            ranks = [i for i in range(self.num_ranks) if a >> i & 1]
            refusal, call = b & 0xFF, b >> 8
            cls = REFUSABLE[refusal - 1] if 1 <= refusal <= len(REFUSABLE) else RuntimeError
            call_name = REFUSED_CALLS[call] if 0 <= call < len(REFUSED_CALLS) else f"call {call}"
            found = (
                "nothing was sent (found by notify"
                if call == 0
                else "the refusing rank sent no rows (found by the low-latency receive"
            )
            raise cls(
                f"{call_name}: rank(s) {ranks} refused the call (a {cls.__name__} on rank {ranks[0]}, whose "
                f"own error names the cause); every rank raises, {found}; this buffer is unusable now: "
                "destroy it and make a new one)"
            )
        if code == library.ERR_CAPACITY:
            raise ValueError(
                f"{where}: {a} rows do not fit a peer staging region of {b} rows; pass a larger num_nvl_bytes"
            )
        raise RuntimeError(f"{where}: kernel error code {code} ({a}, {b})")

    def _check(self, code: int, what: str) -> None:
        """Raise for a failed library call: the recorded kernel error when there is one (a kernel that trapped made
        the call fail, and the record says why), else the library's message."""
        if code != 0:
            self.check_error()
        library.check(code, what)

    def stream(self) -> int:
        """The current stream of this rank's device, as the handle the library takes."""
        return current_stream_handle(self.index)

    def barrier(self) -> None:
        """The barrier that orders an operation after every rank's previous one (peers are done with this rank's
        regions), on the current stream."""
        self._check(self.lib.moe_ep_barrier(self.ctx, self.stream()), "barrier")

    def notify_dispatch(self, *args: int) -> None:
        """``moe_ep_notify_dispatch`` on this context and the current stream (arguments as csrc/moe_ep.h)."""
        self._check(self.lib.moe_ep_notify_dispatch(self.ctx, *args, self.stream()), "notify_dispatch")

    def notify_refusal(self, code: int) -> None:
        """Join the peers' notify as a rank that refused its dispatch: no tokens, and refusal ``code``
        (``base.refusal_code``) in the last meta word, so that every rank's notify records ``MOE_EP_ERR_REFUSED``
        (csrc/moe_ep.h). Then wait for it with a host read, which raises the recorded ``TimeoutError`` when a peer
        never came and the kernel trapped."""
        r = self.num_ranks
        counts, invalid, prefix = (torch.zeros(n, dtype=torch.int32, device=self.device) for n in (r, 1, r * r + 2))
        send_pos, send_list = (torch.empty(shape, dtype=torch.int32, device=self.device) for shape in ((0, r), (r, 1)))
        meta = library.HostInts([0] * (library.META_WORDS - 1) + [code])
        self.notify_dispatch(
            counts.data_ptr(),
            invalid.data_ptr(),
            0,
            0,
            1,
            prefix.data_ptr(),
            send_pos.data_ptr(),
            send_list.data_ptr(),
            prefix.data_ptr() + 4 * r * r,
            meta.array,
            0,
            0,
        )
        self.start_read(prefix.data_ptr(), r * r + 2)()

    def notify_experts(self, *args: int) -> None:
        """``moe_ep_notify_experts`` on this context and the current stream (arguments as csrc/moe_ep.h)."""
        self._check(self.lib.moe_ep_notify_experts(self.ctx, *args, self.stream()), "notify_experts")

    def dispatch(self, params: library.DispatchParams) -> None:
        self._check(self.lib.moe_ep_dispatch(self.ctx, ctypes.byref(params), self.stream()), "dispatch")

    def combine(self, params: library.CombineParams) -> None:
        self._check(self.lib.moe_ep_combine(self.ctx, ctypes.byref(params), self.stream()), "combine")

    @staticmethod
    def staging_offset() -> int:
        """Bytes of a context's header pages, before its staging regions (or low-latency buffer sets)."""
        return library.load().moe_ep_staging_offset()

    def low_latency(self, name: str, params: ctypes.Structure) -> None:
        """``moe_ep_ll_<name>`` (``dispatch_send``, ``dispatch_recv``, ``combine_send``, ``combine_recv``) on the
        current stream (csrc/kernels/low_latency.cuh)."""
        self._check(
            getattr(self.lib, f"moe_ep_ll_{name}")(self.ctx, ctypes.byref(params), self.stream()), f"low-latency {name}"
        )

    def low_latency_combine_buffer(self, max_tokens: int, hidden: int, num_experts: int, buffer_set: int) -> int:
        """Device address of buffer set ``buffer_set``'s zero-copy combine input (BF16 ``[L, R*M, H]``)."""
        ptr = self.lib.moe_ep_ll_combine_buffer(self.ctx, max_tokens, hidden, num_experts, buffer_set)
        if not ptr:
            raise ValueError("num_rdma_bytes: " + self.lib.moe_ep_last_error().decode(errors="replace"))
        return ptr

    def low_latency_clean(self) -> None:
        """Zero the low-latency buffer sets, then a barrier with every peer."""
        self._check(self.lib.moe_ep_ll_clean(self.ctx, self.stream()), "clean_low_latency_buffer")

    def pull_rows(self, row_bytes: int, num_topk: int) -> int:
        """The most combined rows of ``row_bytes`` (and ``num_topk`` weights) this rank's own region holds."""
        return self.lib.moe_ep_pull_rows(self.ctx, row_bytes, num_topk)

    def start_read(self, src: int, length: int) -> Callable[[], list[int]]:
        """Start a host read of ``length`` int32 at device address ``src``: copied to pinned memory on the
        library's side stream after the work enqueued so far, so the caller can enqueue more before it waits.
        Returns the wait, which gives the values (the memory must stay alive until then)."""
        self._check(self.lib.moe_ep_read_start(self.ctx, src, 4 * length, self.stream()), "read_start")

        def wait() -> list[int]:
            self._check(self.lib.moe_ep_read_wait(self.ctx), "read_wait")
            return self.read_buffer[:length]

        return wait

    def destroy(self) -> None:
        """Free the peer buffer after every rank is done with it (collective). After a timeout the CUDA context is
        lost: nothing on the device can be freed, so this only leaves."""
        if self.ctx is None:
            return
        if self.error[0] in library.TIMEOUTS:
            self.ctx = None
            return
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)
        self._check(self.lib.moe_ep_destroy(self.ctx), "destroy")
        self.ctx = None
