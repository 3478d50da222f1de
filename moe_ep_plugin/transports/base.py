"""The interface every transport implements; ``Buffer`` validates, keeps streams and calls these.

A transport only moves rows. Inputs reaching it are already validated (dtypes, shapes, devices, ranges),
run on the right stream, and are contiguous.
"""

from __future__ import annotations

import abc
import array
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import Config
from ..handle import DispatchHandle, ExpertLayout, rounded_counts
from ..ops import permute
from ..ops.layout import dispatch_layout


@dataclass
class DispatchArgs:
    """One dispatch. ``x``: ``[N, H]`` BF16/FP32, or FP8 e4m3 with ``x_scales`` ``[N, H/128]`` float32.

    ``wire_fp8``: BF16 ``x`` is quantized to FP8 (1x128 blocks) before it is sent (``round_scale``: UE8M0
    scales); ``fp8_out``: those rows arrive as FP8 with their scales, else dequantized back to the dtype of ``x``
    (the Buffer's keyword of the same name; without ``wire_fp8`` rows arrive as they were sent). ``topk_idx``
    holds *global* expert ids (-1 = none); with ``handle`` set it is None (cached layout).
    ``num_tokens_per_expert`` ``[E]`` int32: the layout's per-expert counts when the caller has them; without
    top-k they give the received per-expert counts.
    """

    x: torch.Tensor
    x_scales: torch.Tensor | None
    topk_idx: torch.Tensor | None
    topk_weights: torch.Tensor | None
    num_tokens_per_rank: torch.Tensor | None
    is_token_in_rank: torch.Tensor | None
    num_experts: int
    handle: DispatchHandle | None
    num_worst_tokens: int
    wire_fp8: bool
    fp8_out: bool
    round_scale: bool
    config: Config
    num_tokens_per_expert: torch.Tensor | None = None
    layout_given: bool = False  # the layout tensors came from the caller (else the Buffer derived them from top-k)


@dataclass
class DispatchResult:
    """``recv_x`` ``[N_recv, H]`` (BF16/FP32 or FP8), ``recv_scales`` ``[N_recv, H/128]`` float32 or None,
    ``recv_topk_idx`` ``[N_recv, K]`` int64 *local* ids (-1 elsewhere), ``recv_topk_weights`` float32 (0 where -1),
    ``num_recv_tokens_per_expert`` ``[L]`` int32 on the device (unaligned) or None without top-k;
    ``host_counts``: the same counts as a list when the transport already read them on the host (saves a sync)."""

    recv_x: torch.Tensor
    recv_scales: torch.Tensor | None
    recv_topk_idx: torch.Tensor | None
    recv_topk_weights: torch.Tensor | None
    num_recv_tokens_per_expert: torch.Tensor | None
    handle: DispatchHandle
    host_counts: list[int] | None = None

    def counts_list(self) -> list[int]:
        """Received (row, local expert) pairs per local expert (unaligned), read once if the transport has not."""
        if self.host_counts is None:
            self.host_counts = self.num_recv_tokens_per_expert.tolist()
        return self.host_counts


@dataclass
class ExpertDispatchResult:
    """Received rows in the expert-major layout (``handle.expert_layout``): ``x`` ``[M, H]`` (BF16/FP32 or FP8,
    padding rows zero), ``x_scales`` ``[M, H/128]`` float32 for FP8 rows else None, ``probs`` ``[M]`` float32
    (the top-k weight of each row's pair, 0 on padding) or None without weights (always None for a cached layout)."""

    x: torch.Tensor
    x_scales: torch.Tensor | None
    probs: torch.Tensor | None
    handle: DispatchHandle


# The words of a dispatch every rank must agree on; each transport exchanges them with its counts (before any row
# moves) and raises on every rank alike when they differ.
META_FIELDS = ("num_experts", "hidden", "x dtype", "top-k width", "topk_weights given", "FP8 rows on the wire")


def dispatch_meta(args: DispatchArgs) -> list[int]:
    """``len(META_FIELDS)`` ints describing ``args`` (a top-k width of 0: no top-k)."""
    k = args.topk_idx.shape[1] if args.topk_idx is not None else 0
    return [
        args.num_experts,
        args.x.shape[1],
        permute.DTYPE_CODES[args.x.dtype],
        k,
        int(args.topk_weights is not None),
        int(args.wire_fp8 or args.x_scales is not None),
    ]


