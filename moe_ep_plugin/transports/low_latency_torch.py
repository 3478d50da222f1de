"""Low-latency dispatch/combine as plain collectives (gloo on CPU, NCCL on GPU): the reference form of
DeepEP's fixed per-expert buffers, serving the same API and outputs as the kernels.

Each call first all-gathers a small header (shapes, options, which call, out-of-range id count, whether this rank
refused the call), so ranks that disagree, pass bad expert ids or refuse their input raise the same error on every
rank before any row moves. The rows
then travel in one fixed-shape ``all_to_all_single``, laid out as the kernels' buffers are: a slot per
(destination rank, local expert, source token) ``[R, L, M, ...]``. A dispatch slot holds a presence word, then
the BF16 row or the FP8 row and its float32 scales; a combine slot holds the expert's BF16 output row for that
token. The receive half (run at once, or by the hook) waits for that collective, at most the timeout, and
unpacks: rows of local expert ``l`` are packed by source rank, then source token (deterministic, where DeepEP's
kernels pack sources in arrival order), and combine sums ``topk_weights[t, k] * y`` over ``k`` ascending in fp32
from 0, rounding to BF16 once.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..ops import fp8
from ..ops.layout import count_invalid, invalid_ids_error
from .base import refusal_code
from .low_latency_base import DispatchOutput, DispatchRequest, LowLatencyHandle, elapsed_ns
from .torch_transport import TorchTransport

# The calls a header names (its first word: 1 + the index here).
CALLS = ("low_latency_dispatch", "low_latency_combine", "clean_low_latency_buffer")
_FIELDS = ("call", "num_max_dispatch_tokens_per_rank", "hidden", "num_experts", "use_fp8", "round_scale", "use_ue8m0")
_PRESENT = 4  # bytes of the presence word leading each dispatch slot


class _State:
    """Replay data of one dispatch on the expert side: ``rows`` ``[P]`` int64 flat index (into ``[L * R*M]``) of
    each received row, ``slots`` ``[P]`` int64 flat index (into ``[R, L, M]``) of its source slot."""

    def __init__(self) -> None:
        self.rows = torch.empty(0, dtype=torch.int64, device="cpu")
        self.slots = torch.empty(0, dtype=torch.int64, device="cpu")


class TorchLowLatency:
    """The low-latency calls over ``base``'s group with collectives (see the module docstring)."""

    name = "torch"
    hidden_sizes = None  # any multiple of 128

    def __init__(self, base: TorchTransport) -> None:
        self.base = base
        self.rank, self.num_ranks, self.device = base.rank, base.num_ranks, base.device
        self._combine_buffers: list[torch.Tensor | None] = [None, None]

    def lay_out(self, call: str, m: int, hidden: int, num_experts: int) -> None:
        """Nothing to agree on before ``call`` lays the buffer out: every call's header carries its shapes."""

    def refuse(self, call: str, exc: Exception, layout: tuple[int, int, int] | None, buffer_set: int) -> None:
        """This rank refuses ``call`` (``exc``: its bad input): join the call's header exchange so that every rank
        raises the cause, naming this rank (the header needs neither ``layout`` nor ``buffer_set``)."""
        agree(self.base, call, 0, 0, 0, refusal=exc)

    def _exchange(self, send: torch.Tensor, what: str) -> Callable[[], tuple[torch.Tensor, int]]:
        """Start the fixed-shape all-to-all of ``send`` ``[R, ...]`` (block ``r`` to rank ``r``); the returned function
        waits for it (at most the timeout) and returns ``(received [R, ...] by source, host ns waited)``."""
        received = torch.empty_like(send)
        if self.device.type == "cuda":  # stream-ordered: NCCL's own timeout covers a lost peer
            dist.all_to_all_single(received, send, group=self.base.group)
            return lambda: (received, 0)
        work = dist.all_to_all_single(received, send, group=self.base.group, async_op=True)

        def finish() -> tuple[torch.Tensor, int]:
            start = time.perf_counter()
            self.base._wait(work, what)
            return received, elapsed_ns(start)

        return finish

    # ---- dispatch ----
    def dispatch(self, req: DispatchRequest) -> DispatchOutput:
        x, idx, m, num_experts = req.x, req.topk_idx, req.num_max_dispatch_tokens_per_rank, req.num_experts
        n, hidden = x.shape
        num_ranks, num_local, dev = self.num_ranks, num_experts // self.num_ranks, x.device
        agree(self.base, CALLS[0], m, hidden, num_experts, (req.use_fp8, req.round_scale, req.use_ue8m0), idx)

        if req.use_fp8:
            q, scales = fp8.quantize(x, round_scale=req.round_scale)
            row = torch.cat([q.view(torch.uint8), scales.view(torch.uint8)], dim=1)
        else:
            row = x.view(torch.uint8)
        row_bytes = row.shape[1]
        # Slot of (token t, expert e) in the send block [R, L, M] flattened: (r * L + l) * M + t = e * M + t.
        valid = idx >= 0
        tokens = torch.arange(n, device=dev).unsqueeze(1).expand_as(idx)
        slot = (idx * m + tokens)[valid]
        src_token = tokens[valid]
        send = torch.zeros(num_ranks * num_local * m, _PRESENT + row_bytes, dtype=torch.uint8, device=dev)
        send[slot, 0] = 1
        send[slot, _PRESENT:] = row[src_token]
        finish_exchange = self._exchange(send.view(num_ranks, -1), "low_latency_dispatch")

        rows = num_ranks * m
        recv_x = torch.zeros(
            num_local, rows, hidden, dtype=fp8.FP8_DTYPE if req.use_fp8 else torch.bfloat16, device=dev
        )
        recv_scales = None
        if req.use_fp8:
            # Column-major in the last two dims, as DeepEP returns them (for TMA loads of a grouped GEMM).
            cols = hidden // (fp8.BLOCK * 4) if req.use_ue8m0 else hidden // fp8.BLOCK
            recv_scales = torch.zeros(
                num_local, cols, rows, dtype=torch.int32 if req.use_ue8m0 else torch.float32, device=dev
            ).transpose(1, 2)
        recv_count = torch.zeros(num_local, dtype=torch.int32, device=dev)
        src_info = torch.full((num_local, rows), -1, dtype=torch.int32, device=dev)
        layout_range = torch.zeros(num_local, num_ranks, dtype=torch.int64, device=dev)
        state = _State()
        handle = LowLatencyHandle(
            src_info, layout_range, m, hidden, num_experts, n, idx.shape[1], self.rank, num_ranks, state
        )

        def finish() -> int:
            received, waited = finish_exchange()
            received = received.view(num_ranks, num_local, m, _PRESENT + row_bytes)
            present = received[..., 0].permute(1, 0, 2).to(torch.int64)  # [L, R, M]
            per_source = present.sum(2)  # [L, R]
            recv_count.copy_(per_source.sum(1))
            layout_range.copy_(((per_source.cumsum(1) - per_source) << 32) | per_source)
            flat = present.reshape(num_local, rows)
            position = flat.cumsum(1) - 1  # row of each present slot inside its expert's block
            expert, slot_in_expert = flat.nonzero(as_tuple=True)  # ordered by expert, source rank, token
            state.rows = expert * rows + position[expert, slot_in_expert]
            source = slot_in_expert // m
            token = slot_in_expert % m
            state.slots = (source * num_local + expert) * m + token
            data = received.view(-1, _PRESENT + row_bytes)[state.slots, _PRESENT:]
            recv_x.view(-1, hidden).view(torch.uint8)[state.rows] = data[:, : hidden * recv_x.element_size()]
            src_info.view(-1)[state.rows] = token.to(torch.int32)
            if recv_scales is not None:
                got = data[:, hidden:].contiguous().view(torch.float32)
                if req.use_ue8m0:
                    got = fp8.pack_ue8m0(got)
                dense = torch.zeros(num_local * rows, got.shape[1], dtype=got.dtype, device=dev)
                dense[state.rows] = got
                recv_scales.copy_(dense.view(num_local, rows, -1))
            return waited

        return DispatchOutput(recv_x, recv_scales, recv_count, handle, finish)

    # ---- combine ----
    def combine_buffer(self, handle: LowLatencyHandle, buffer_set: int) -> torch.Tensor:
        shape = (handle.num_local_experts, self.num_ranks * handle.num_max_dispatch_tokens_per_rank, handle.hidden)
        buf = self._combine_buffers[buffer_set]
        if buf is None or tuple(buf.shape) != shape:
            buf = torch.zeros(shape, dtype=torch.bfloat16, device=self.device)
            self._combine_buffers[buffer_set] = buf
        return buf

    def combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: LowLatencyHandle,
        zero_copy: bool,
        out: torch.Tensor,
        buffer_set: int,
    ) -> Callable[[], int]:
        m, hidden, num_experts = handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts
        agree(self.base, CALLS[1], m, hidden, num_experts, topk_idx=topk_idx)
        if zero_copy:
            x = self.combine_buffer(handle, buffer_set)
        state: _State = handle.transport_state
        send = torch.zeros(self.num_ranks * handle.num_local_experts * m, hidden, dtype=torch.bfloat16, device=x.device)
        send[state.slots] = x.reshape(-1, hidden)[state.rows]
        finish_exchange = self._exchange(send.view(self.num_ranks, -1), "low_latency_combine")
        n = handle.num_tokens

        def finish() -> int:
            received, waited = finish_exchange()
            by_expert = received.view(num_experts, m, hidden)  # [r * L + l] = global expert
            tokens = torch.arange(n, device=x.device)
            acc = torch.zeros(n, hidden, dtype=torch.float32, device=x.device)
            for k in range(topk_idx.shape[1]):
                e = topk_idx[:, k]
                y = by_expert[e.clamp_min(0), tokens].float()
                acc = torch.where((e >= 0).unsqueeze(1), acc + topk_weights[:, k : k + 1] * y, acc)
            out.copy_(acc)
            return waited

        return finish

    def clean(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        agree(self.base, CALLS[2], num_max_dispatch_tokens_per_rank, hidden, num_experts)
        for buf in self._combine_buffers:
            if buf is not None:
                buf.zero_()


def agree(
    exchange: TorchTransport,
    call: str,
    m: int,
    hidden: int,
    num_experts: int,
    flags: tuple[bool, bool, bool] = (False, False, False),
    topk_idx: torch.Tensor | None = None,
    refusal: Exception | None = None,
) -> None:
    """All-gather the header of ``call`` (one of ``CALLS``) over ``exchange``'s group: its shapes, ``flags``
    (``use_fp8``, ``round_scale``, ``use_ue8m0``), how many ``topk_idx`` entries lie outside ``[-1, num_experts)``
    and whether this rank refused the call. Raises the same error on every rank if a rank refused (``refusal``: its
    bad input; the messages follow in a second exchange), ranks differ in the call or its shapes, or any rank passed
    such ids."""
    device = exchange.device
    bad = (
        count_invalid(topk_idx, num_experts).to(torch.int64)
        if topk_idx is not None
        else torch.zeros(1, dtype=torch.int64, device=device)
    )
    header = torch.cat(
        [
            torch.tensor(
                [CALLS.index(call) + 1, m, hidden, num_experts, *flags, refusal_code(refusal)],
                dtype=torch.int64,
                device=device,
            ),
            bad,
        ]
    )
    table = exchange._start_count_exchange(header, f"{call} header exchange")[1]().tolist()
    exchange._check_refusals(call, [row[len(_FIELDS)] for row in table], refusal)
    for i, name in enumerate(_FIELDS):
        values = [row[i] for row in table]
        if len(set(values)) > 1:
            if i == 0:
                named = [CALLS[v - 1] if 0 < v <= len(CALLS) else v for v in values]
                raise ValueError(
                    f"{call}: ranks are in different low-latency calls: {named} (every rank raises; nothing was sent)"
                )
            raise ValueError(
                f"{name}: ranks disagree in {call}: {values} by rank (every rank raises; nothing was sent)"
            )
    bad_ranks = [r for r, row in enumerate(table) if row[-1]]
    if bad_ranks:
        raise invalid_ids_error(bad_ranks, num_experts)
