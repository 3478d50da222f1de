"""``Buffer``: DeepEP V1's API (layout, dispatch, combine; low-latency mode in ``low_latency.py``) over a
pluggable transport.

router (gating.py) → quantize+dispatch (Buffer.dispatch / dispatch_experts, fp8.py, transports/) →
permute/experts/unpermute (permute.py, experts) → combine (Buffer.combine / combine_experts, transports/);
``dispatch_experts``/``combine_experts`` are the prepare/finalize pair around the experts.

The Buffer validates every input before any communication, owns the communication stream and the
``previous_event``/``async_finish``/``allocate_on_comm_stream`` semantics, and hands validated, contiguous
tensors to its transport (``torch`` reference or ``nvlink`` kernels).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from .config import DEFAULT_TIMEOUT_S, Config, check_num_sms, combine_config, dispatch_config, positive_int
from .event import EventOverlap
from .handle import DispatchHandle, rounded_counts
from .low_latency import LowLatencyMode, rdma_size_hint
from .ops import fp8
from .ops.permute import ROW_DTYPES
from .transports import DispatchArgs, create_low_latency_transport, create_transport, resolve_transport
from .transports.base import REFUSABLE

XInput = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
T = TypeVar("T")


def _require_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    return t


def _check(
    name: str, t: object, dtypes: Sequence[torch.dtype], shape: Sequence[int | None], cuda: bool
) -> torch.Tensor:
    """Type, dtype, shape (None = any size) and device (CUDA if ``cuda``, else CPU: the buffer's device type) of an
    input tensor, with the argument's name in the error. Runs several times per call, so it reads each tensor
    attribute once and builds no device objects (``is_cuda``/``is_cpu`` instead of ``device.type``)."""
    t = _require_tensor(name, t)
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    size = t.shape
    if len(size) != len(shape):
        raise _shape_error(name, shape, size)
    for want, got in zip(shape, size, strict=False):
        if want is not None and want != got:
            raise _shape_error(name, shape, size)
    if not (t.is_cuda if cuda else t.is_cpu):
        raise ValueError(
            f"{name}: expected a tensor on {'cuda' if cuda else 'cpu'} (the buffer's device), got {t.device}"
        )
    return t


def buffer_device(group: dist.ProcessGroup, device: object) -> torch.device:
    """The device a Buffer of ``group`` lives on: ``device`` (validated; ``cuda`` without an index is the current
    one) or, when None, the current CUDA device for an NCCL group or while torch's default device is CUDA
    (``torch.set_default_device("cuda")``, as DeepEP's test harness sets), and the CPU otherwise."""
    nccl = dist.get_backend(group) == "nccl"
    if device is None:
        cuda = nccl or torch.get_default_device().type == "cuda"
        return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if not isinstance(device, (torch.device, str)):
        raise TypeError(f"device: expected a torch.device or str, got {type(device).__name__}")
    try:
        device = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device: {e}") from None
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device: expected a CUDA or CPU device, got {device}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device: {device} was asked for but CUDA is not available")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif nccl:
        raise ValueError("device: an NCCL group needs a CUDA device, got cpu")
    return device


def _int64(t: torch.Tensor) -> torch.Tensor:
    """``t`` as contiguous int64 (``.to`` costs host time even when the dtype is already right)."""
    return (t if t.dtype == torch.int64 else t.to(torch.int64)).contiguous()


def _shape_error(name: str, shape: Sequence[int | None], size: torch.Size) -> ValueError:
    want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
    return ValueError(f"{name}: expected shape {want}, got {list(size)}")


class Buffer:
    """Expert-parallel communication buffer for one process group (DeepEP ``deep_ep.Buffer``; ``low_latency_mode``:
    docs/low_latency.md).

    ``transport``: ``"auto"`` (``hierarchical`` when the group spans nodes and ``nvlink`` serves each node;
    ``nvlink`` kernels when CUDA, the kernel library and peer access exist on one host; else ``torch``),
    ``"torch"``, ``"nvlink"`` or ``"hierarchical"`` (docs/multinode.md); ``$MOE_EP_TRANSPORT`` overrides ``auto``.
    A group of one rank gets ``"local"`` whatever is asked for: no communication and no peer buffer.
    ``ranks_per_node``: EP ranks per node (group rank ``r`` on node ``r // ranks_per_node``); default torchrun's
    ``LOCAL_WORLD_SIZE``, else the hostnames. Setting it emulates nodes on one host; ``transport="torch"`` or
    ``"nvlink"`` refuse it. The ranks agree on the layout first (every rank raises alike when they disagree).
    ``timeout_s`` bounds every wait on another rank (``$MOE_EP_TIMEOUT_S``, default ``config.DEFAULT_TIMEOUT_S``,
    120 s).

    ``device``: where inputs and outputs live. Default: the current CUDA device when ``group`` is an NCCL group
    or torch's default device is CUDA, else the CPU. A CUDA device with a gloo group serves several ranks that
    share one GPU (NCCL refuses two ranks on one GPU); only the ``nvlink`` transport works so, since the
    ``torch`` transport moves rows with the group's own collectives.
    """

    num_sms: int = 20

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        use_fabric: bool = False,
        explicitly_destroy: bool = False,
        enable_shrink: bool = False,
        comm: object = None,
        *,
        transport: str = "auto",
        timeout_s: float | None = None,
        device: torch.device | str | None = None,
        ranks_per_node: int | None = None,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("group: torch.distributed is not initialised (call init_process_group first)")
        group = group if group is not None else dist.group.WORLD
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group: expected a torch.distributed.ProcessGroup, got {type(group).__name__}")
        positive_int(num_nvl_bytes, "num_nvl_bytes", 0)
        positive_int(num_rdma_bytes, "num_rdma_bytes", 0)
        positive_int(num_qps_per_rank, "num_qps_per_rank")
        if enable_shrink:  # DeepEP's low_latency_*_mask_buffer calls, which this library does not have
            raise ValueError(
                "enable_shrink: shrink mode (masking ranks out of low-latency calls) is not served by "
                "this library; pass enable_shrink=False"
            )
        if not isinstance(transport, str):
            raise TypeError(f"transport: expected a str, got {type(transport).__name__}")
        if timeout_s is None:
            try:
                timeout_s = float(os.environ.get("MOE_EP_TIMEOUT_S", DEFAULT_TIMEOUT_S))
            except ValueError:
                raise ValueError(
                    f"$MOE_EP_TIMEOUT_S: expected a number of seconds, got {os.environ['MOE_EP_TIMEOUT_S']!r}"
                ) from None
        elif not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool):
            raise TypeError(f"timeout_s: expected a number of seconds, got {type(timeout_s).__name__}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: expected a positive number of seconds, got {timeout_s!r}")
        self.group = group
        self.rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = bool(low_latency_mode)
        self.explicitly_destroy = explicitly_destroy
        self.device = buffer_device(group, device)
        is_cuda = self.device.type == "cuda"
        self._cuda = is_cuda  # what _check compares input tensors with
        self.transport_name, split = resolve_transport(transport, group, self.device, ranks_per_node, timeout_s)
        if is_cuda and self.transport_name == "torch" and dist.get_backend(group) != "nccl":
            raise ValueError(
                f"device: the torch transport moves rows with the group's collectives, and a "
                f"{dist.get_backend(group)} group cannot carry {self.device} tensors; use an NCCL "
                f"group or transport='nvlink'"
            )
        self.transport = create_transport(self.transport_name, group, self.device, timeout_s, num_nvl_bytes, split)
        self.timeout_s = timeout_s
        # destroy() leaves this rank's number under a key of the default store, so that a peer's call names it
        # instead of timing out: one key per (group, n-th Buffer of the group), n counted per rank in the store
        # (Buffers are made collectively, in the same order on every rank, so the ranks' n agree).
        self._store = dist.distributed_c10d._get_default_store()
        nth = self._store.add(f"moe_ep_plugin.buffer/made/{group.group_name}/{self.rank}", 1)
        self._destroyed_key = f"moe_ep_plugin.buffer/destroyed/{group.group_name}/{nth}"
        self._comm_stream = torch.cuda.Stream(self.device, priority=-1) if is_cuda else None
        self._last_stream: torch.cuda.Stream | None = None  # the stream the last call's work went to
        self.destroyed = False  # set by destroy(): callers holding on to this buffer must fetch a new one
        # Low-latency mode (docs/low_latency.md): its own buffer sets; normal mode stays usable on this Buffer.
        self._low_latency = (
            None
            if not low_latency_mode
            else LowLatencyMode(
                create_low_latency_transport(self.transport, num_rdma_bytes),
                self.rank,
                self.group_size,
                num_rdma_bytes,
                self.device,
                lambda name, t, dtypes, shape: _check(name, t, dtypes, shape, is_cuda),
            )
        )

    # ---- configuration (static, as in DeepEP) ----
    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """SMs the normal kernels use by default (even: two per channel)."""
        Buffer.num_sms = check_num_sms(new_num_sms, "new_num_sms")

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return dispatch_config(Buffer.num_sms, num_ranks)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return combine_config(Buffer.num_sms, num_ranks)

    @staticmethod
    def is_sm90_compiled() -> bool:
        """Whether FP8 dispatch is available (DeepEP: its kernels built for SM90, which its FP8 paths need): always
        True here, since every transport serves FP8 rows (the kernels are built for sm_90a, the torch transport
        quantizes with torch ops)."""
        return True

    @staticmethod
    def capture() -> EventOverlap:
        from .event import capture

        return capture()

    def get_comm_stream(self) -> torch.cuda.Stream | None:
        return self._comm_stream

    def destroy(self) -> None:
        """Release transport resources (collective for the kernel transport); any later call raises, here and (naming
        this rank) on the peers."""
        for transport in (self.transport, self._low_latency and self._low_latency.transport):
            release = getattr(transport, "destroy", None)
            if release is not None:
                release()
        self.destroyed = True
        try:
            self._store.set(self._destroyed_key, str(self.rank))
        except RuntimeError as exc:  # the store's host left first (teardown): released all the same, said so
            warnings.warn(
                f"Buffer.destroy: released, but the store could not record it ({exc}); a peer still calling "
                "this Buffer learns it only from its timeout",
                stacklevel=2,
            )

    def _check_live(self) -> None:
        if self.destroyed:
            raise RuntimeError("Buffer: used after destroy(), which released its transport; make a new Buffer")

    def _check_peers(self, cause: BaseException | None = None) -> None:
        """Raise naming the peer that destroyed its side of this Buffer, if one did (a store round trip). With
        ``cause`` (a failed wait on peers, re-raised by the caller otherwise) a store that cannot answer either, as
        when the rank hosting it is gone, leaves ``cause`` to be raised."""
        try:
            if not self._store.check([self._destroyed_key]):
                return
            rank = int(self._store.get(self._destroyed_key))
        except RuntimeError:  # torch.distributed's store errors (DistStoreError, DistNetworkError)
            if cause is None:
                raise
            return
        raise RuntimeError(
            f"Buffer: rank {rank} of this group destroyed its Buffer (destroy()), so this rank's call cannot "
            "complete; make a new Buffer on every rank"
        ) from cause

    # ---- streams ----
    def _run(self, fn: Callable[[], tuple]) -> tuple:
        """``fn()``; when it fails with a CUDA error, the error a kernel recorded first, if any (a kernel that
        trapped makes the next host read fail, without naming why). A peer that destroyed its Buffer is named: before
        ``fn`` where the transport asks at each call, else when a wait on peers failed."""
        if self.transport.checks_peers_each_call:
            self._check_peers()
        with self._naming_destroyed_peer():
            try:
                return fn()
            except RuntimeError:
                self.transport.check_error()
                raise

    @contextlib.contextmanager
    def _naming_destroyed_peer(self) -> Iterator[None]:
        """A failed wait on peers inside is raised as the peer that destroyed its Buffer, if one did."""
        try:
            yield
        except (TimeoutError, RuntimeError) as exc:
            self._check_peers(exc)
            raise

    def _on_comm_stream(
        self,
        fn: Callable[[], tuple],
        previous_event: EventOverlap | None,
        async_finish: bool,
        allocate_on_comm_stream: bool,
        inputs: tuple,
    ) -> tuple:
        """Raise what the transport recorded, then run ``fn`` on the communication stream after ``previous_event``
        (or the current stream's work); with ``async_finish`` the returned event marks its end, else the current
        stream waits for it.

        ``fn`` does all of an entry point's device work, its input conversions included (they must run after
        ``previous_event`` too), and reads every host value it returns there, on the communication stream, after
        the work producing it: in async mode nothing after ``fn`` waits for that stream. ``inputs``: what ``fn``
        reads of the caller's (tensors, tuples of them, handles, None); their tensors are marked as used by the
        communication stream (found only when that stream is used: the walk costs host time)."""
        self._check_live()
        if previous_event is not None and not isinstance(previous_event, EventOverlap):
            raise TypeError(f"previous_event: expected an EventOverlap, got {type(previous_event).__name__}")
        if allocate_on_comm_stream and previous_event is None:
            raise ValueError("allocate_on_comm_stream=True needs previous_event (the point the comm stream waits for)")
        with self._naming_destroyed_peer():
            self.transport.check_error()  # an earlier call's failure the kernels recorded
        if self._comm_stream is None:
            return self._run(fn) + (EventOverlap(),)
        if previous_event is None and not async_finish:
            # nothing to overlap with while the caller waits anyway: the current stream gives the same ordering
            # without the stream switch, events and record_stream bookkeeping
            self._after_last_call(torch.cuda.current_stream())
            return self._run(fn) + (EventOverlap(),)
        compute = torch.cuda.current_stream()
        comm = self._comm_stream
        if previous_event is not None and previous_event.event is not None:
            comm.wait_event(previous_event.event)
        else:
            comm.wait_stream(compute)
        self._after_last_call(comm)
        with torch.cuda.stream(comm):
            outputs = self._run(fn)
        inputs = _tensors_in(tuple(item for item in inputs if item is not None))
        for t in inputs:
            t.record_stream(comm)
        for t in _tensors_in(outputs):
            t.record_stream(compute)  # outputs are made on the comm stream and used on the compute stream
        event = torch.cuda.Event()
        event.record(comm)
        if not async_finish:
            compute.wait_event(event)
            return outputs + (EventOverlap(),)
        return outputs + (EventOverlap(event, extra_tensors=tuple(inputs)),)

    def _after_last_call(self, stream: torch.cuda.Stream) -> None:
        """Orders the work of a call about to run on ``stream`` after the last call's, when that ran on another
        stream. Calls share the transport's peer buffers, barriers and handles; DeepEP runs every call on its one
        communication stream, which orders them so, but here a synchronous call without ``previous_event`` runs on
        the caller's current stream. The wait covers the work queued on the last stream so far (the last call's
        included) and costs nothing while the stream stays the same. Inside a CUDA-graph capture no outside wait is
        allowed: the capture's stream already waited for its origin when it began."""
        last, self._last_stream = self._last_stream, stream
        if last is None or last == stream or torch.cuda.is_current_stream_capturing():
            return
        stream.wait_stream(last)

    # ---- layout ----
    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """``topk_idx`` ``[N, K]`` int64/int32 (-1 = none) → ``(num_tokens_per_rank [R] int32,
        num_tokens_per_rdma_rank [M] int32 (tokens per node on the hierarchical transport, else None),
        num_tokens_per_expert [E] int32, is_token_in_rank [N, R] bool, event)``.

        Ids outside ``[-1, num_experts)`` are left out of the counts here (checking them would cost a host sync);
        the dispatch that follows rejects them on every rank with a ``ValueError`` before any row moves."""
        self._check_live()

        def check() -> torch.Tensor:
            self._check_num_experts(num_experts)
            return _int64(_check("topk_idx", topk_idx, (torch.int64, torch.int32), (None, None), self._cuda))

        topk_idx = self.refusing("get_dispatch_layout", None, check)

        def layout() -> tuple:
            per_rank, per_expert, in_rank = self.transport.get_dispatch_layout(topk_idx, num_experts)
            return per_rank, self.transport.num_tokens_per_node(in_rank), per_expert, in_rank

        per_rank, per_node, per_expert, in_rank, event = self._on_comm_stream(
            layout, previous_event, async_finish, allocate_on_comm_stream, (topk_idx,)
        )
        return per_rank, per_node, per_expert, in_rank, event

    def refusing(self, call: str, handle: object | None, check: Callable[[], T]) -> T:
        """``check()``, this rank's validation of ``call``'s input (here, or in a front door built on this Buffer,
        such as the ``deep_ep`` module's ``ElasticBuffer``). When it raises and ``call`` starts a fresh dispatch
        (no cached ``handle``; ``get_dispatch_layout`` precedes one), this rank joins the count exchange its peers'
        dispatch starts with (``Transport.refuse``), so every rank raises the cause naming this rank (the
        low-latency calls do the same through their header exchange). Should the peers never come, this rank
        raises its own cause after ``timeout_s``."""
        try:
            return check()
        except REFUSABLE as exc:
            if handle is None:
                try:
                    self.transport.refuse(call, exc)
                except TimeoutError as timeout:
                    raise exc from timeout
            raise

    def _check_num_experts(self, num_experts: int) -> None:
        positive_int(num_experts, "num_experts")
        if num_experts % self.group_size:
            raise ValueError(f"num_experts: {num_experts} experts do not divide evenly over {self.group_size} EP ranks")

    # ---- dispatch ----
    def dispatch(
        self,
        x: XInput,
        handle: DispatchHandle | None = None,
        num_tokens_per_rank: torch.Tensor | None = None,
        num_tokens_per_rdma_rank: torch.Tensor | None = None,
        is_token_in_rank: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
        *,
        num_experts: int | None = None,
        fp8_dispatch: bool = False,
        fp8_out: bool = False,
        round_scale: bool = False,
    ):
        """Send each token once to every rank that hosts one of its experts (or, without top-k, to every rank
        ``is_token_in_rank`` names); rows arrive ordered by source rank, then source token.

        Arguments:
            x: ``torch.Tensor`` ``[N, H]`` BF16/FP16/FP32, or the FP8 pair ``(float8_e4m3fn [N, H], float32 scales
                [N, H/128])`` (1x128 blocks).
            handle: a handle from an earlier dispatch on this buffer: its layout is reused (no count exchange, no
                host sync); then no layout tensor and no top-k may be given.
            num_tokens_per_rank: ``[R]`` int32/int64, tokens sent to each rank (from :meth:`get_dispatch_layout`).
            num_tokens_per_rdma_rank: ignored (intranode only; DeepEP's internode layout).
            is_token_in_rank: ``[N, R]`` bool, token ``t`` goes to rank ``r``; with ``num_tokens_per_rank``.
            num_tokens_per_expert: ``[E]`` int32/int64, (token, expert) pairs per expert; gives ``num_experts``,
                and without top-k the returned per-expert list (summed over source ranks for the local experts).
            topk_idx: ``[N, K]`` int64/int32 global expert ids, -1 = none; a repeated id in one row counts as two
                (token, expert) pairs. Without it, pass all three layout tensors (DeepEP's dispatch without top-k).
            topk_weights: ``[N, K]`` float32, travels with the rows (0 where the expert is not local); needs
                ``topk_idx``.
            expert_alignment: round each entry of the returned per-expert list up to a multiple of this.
            num_worst_tokens: > 0: outputs of exactly that many rows and no host read on transports that can
                skip it (CUDA-graph capturable on nvlink); the per-expert list is then empty. Fewer than a rank
                receives raises ``ValueError``.
            config: :class:`Config` (SMs and chunk sizes of the kernels); default :meth:`get_dispatch_config`.
            previous_event: the point the communication stream waits for (else the current stream's work).
            async_finish: return at once; the returned event marks the end (``current_stream_wait``). Every
                returned value, the per-expert list included, is exact in every mode.
            allocate_on_comm_stream: outputs are owned by the communication stream (needs ``previous_event``).
            num_experts: beyond DeepEP: the expert count when no ``num_tokens_per_expert`` is given.
            fp8_dispatch: beyond DeepEP: quantize BF16 (or FP32; not FP16) ``x`` to FP8 in the send path; rows
                arrive dequantized to ``x``'s dtype, or as ``(fp8, scales)`` with ``fp8_out=True``; ``round_scale``:
                power-of-two scales.

        Returns ``(recv_x, recv_topk_idx [N_recv, K] int64 local ids or None, recv_topk_weights [N_recv, K]
        float32 or None, num_recv_tokens_per_expert_list list[int], handle, event)``; ``recv_x`` as ``x`` (a pair
        for FP8 rows).
        """
        inputs = (x, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights, handle)

        def run() -> tuple:
            args = self.refusing(
                "dispatch",
                handle,
                lambda: self._dispatch_args(
                    x,
                    handle,
                    num_tokens_per_rank,
                    is_token_in_rank,
                    num_tokens_per_expert,
                    topk_idx,
                    topk_weights,
                    expert_alignment,
                    num_worst_tokens,
                    config,
                    num_experts,
                    fp8_dispatch,
                    fp8_out,
                    round_scale,
                ),
            )
            result = self.transport.dispatch(args)
            counts: list[int] = []
            if result.num_recv_tokens_per_expert is not None and num_worst_tokens == 0:
                # read here, on the stream the dispatch ran on, after it (in async mode nothing later waits for it)
                counts = rounded_counts(result.counts_list(), expert_alignment)
            return result, counts

        result, counts, event = self._on_comm_stream(run, previous_event, async_finish, allocate_on_comm_stream, inputs)
        recv_x = result.recv_x if result.recv_scales is None else (result.recv_x, result.recv_scales)
        return recv_x, result.recv_topk_idx, result.recv_topk_weights, counts, result.handle, event

    def _dispatch_args(
        self,
        x: XInput,
        handle: DispatchHandle | None,
        num_tokens_per_rank: torch.Tensor | None,
        is_token_in_rank: torch.Tensor | None,
        num_tokens_per_expert: torch.Tensor | None,
        topk_idx: torch.Tensor | None,
        topk_weights: torch.Tensor | None,
        expert_alignment: int,
        num_worst_tokens: int,
        config: Config | None,
        num_experts: int | None,
        fp8_dispatch: bool,
        fp8_out: bool,
        round_scale: bool,
        layout: bool = True,
    ) -> DispatchArgs:
        """Validate a dispatch's arguments into transport args, computing the layout when only ``topk_idx`` is
        given (unless ``layout`` is False: the transport derives it from top-k itself)."""
        x_data, x_scales = self._check_x(x, fp8_dispatch, fp8_out, round_scale)
        n = x_data.shape[0]
        layout_given = num_tokens_per_rank is not None
        positive_int(expert_alignment, "expert_alignment")
        positive_int(num_worst_tokens, "num_worst_tokens", 0)
        config = self._check_config(config, self.get_dispatch_config)
        if handle is not None:
            self._check_handle(handle, n)
            if not (
                topk_idx is None and topk_weights is None and num_tokens_per_rank is None and is_token_in_rank is None
            ):
                name = next(
                    name
                    for name, value in (
                        ("topk_idx", topk_idx),
                        ("topk_weights", topk_weights),
                        ("num_tokens_per_rank", num_tokens_per_rank),
                        ("is_token_in_rank", is_token_in_rank),
                    )
                    if value is not None
                )
                raise ValueError(f"{name}: must be None when a cached handle is given (the layout is reused)")
            num_experts = handle.num_experts
        else:
            if topk_idx is None:
                if (
                    not layout
                    or num_tokens_per_rank is None
                    or is_token_in_rank is None
                    or num_tokens_per_expert is None
                ):
                    raise ValueError(
                        "topk_idx: required when no cached handle is given, unless "
                        "num_tokens_per_rank, is_token_in_rank and num_tokens_per_expert are all given "
                        "(dispatch without top-k)"
                    )
                if topk_weights is not None:
                    raise ValueError("topk_weights: needs topk_idx")
            else:
                topk_idx = _int64(_check("topk_idx", topk_idx, (torch.int64, torch.int32), (n, None), self._cuda))
            if topk_weights is not None:
                topk_weights = _check(
                    "topk_weights", topk_weights, (torch.float32,), topk_idx.shape, self._cuda
                ).contiguous()
            if num_experts is None and num_tokens_per_expert is not None:
                num_experts = _require_tensor("num_tokens_per_expert", num_tokens_per_expert).shape[0]
            if num_experts is None:
                raise ValueError(
                    "num_experts: pass num_experts or num_tokens_per_expert so expert ids can be localised"
                )
            self._check_num_experts(num_experts)
            if num_tokens_per_expert is not None:
                num_tokens_per_expert = _check(
                    "num_tokens_per_expert",
                    num_tokens_per_expert,
                    (torch.int32, torch.int64),
                    (num_experts,),
                    self._cuda,
                )
            if (num_tokens_per_rank is None) != (is_token_in_rank is None):
                raise ValueError(
                    "num_tokens_per_rank/is_token_in_rank: pass both (from get_dispatch_layout) or neither"
                )
            # Expert ids are range-checked by the transport: their count rides on the count exchange, so every
            # rank raises at that one host read, before any row moves (a separate check would cost a sync).
            if num_tokens_per_rank is None and layout:
                # The transport's own layout of the top-k checked above: nothing left to check, and on the
                # current stream as get_dispatch_layout without events would run it.
                num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank = self.transport.get_dispatch_layout(
                    topk_idx, num_experts
                )
            elif num_tokens_per_rank is not None:
                num_tokens_per_rank = _check(
                    "num_tokens_per_rank",
                    num_tokens_per_rank,
                    (torch.int32, torch.int64),
                    (self.group_size,),
                    self._cuda,
                )
                is_token_in_rank = _check(
                    "is_token_in_rank", is_token_in_rank, (torch.bool,), (n, self.group_size), self._cuda
                ).contiguous()
        return DispatchArgs(
            x=x_data,
            x_scales=x_scales,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
            num_tokens_per_rank=num_tokens_per_rank,
            is_token_in_rank=is_token_in_rank,
            num_experts=num_experts,
            handle=handle,
            num_worst_tokens=num_worst_tokens,
            wire_fp8=fp8_dispatch,
            fp8_out=fp8_out,
            round_scale=round_scale,
            config=config,
            num_tokens_per_expert=num_tokens_per_expert,
            layout_given=layout_given,
        )

    def _check_x(
        self, x: XInput, fp8_dispatch: bool, fp8_out: bool, round_scale: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if isinstance(x, tuple):
            if len(x) != 2:
                raise ValueError(f"x: an FP8 input is a (data, scales) pair, got a tuple of {len(x)}")
            data = _check("x[0]", x[0], (fp8.FP8_DTYPE,), (None, None), self._cuda)
            fp8.check_fp8_hidden(data.shape[1], "x[0]")
            scales = _check("x[1]", x[1], (torch.float32,), (data.shape[0], data.shape[1] // fp8.BLOCK), self._cuda)
            if fp8_dispatch:
                raise ValueError("fp8_dispatch: x is already FP8; fp8_dispatch quantizes BF16 input")
            return data.contiguous(), scales.contiguous()
        data = _check("x", x, ROW_DTYPES, (None, None), self._cuda)
        if fp8_dispatch and data.dtype == torch.float16:
            # the send-path quantizer reads BF16 or FP32 rows (csrc/kernels/fp8.cuh); FP16 rows travel as they are
            raise ValueError("x: fp8_dispatch quantizes BF16 or FP32 rows, got float16 (pass fp8_dispatch=False)")
        if fp8_out and not fp8_dispatch:
            raise ValueError("fp8_out: only meaningful with fp8_dispatch=True (BF16 input quantized in the send path)")
        if round_scale and not fp8_dispatch:
            raise ValueError("round_scale: only meaningful with fp8_dispatch=True")
        if fp8_dispatch:
            fp8.check_fp8_hidden(data.shape[1], "x")
        return data.contiguous(), None

    def _check_config(self, config: Config | None, default: Callable[[int], Config]) -> Config:
        if config is None:
            return default(self.group_size)
        if not isinstance(config, Config):
            raise TypeError(f"config: expected moe_ep_plugin.Config, got {type(config).__name__}")
        return config

    def _check_handle(self, handle: object, num_tokens: int | None = None) -> DispatchHandle:
        if not isinstance(handle, DispatchHandle):
            raise TypeError(f"handle: expected the handle returned by Buffer.dispatch, got {type(handle).__name__}")
        if handle.num_ranks != self.group_size or handle.rank != self.rank:
            raise ValueError("handle: it was made by a buffer on a different group")
        if num_tokens is not None and num_tokens != handle.num_tokens:
            raise ValueError(f"x: the handle was made for {handle.num_tokens} tokens, got {num_tokens}")
        return handle

    # ---- combine ----
    def combine(
        self,
        x: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: torch.Tensor | None = None,
        bias: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """Reduce received rows back to their tokens: ``x`` ``[N_recv, H]`` BF16/FP16/FP32 in dispatch order →
        ``(combined_x [N, H], combined_topk_weights [N, K] or None, event)``; sums in fp32, adds ``bias``
        (0–2 tensors ``[N, H]``) once, casts to ``x.dtype``. Gate weights are applied by the caller before.
        A handle of a dispatch without top-k combines alike, with or without ``topk_weights``."""
        handle = self._check_handle(handle)
        _check("x", x, ROW_DTYPES, (handle.num_recv_rows, None), self._cuda)
        if topk_weights is not None:
            _check("topk_weights", topk_weights, (torch.float32,), (handle.num_recv_rows, None), self._cuda)
        biases = self._check_biases(bias, x, handle.num_tokens)
        config = self._check_config(config, self.get_combine_config)

        def run() -> tuple:
            return self.transport.combine(
                x.contiguous(), handle, _contiguous(topk_weights), tuple(b.contiguous() for b in biases), config
            )

        combined, weights, event = self._on_comm_stream(
            run, previous_event, async_finish, allocate_on_comm_stream, (x, topk_weights, biases, handle)
        )
        return combined, weights, event

    # ---- expert-major dispatch / combine ----
    def dispatch_experts(
        self,
        x: XInput,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        num_experts: int | None = None,
        *,
        handle: DispatchHandle | None = None,
        expert_alignment: int = 1,
        fp8_dispatch: bool = False,
        fp8_out: bool = False,
        round_scale: bool = False,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """Dispatch straight into the expert-major layout a grouped GEMM takes (docs/expert_major.md): the
        "prepare" half of the prepare/finalize pair around the experts (:meth:`combine_experts` finalizes).

        Local expert ``l`` owns rows ``[base[l], base[l] + tokens_per_expert[l])`` (``base`` = exclusive cumsum),
        one row per received (token, top-k column) pair in received order (source rank, then token), each
        block padded with zero rows to a multiple of ``expert_alignment``.

        Arguments:
            x: ``[N, H]`` BF16/FP16/FP32, or the FP8 pair ``(float8_e4m3fn [N, H], float32 scales [N, H/128])``.
            topk_idx: ``[N, K]`` int64/int32 global expert ids, -1 = none (required without ``handle``); a
                repeated id in one row gives that expert two rows.
            topk_weights: ``[N, K]`` float32 or None: each row's weight lands in ``expert_probs``.
            num_experts: the total expert count (a multiple of the EP size).
            handle: from an earlier ``dispatch_experts``: the layout is reused (no top-k, no host sync,
                ``expert_probs`` None).
            expert_alignment: each expert's block is padded with zero rows to a multiple of this.
            fp8_dispatch, fp8_out, round_scale: as in :meth:`dispatch` (with ``fp8_out`` rows stay FP8).
            config: :class:`Config`; default :meth:`get_dispatch_config`.
            previous_event, async_finish, allocate_on_comm_stream: as in :meth:`dispatch`; every returned value,
                ``tokens_per_expert`` included, is exact in every mode.

        Returns ``(expert_x [M, H] (FP8 with fp8_out or FP8 input), expert_scales [M, H/128] float32 or None,
        expert_probs [M] float32 or None, tokens_per_expert list[int] (aligned, length L), handle, event)``.
        """
        if handle is not None:
            layout = self._check_expert_handle(handle).expert_layout
            if expert_alignment not in (1, layout.alignment):
                raise ValueError(
                    f"expert_alignment: the cached handle's layout is aligned to {layout.alignment}, "
                    f"got {expert_alignment!r}"
                )
            expert_alignment = layout.alignment

        def run() -> tuple:
            args = self.refusing(
                "dispatch",
                handle,
                lambda: self._dispatch_args(
                    x,
                    handle,
                    None,
                    None,
                    None,
                    topk_idx,
                    topk_weights,
                    expert_alignment,
                    0,
                    config,
                    num_experts,
                    fp8_dispatch,
                    fp8_out,
                    round_scale,
                    layout=not self.transport.expert_layout_from_topk,
                ),
            )
            result = self.transport.dispatch_experts(args, expert_alignment)
            # host values the transport read after the work producing them; a copy: the handle's stays intact
            return result, list(result.handle.expert_layout.tokens_per_expert)

        result, tokens_per_expert, event = self._on_comm_stream(
            run, previous_event, async_finish, allocate_on_comm_stream, (x, topk_idx, topk_weights, handle)
        )
        return result.x, result.x_scales, result.probs, tokens_per_expert, result.handle, event

    def combine_experts(
        self,
        y: torch.Tensor,
        handle: DispatchHandle,
        expert_weights: torch.Tensor | None = None,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
        bias: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
    ):
        """Reverse of :meth:`dispatch_experts`: expert outputs ``y`` ``[M, H]`` BF16/FP16/FP32 in the handle's layout →
        ``(combined_x [N, H] y.dtype, combined_weights [N, K] float32 or None, event)``.

        ``combined_x[t]`` sums the rows of token ``t``'s pairs (per rank: top-k columns ascending in fp32, rounded
        to ``y.dtype``; then over ranks in fp32 with ``bias``, 0–2 tensors ``[N, H]`` ``y.dtype``, rounded once
        more); padding rows are ignored. With ``expert_weights`` ``[M]`` float32, ``combined_weights[t, k]`` is the
        value at the row pair ``(t, k)`` landed in (0 where ``topk_idx[t, k]`` was -1). Gate weights are applied by
        the caller before.
        """
        layout = self._check_expert_handle(handle).expert_layout
        _check("y", y, ROW_DTYPES, (layout.num_rows, None), self._cuda)
        if expert_weights is not None:
            _check("expert_weights", expert_weights, (torch.float32,), (layout.num_rows,), self._cuda)
        biases = self._check_biases(bias, y, handle.num_tokens)
        config = self._check_config(config, self.get_combine_config)
        combined, weights, event = self._on_comm_stream(
            lambda: self.transport.combine_experts(
                y.contiguous(), handle, _contiguous(expert_weights), tuple(b.contiguous() for b in biases), config
            ),
            previous_event,
            async_finish,
            allocate_on_comm_stream,
            (y, expert_weights, biases, handle),
        )
        return combined, weights, event

    def _check_biases(self, bias: object, x: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, ...]:
        """``bias`` (None, one tensor or up to two) as a tuple of ``[num_tokens, H]`` tensors of ``x.dtype``."""
        biases = () if bias is None else (bias,) if isinstance(bias, torch.Tensor) else tuple(bias)
        if len(biases) > 2:
            raise ValueError(f"bias: at most two tensors, got {len(biases)}")
        for i, b in enumerate(biases):
            _check(f"bias[{i}]", b, (x.dtype,), (num_tokens, x.shape[1]), self._cuda)
        return biases

    # ---- low-latency mode (DeepEP V1's signatures; semantics in moe_ep_plugin/low_latency.py) ----
    @staticmethod
    def get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
    ) -> int:
        """Bytes to pass as ``num_rdma_bytes`` for low-latency calls of these shapes."""
        return rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    def _ll(self) -> LowLatencyMode:
        self._check_live()
        if self.transport.checks_peers_each_call:
            self._check_peers()
        if self._low_latency is None:
            raise ValueError("low_latency_mode: this Buffer was made without low_latency_mode=True")
        return self._low_latency

    def _ll_run(self, fn: Callable[[LowLatencyMode], T]) -> T:
        """``fn(low-latency mode)``, a low-latency call; a failed wait on peers is raised as the peer that destroyed
        its Buffer, if one did (the kernel transports do not ask before each call)."""
        ll = self._ll()
        with self._naming_destroyed_peer():
            return fn(ll)

    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        dispatch_wait_recv_cost_stats: torch.Tensor | None = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
    ):
        """``x`` BF16 ``[N <= M, H]``, ``topk_idx`` ``[N, K]`` (-1 = none) → ``(recv_x, recv_count, handle, event,
        hook)``: ``recv_x`` ``[L, R*M, H]`` BF16, or ``(FP8, scales)`` with float32 scales ``[L, R*M, H/128]``
        (packed UE8M0 int32 ``[L, R*M, H/512]`` with ``use_ue8m0``); ``recv_count`` ``[L]`` int32 valid rows."""
        return self._ll_run(
            lambda ll: ll.dispatch(
                x,
                topk_idx,
                num_max_dispatch_tokens_per_rank,
                num_experts,
                cumulative_local_expert_recv_stats,
                dispatch_wait_recv_cost_stats,
                use_fp8,
                round_scale,
                use_ue8m0,
                async_finish,
                return_recv_hook,
            )
        )

    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: object,
        use_logfmt: bool = False,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: torch.Tensor | None = None,
        combine_wait_recv_cost_stats: torch.Tensor | None = None,
    ):
        """Expert outputs ``x`` BF16 ``[L, R*M, H]`` → ``(combined_x [N, H] BF16, event, hook)``:
        ``Σ_k topk_weights[t, k] · y`` over the token's experts in fp32."""
        return self._ll_run(
            lambda ll: ll.combine(
                x,
                topk_idx,
                topk_weights,
                handle,
                use_logfmt,
                zero_copy,
                async_finish,
                return_recv_hook,
                out,
                combine_wait_recv_cost_stats,
            )
        )

    def get_next_low_latency_combine_buffer(self, handle: object) -> torch.Tensor:
        """BF16 ``[L, R*M, H]``: write expert outputs here, then ``low_latency_combine(..., zero_copy=True)``."""
        return self._ll().combine_buffer(handle)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Reset the low-latency buffers (collective); results still waiting for a hook are dropped."""
        self._ll_run(lambda ll: ll.clean(num_max_dispatch_tokens_per_rank, hidden, num_experts))

    def _check_expert_handle(self, handle: object) -> DispatchHandle:
        handle = self._check_handle(handle)
        if handle.expert_layout is None:
            raise ValueError(
                "handle: it has no expert-major layout (it came from Buffer.dispatch; "
                "use the handle returned by Buffer.dispatch_experts)"
            )
        return handle


def _contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


def _tensors_in(outputs: tuple) -> list[torch.Tensor]:
    """Tensors inside a transport's outputs (tuples and result dataclasses), to mark their stream use."""
    found: list[torch.Tensor] = []
    for item in outputs:
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, tuple):
            found.extend(_tensors_in(item))
        elif hasattr(item, "__dataclass_fields__"):
            found.extend(_tensors_in(tuple(getattr(item, f) for f in item.__dataclass_fields__)))
    return found