def meta_mismatch(rows: list[list[int]]) -> ValueError | None:
    """The error for every rank's ``dispatch_meta`` words (``rows[r]``) when they differ, else None."""
    fields = [f for f in range(len(META_FIELDS)) if any(row[f] != rows[0][f] for row in rows)]
    if not fields:
        return None
    ranks = [r for r, row in enumerate(rows) if row != rows[0]]
    names = {code: str(dtype).removeprefix("torch.") for dtype, code in permute.DTYPE_CODES.items()}
    shown = "; ".join(
        META_FIELDS[f]
        + ": "
        + ", ".join(f"rank {r} {names.get(row[f], row[f]) if f == 2 else row[f]}" for r, row in enumerate(rows))
        for f in fields
    )
    return metadata_error(fields, ranks, f" ({shown})")


def metadata_error(fields: list[int], ranks: list[int], values: str = "") -> ValueError:
    """The error every rank raises when ranks passed dispatches that differ in ``META_FIELDS[fields]``."""
    return ValueError(
        f"dispatch: the ranks disagree on {', '.join(META_FIELDS[f] for f in fields)}: rank(s) {ranks} "
        f"differ from rank 0{values}; every rank raises before any row moves"
    )


def layout_error(ranks: list[int]) -> ValueError:
    """The error every rank raises when the layout tensors of ``ranks`` contradict their top-k (or themselves)."""
    return ValueError(
        f"num_tokens_per_rank/is_token_in_rank: on rank(s) {ranks} they contradict topk_idx (or "
        "num_tokens_per_rank is not is_token_in_rank.sum(0)); pass get_dispatch_layout's outputs, or "
        "only topk_idx and num_experts; every rank raises before any row moves"
    )


def layout_contradiction(args: DispatchArgs) -> torch.Tensor:
    """``[1]`` int64: 2 when the caller's ``num_tokens_per_rank`` holds negative counts, else 1 when the caller's
    layout contradicts itself or the top-k, else 0 (checked only for a layout the caller passed; on the device, no
    host sync)."""
    if not args.layout_given:
        return torch.zeros(1, dtype=torch.int64, device=args.x.device)
    in_rank = args.is_token_in_rank
    per_rank = args.num_tokens_per_rank.to(torch.int64)
    bad = (per_rank != in_rank.sum(0)).any()
    if args.topk_idx is not None:
        derived = dispatch_layout(args.topk_idx, args.num_experts, in_rank.shape[1])[2]
        bad = bad | (derived != in_rank).any()
    return torch.where((per_rank < 0).any(), 2, bad.to(torch.int64)).reshape(1)


def padded(t: torch.Tensor, rows: int, fill: float) -> torch.Tensor:
    """``t`` ``[n, ...]`` extended to ``rows`` rows of ``fill`` (``num_worst_tokens`` outputs)."""
    if t.shape[0] == rows:
        return t
    out = t.new_full((rows,) + tuple(t.shape[1:]), fill)
    out[: t.shape[0]] = t
    return out


# A call one rank refuses (bad input on that rank only) must not leave its peers waiting for it: the refusing rank
# joins the call's first exchange with the error's class and then its message, so every rank raises the cause.
REFUSABLE = (ValueError, TypeError, RuntimeError)
REFUSAL_WORDS = 64  # int64 words of a refusal's message (512 UTF-8 bytes, cut beyond)
# The calls a kernel refusal word names (csrc/moe_ep.h MOE_EP_ERR_REFUSED: refusal code | index << 8).
REFUSED_CALLS = ("dispatch", "low_latency_dispatch", "low_latency_combine")


def refusal_code(exc: BaseException | None) -> int:
    """0 without ``exc``, else 1 + the index of its class in ``REFUSABLE``."""
    return 0 if exc is None else 1 + next(i for i, cls in enumerate(REFUSABLE) if isinstance(exc, cls))


def refusal_words(exc: BaseException | None, device: torch.device) -> torch.Tensor:
    """``[REFUSAL_WORDS]`` int64 holding ``str(exc)`` (zeros without ``exc``)."""
    raw = bytearray(8 * REFUSAL_WORDS)
    text = b"" if exc is None else str(exc).encode()[: len(raw)]
    raw[: len(text)] = text
    return torch.frombuffer(raw, dtype=torch.int64).to(device)


def refusal_error(what: str, codes: list[int], words: list[list[int]]) -> Exception:
    """The error every rank raises when the ranks with a non-zero ``codes[r]`` refused ``what``; ``words[r]``:
    their ``refusal_words``. Of the first refusing rank's class."""
    ranks = [r for r, code in enumerate(codes) if code]
    causes = "; ".join(
        f"rank {r}: " + array.array("q", words[r]).tobytes().rstrip(b"\0").decode(errors="replace") for r in ranks
    )
    return REFUSABLE[codes[ranks[0]] - 1](
        f"{what}: rank(s) {ranks} refused the call ({causes}); every rank raises, nothing was sent"
    )


def refused(call: str, exc: Exception) -> Exception:
    """``exc`` as the refusal of a dispatch: of its class, its message led by ``call`` when that is another call
    (the layout that precedes the dispatch)."""
    return exc if call == "dispatch" else REFUSABLE[refusal_code(exc) - 1](f"{call}: {exc}")


def negative_counts_error(ranks: list[int]) -> ValueError:
    """The error every rank raises when the ``num_tokens_per_rank`` of ``ranks`` hold negative counts."""
    return ValueError(
        f"num_tokens_per_rank: counts must be >= 0; rank(s) {ranks} passed negative ones (pass "
        "get_dispatch_layout's outputs); every rank raises before any row moves"
    )


def bias_sum(bias: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``[N, H]`` fp32: the biases (at least one) summed in order from 0.0, where combine's sum starts."""
    acc = bias[0].to(torch.float32, copy=True)
    for b in bias[1:]:
        acc += b.float()
    return acc


def slot_weights(expert_weights: torch.Tensor | None, layout: ExpertLayout) -> torch.Tensor | None:
    """``expert_weights`` ``[M]`` float32 → ``[N_recv, K]``: each received (row, column) pair's value, 0 where the
    column has no local expert (None stays None)."""
    if expert_weights is None:
        return None
    # A zero appended at index M serves every -1 slot: a negative index counts from the end, so the int32 slots
    # index directly (three ops instead of six).
    return torch.cat([expert_weights, expert_weights.new_zeros(1)])[layout.recv_slot]


class Transport(abc.ABC):
    """Moves rows between the ranks of ``group``. ``timeout_s`` bounds every wait on a peer."""

    name: str = "abstract"
    # dispatch_experts derives the layout from top-k itself (DispatchArgs then carries no layout tensors)
    expert_layout_from_topk: bool = False
    # The Buffer asks the store before each call whether a peer destroyed its Buffer (a round trip, small beside
    # the host-waited collectives of the torch transports); otherwise only once a wait on peers failed.
    checks_peers_each_call: bool = False

    def __init__(self, group: dist.ProcessGroup, device: torch.device, timeout_s: float) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.device = device
        self.timeout_s = timeout_s

    def check_error(self) -> None:
        """Raise the error a kernel of this transport recorded (a wait on a peer that timed out, ranks that
        disagree); the Buffer calls it before any other work of an entry point, since such a kernel trapped and
        any CUDA call would fail first without naming why. Default: nothing records."""
        # Not abstract: a transport whose kernels record no errors keeps this no-op.
        return None

    def refuse(self, call: str, exc: Exception) -> None:
        """This rank refuses ``call`` (``exc``: its bad input to a fresh dispatch, or to the layout that precedes
        one): join the count exchange its peers' fresh dispatch starts with, so that every rank raises the cause
        naming this rank. Default: nothing to join (a one-rank group), and the caller raises ``exc``."""
        # Not abstract: a transport without peers keeps this no-op.
        return None

    def get_dispatch_layout(
        self, topk_idx: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``topk_idx`` ``[N, K]`` int64 → ``(num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32,
        is_token_in_rank [N, R] bool)``. Default: plain torch ops on the tensor's device (no communication)."""
        return dispatch_layout(topk_idx, num_experts, self.num_ranks)

    def num_tokens_per_node(self, is_token_in_rank: torch.Tensor) -> torch.Tensor | None:
        """``[M]`` int32 tokens with an expert on each node (DeepEP's ``num_tokens_per_rdma_rank``) when the
        group spans nodes; None for one-host transports."""
        return None

    @abc.abstractmethod
    def dispatch(self, args: DispatchArgs) -> DispatchResult:
        """Send row ``t`` of ``x`` once to every rank with ``is_token_in_rank[t, r]``; see ``DispatchResult``."""

    @abc.abstractmethod
    def combine(
        self,
        x: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: torch.Tensor | None,
        bias: tuple[torch.Tensor, ...],
        config: Config,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Reverse of dispatch: ``x`` ``[N_recv, H]`` → ``[N, H]``: per token, fp32 from its ``bias`` rows
        (``[N, H]``, in order), plus its copies in ``ops.layout.summing_order`` (DeepEP V2's), cast to ``x.dtype``;
        ``topk_weights`` ``[N_recv, K]`` summed over the copies in fp32."""

    def start_dispatch(self, args: DispatchArgs) -> Callable[[], DispatchResult]:
        """:meth:`dispatch` in two steps: issue it, and a function that completes it and returns its result. Work
        queued between the two overlaps the exchange where the transport moves rows asynchronously (the
        ``hierarchical`` transport's chunk pipeline); this default runs the whole dispatch at once."""
        result = self.dispatch(args)
        return lambda: result

    def start_combine(
        self,
        x: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: torch.Tensor | None,
        bias: tuple[torch.Tensor, ...],
        config: Config,
    ) -> Callable[[], tuple[torch.Tensor, torch.Tensor | None]]:
        """:meth:`combine` in two steps, as :meth:`start_dispatch`; this default runs the whole combine at once."""
        result = self.combine(x, handle, topk_weights, bias, config)
        return lambda: result

    def dispatch_experts(self, args: DispatchArgs, alignment: int) -> ExpertDispatchResult:
        """:meth:`dispatch`, then the received rows laid out expert-major (blocks padded to ``alignment``).

        With ``args.handle`` (cached, no top-k) the handle's ``expert_layout`` is reused without a host sync;
        otherwise the per-expert counts are read once (the only host sync beyond :meth:`dispatch`'s) and the
        layout is stored on the returned handle. Transports with fused kernels override this.
        """
        result = self.dispatch(args)
        handle = result.handle
        if args.handle is None:
            tokens_per_expert = rounded_counts(result.counts_list(), alignment)
            recv_slot, _ = permute.expert_slots(result.recv_topk_idx, len(tokens_per_expert), alignment)
            handle.expert_layout = ExpertLayout(recv_slot, tokens_per_expert, sum(tokens_per_expert), alignment)
        layout = handle.expert_layout
        x, probs, scales = permute.permute(
            result.recv_x, layout.recv_slot, layout.num_rows, result.recv_topk_weights, result.recv_scales
        )
        return ExpertDispatchResult(x, scales, probs, handle)

    def combine_experts(
        self,
        y: torch.Tensor,
        handle: DispatchHandle,
        expert_weights: torch.Tensor | None,
        bias: tuple[torch.Tensor, ...],
        config: Config,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Reverse of :meth:`dispatch_experts`: ``y`` ``[M, H]`` BF16/FP32 → ``([N, H] y.dtype, [N, K] float32
        or None)``.

        Each received row sums its experts' rows (``permute.unpermute``: top-k columns ascending, fp32, rounded
        once), then :meth:`combine` sums over ranks with ``bias``. ``expert_weights`` ``[M]`` float32 reach column
        ``k`` of their token through ``recv_slot`` (0 where the column's expert is not local); padding rows are
        ignored.
        """
        layout: ExpertLayout = handle.expert_layout
        recv_y = permute.unpermute(y, layout.recv_slot)
        return self.combine(recv_y, handle, slot_weights(expert_weights, layout), bias, config)
