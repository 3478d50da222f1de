"""Received rows ↔ the expert-major layout a grouped GEMM wants, for transports without fused kernels.

Layout on a receiving rank: local expert ``l`` owns rows ``[base[l], base[l] + tokens_per_expert[l])`` (base =
exclusive cumsum); ``tokens_per_expert[l]`` = received (row, ``l``) pairs rounded up to ``alignment``. Inside a
block rows follow received-row order (then top-k column); padding rows (zeros, prob 0) end the block.
``recv_slot [N, K] int32`` is the expert-major row of every (received row, top-k column), -1 where the column
names no local expert.

CUDA tensors go through the kernels of ``csrc/kernels/permute.cuh`` when the kernel library loads, everything else
through torch ops; both give the same bits. No host syncs. Not differentiable by themselves (``autograd.py``).
"""

from __future__ import annotations

import functools

import torch

from ..config import positive_int, round_up
from ..event import current_stream_handle
from . import library
from .library import ptr as _ptr

_MAX_KERNEL_LOCAL_EXPERTS = library.PERMUTE_MAX_LOCAL_EXPERTS
_MAX_KERNEL_TOPK = library.PERMUTE_MAX_TOPK
# The one table of dtype codes: the element types the kernels sum (csrc/moe_ep.h MOE_EP_DTYPE_*), FP8 after them;
# also the dtype word of the dispatch_meta (and the hierarchical transport's signature) every rank checks.
DTYPE_CODES = {
    torch.float32: library.DTYPE_FP32,
    torch.bfloat16: library.DTYPE_BF16,
    torch.float16: library.DTYPE_FP16,
    torch.float8_e4m3fn: 3,
}
# The dtypes of rows the Buffer dispatches and combines (FP8 rows are dispatched only, as an (x, scales) pair)
ROW_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INT32_MAX = 2**31 - 1


def expert_slots(
    recv_topk_idx: torch.Tensor, num_local_experts: int, alignment: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``recv_topk_idx`` ``[N, K]`` int64 local expert ids (-1 = none; ids outside ``[0, L)`` count as none),
    ``num_local_experts`` L, ``alignment`` >= 1 → ``(recv_slot [N, K] int32, words [2 + L] int64)`` on its device,
    with no host sync. ``words``: the rows naming a local expert, the ids outside ``[-1, L)``, then the pairs of each
    local expert rounded up to ``alignment`` (``tokens_per_expert``; a dispatch reads all of them in one host read).
    """
    if not isinstance(recv_topk_idx, torch.Tensor) or recv_topk_idx.dim() != 2 or recv_topk_idx.shape[1] < 1:
        raise ValueError(f"recv_topk_idx: expected an [N, K] tensor with K >= 1, got {_describe(recv_topk_idx)}")
    if recv_topk_idx.dtype != torch.int64:
        raise TypeError(f"recv_topk_idx: expected int64, got {recv_topk_idx.dtype}")
    num_local = positive_int(num_local_experts, "num_local_experts")
    positive_int(alignment, "alignment", 1, _INT32_MAX)
    n, k = recv_topk_idx.shape
    if n * k + num_local * (alignment - 1) > _INT32_MAX:  # the most rows the layout can have
        raise ValueError(
            f"recv_topk_idx: {n} x {k} entries over {num_local} experts aligned to {alignment} exceed int32 slots"
        )
    idx = recv_topk_idx.contiguous()
    if not (kernels_for(idx) and num_local <= _MAX_KERNEL_LOCAL_EXPERTS):
        return _torch_expert_slots(idx, num_local, alignment)
    slot = torch.empty(n, k, dtype=torch.int32, device=idx.device)
    if not n:
        return slot, torch.zeros(2 + num_local, dtype=torch.int64, device=idx.device)
    words = torch.empty(2 + num_local, dtype=torch.int64, device=idx.device)
    blocks = torch.cuda.get_device_properties(idx.device).multi_processor_count
    workspace = torch.empty(blocks * (num_local + 2), dtype=torch.int32, device=idx.device)
    _launch(
        idx,
        "moe_ep_expert_slots",
        idx.data_ptr(),
        n,
        k,
        num_local,
        alignment,
        slot.data_ptr(),
        words.data_ptr(),
        workspace.data_ptr(),
        blocks,
    )
    return slot, words


def permute(
    recv_x: torch.Tensor,
    recv_slot: torch.Tensor,
    num_rows: int,
    recv_weights: torch.Tensor | None = None,
    recv_scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``recv_x`` ``[>= N, H]`` (any dtype; FP8 moves as bytes), ``recv_slot`` ``[N, K]`` int32, ``num_rows`` M,
    ``recv_weights`` ``[N, K]`` float32, ``recv_scales`` ``[>= N, S]`` float32 → ``(x [M, H] recv_x.dtype,
    probs [M] float32 or None, scales [M, S] float32 or None)``.

    Row ``recv_slot[r, k]`` of the outputs gets row ``r`` (and weight ``[r, k]``); rows no slot names (padding)
    are zero. Slots outside ``[0, M)`` are ignored. Rows of ``recv_x``/``recv_scales`` from ``N`` on are not read (a
    transport's receive buffers may hold more rows than it received).
    """
    if not isinstance(recv_x, torch.Tensor) or recv_x.dim() != 2:
        raise ValueError(f"recv_x: expected a 2-D [rows, hidden] tensor, got {_describe(recv_x)}")
    _check_slots(recv_slot, recv_x)
    positive_int(num_rows, "num_rows", 0, _INT32_MAX)
    n, k = recv_slot.shape
    _check_float32("recv_weights", recv_weights, recv_x, n, (n, k))
    _check_float32("recv_scales", recv_scales, recv_x, n, None)
    x = recv_x if recv_x.is_contiguous() else recv_x[:n].contiguous()
    slot = recv_slot.contiguous()
    weights = None if recv_weights is None else recv_weights.contiguous()
    scales = recv_scales if recv_scales is None or recv_scales.is_contiguous() else recv_scales[:n].contiguous()
    # no rows (n = 0): only padding to write, and empty inputs may have null data pointers the kernel refuses
    if not (n and 1 <= k <= _MAX_KERNEL_TOPK and _kernel_rows(x)):
        with torch.no_grad():  # like the kernels, the torch path records no graph: autograd.py owns the gradients
            return _torch_permute(x[:n], slot, num_rows, weights, None if scales is None else scales[:n])
    out_x = torch.empty(num_rows, x.shape[1], dtype=x.dtype, device=x.device)
    out_probs = None if weights is None else torch.empty(num_rows, dtype=torch.float32, device=x.device)
    out_scales = (
        None if scales is None else torch.empty(num_rows, scales.shape[1], dtype=torch.float32, device=x.device)
    )
    if num_rows == 0:  # nothing to write (and empty outputs may have null data pointers)
        return out_x, out_probs, out_scales
    covered = torch.empty(num_rows, dtype=torch.uint8, device=x.device)
    _launch(
        x,
        "moe_ep_permute",
        x.data_ptr(),
        slot.data_ptr(),
        _ptr(weights),
        _ptr(scales),
        n,
        k,
        x.shape[1] * x.element_size(),
        0 if scales is None else scales.shape[1],
        num_rows,
        out_x.data_ptr(),
        _ptr(out_probs),
        _ptr(out_scales),
        covered.data_ptr(),
    )
    return out_x, out_probs, out_scales


def unpermute(y: torch.Tensor, recv_slot: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``y`` ``[M, H]`` BF16/FP16/FP32 expert outputs, ``recv_slot`` ``[N, K]`` int32 → ``[N, H]`` ``y.dtype``, written
    into ``out`` when given (contiguous ``[N, H]`` ``y.dtype`` on ``y``'s device; e.g. the nvlink transport's own
    peer region, where its combine reads the rows).

    ``out[r]`` = sum over k ascending of ``y[recv_slot[r, k]]`` (slots in ``[0, M)`` only), accumulated in fp32
    from 0.0 and rounded once (rows without slots are 0): the order the nvlink combine kernel uses too.
    """
    _check_float_rows("y", y)
    _check_slots(recv_slot, None)
    if recv_slot.device != y.device:
        raise ValueError(f"recv_slot: expected a tensor on {y.device}, got {recv_slot.device}")
    shape = (recv_slot.shape[0], y.shape[1])
    if out is not None and not (
        isinstance(out, torch.Tensor)
        and tuple(out.shape) == shape
        and out.dtype == y.dtype
        and out.device == y.device
        and out.is_contiguous()
    ):
        raise ValueError(
            f"out: expected a contiguous {list(shape)} {y.dtype} tensor on {y.device}, got {_describe(out)}"
        )
    y = y.contiguous()
    slot = recv_slot.contiguous()
    if not (1 <= slot.shape[1] <= _MAX_KERNEL_TOPK and _kernel_rows(y)):
        with torch.no_grad():
            result = _torch_unpermute(y, slot)
        return result if out is None else out.copy_(result)
    if out is None:
        out = torch.empty(shape, dtype=y.dtype, device=y.device)
    _launch(
        y,
        "moe_ep_unpermute",
        y.data_ptr(),
        slot.data_ptr(),
        slot.shape[0],
        slot.shape[1],
        y.shape[1],
        y.shape[0],
        DTYPE_CODES[y.dtype],
        out.data_ptr(),
    )
    return out


def unpermute_onto(acc: torch.Tensor, y: torch.Tensor, recv_slot: torch.Tensor) -> torch.Tensor:
    """``acc`` ``[N, H]`` fp32 (a combine's biases) plus ``y[recv_slot[r, k]]`` for k ascending, in fp32 → a new
    ``[N, H]`` fp32 tensor; a slot outside ``[0, M)`` adds nothing (not even +0.0, so a -0.0 stays). Torch ops."""
    return _sum_slots(acc, y, recv_slot)


# --- torch implementations (CPU, or CUDA without the kernel library); the kernels must match them bit for bit ---


def _torch_expert_slots(idx: torch.Tensor, num_local: int, alignment: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(recv_slot [N, K] int32, words [2 + L] int64)`` as :func:`expert_slots` returns them: a stable sort by expert
    puts the pairs in layout order; each pair's row is its expert's base plus its rank among that expert's pairs."""
    flat = idx.reshape(-1)
    local = (flat >= 0) & (flat < num_local)
    key = torch.where(local, flat, num_local)  # num_local = no local expert: sorts last
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=idx.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    aligned = round_up(counts[:num_local], alignment)
    base = torch.cumsum(aligned, 0) - aligned
    first = torch.cumsum(counts, 0) - counts  # first sorted position of each key
    order = torch.sort(key, stable=True).indices
    sorted_key = key[order]
    rank = torch.arange(flat.numel(), device=idx.device) - first[sorted_key]
    sorted_slot = torch.where(sorted_key < num_local, base[sorted_key.clamp_max(num_local - 1)] + rank, -1)
    slot = torch.empty_like(flat, dtype=torch.int32).index_copy_(0, order, sorted_slot.to(torch.int32))
    rows = local.view(idx.shape).any(1).sum(dtype=torch.int64).reshape(1)
    invalid = ((flat < -1) | (flat >= num_local)).sum(dtype=torch.int64).reshape(1)
    return slot.view(idx.shape), torch.cat([rows, invalid, aligned])


def _torch_permute(
    x: torch.Tensor, slot: torch.Tensor, num_rows: int, weights: torch.Tensor | None, scales: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Every output row gathers its source row in one ``index_select`` (rows no slot names read an appended zero
    row): one pass over the output instead of one scatter of ``x`` per top-k column."""
    n, k = slot.shape
    dest = _dump_invalid(slot, num_rows).reshape(-1)
    # src[m]: the received row that lands in row m, n (the zero row) where none does; the dump row is dropped.
    src = torch.full((num_rows + 1,), n, dtype=torch.int64, device=x.device)
    src = src.index_copy_(0, dest, torch.arange(n, device=x.device).repeat_interleave(k))[:num_rows]
    # Rows move as bytes: FP8 (and any other dtype) then needs no index kernels of its own.
    out_x = _with_zero_row(x.view(torch.uint8)).index_select(0, src).view(x.dtype)
    out_probs = out_scales = None
    if weights is not None:
        out_probs = torch.zeros(num_rows + 1, dtype=torch.float32, device=x.device)
        out_probs = out_probs.index_copy_(0, dest, weights.reshape(-1))[:num_rows]
    if scales is not None:
        out_scales = _with_zero_row(scales).index_select(0, src)
    return out_x, out_probs, out_scales


def _torch_unpermute(y: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """Top-k columns in ascending order, each adding its gathered rows to an fp32 sum from 0.0."""
    return _sum_slots(None, y, slot).to(y.dtype)


def _sum_slots(start: torch.Tensor | None, y: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """fp32 ``[N, H]``: ``start`` (0.0 when None) plus the rows of ``y`` that ``slot``'s columns name, in column
    order; invalid slots add nothing."""
    m = y.shape[0]
    out = (
        torch.zeros(slot.shape[0], y.shape[1], dtype=torch.float32, device=y.device) if start is None else start.clone()
    )
    if m == 0:
        return out
    # y converted to fp32 once, with a zero row at m that invalid slots gather: two passes per column
    # (gather, add) instead of four (gather, convert, mask, add).
    padded = torch.zeros(m + 1, y.shape[1], dtype=torch.float32, device=y.device)
    padded[:m] = y
    s = _dump_invalid(slot, m)
    for j in range(slot.shape[1]):
        rows = padded.index_select(0, s[:, j])
        if start is None:  # from +0.0 a sum never becomes -0.0, so adding the zero row equals skipping it
            out += rows
        else:
            out = torch.where((s[:, j] < m).unsqueeze(1), out + rows, out)
    return out


def _with_zero_row(t: torch.Tensor) -> torch.Tensor:
    """``t`` ``[n, ...]`` with a row of zeros appended (row ``n``)."""
    return torch.cat([t, t.new_zeros((1,) + tuple(t.shape[1:]))])


def _dump_invalid(slot: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``slot`` as int64 with every slot outside ``[0, num_rows)`` replaced by the dump row ``num_rows``."""
    s = slot.long()
    return torch.where((s >= 0) & (s < num_rows), s, num_rows)


# --- kernels and validation helpers ---


@functools.lru_cache(maxsize=1)
def _kernels() -> object | None:
    """The kernel library, or None when it is missing or stale."""
    try:
        return library.load()
    except OSError:
        return None


def kernels_for(t: torch.Tensor) -> bool:
    """Whether ``t``'s operations run on the kernels (a CUDA tensor and the library loads)."""
    return t.is_cuda and _kernels() is not None


def _launch(t: torch.Tensor, function: str, *args: int) -> None:
    """Calls C ``function`` with ``args`` and ``t``'s current stream, on ``t``'s device (switching device only
    when it is not the current one: the switch costs more host time than the launch)."""
    index = t.get_device()  # an int: no torch.device object
    call = getattr(_kernels(), function)
    if index == torch.cuda.current_device():
        code = call(*args, current_stream_handle(index))
    else:
        with torch.cuda.device(index):
            code = call(*args, current_stream_handle(index))
    if code:
        library.check(code, function)


def _kernel_rows(t: torch.Tensor) -> bool:
    """Whether the kernels take the rows of 2-D ``t``: a CUDA tensor with the library loaded, rows a positive
    multiple of 16 bytes, the data 16-byte aligned."""
    row_bytes = t.shape[1] * t.element_size()
    return kernels_for(t) and row_bytes > 0 and row_bytes % 16 == 0 and t.data_ptr() % 16 == 0


def _check_float_rows(name: str, t: object) -> None:
    """``t`` is a 2-D BF16/FP16/FP32 tensor (expert outputs or rows to sum), else the error names ``name``."""
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D [rows, hidden] tensor, got {_describe(t)}")
    if t.dtype not in ROW_DTYPES:
        raise TypeError(f"{name}: expected BF16, FP16 or FP32, got {t.dtype}")


def _describe(t: object) -> str:
    return f"shape {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def _check_slots(recv_slot: torch.Tensor, recv_x: torch.Tensor | None) -> None:
    """``recv_slot`` is ``[N, K]`` int32 with K >= 1 (N at most ``recv_x``'s rows, on its device, when given)."""
    rows = "N" if recv_x is None else f"<= {recv_x.shape[0]}"
    if (
        not isinstance(recv_slot, torch.Tensor)
        or recv_slot.dim() != 2
        or recv_slot.shape[1] < 1
        or (recv_x is not None and recv_slot.shape[0] > recv_x.shape[0])
    ):
        raise ValueError(f"recv_slot: expected [{rows}, K] with K >= 1, got {_describe(recv_slot)}")
    if recv_slot.dtype != torch.int32:
        raise TypeError(f"recv_slot: expected int32 (from expert_slots), got {recv_slot.dtype}")
    if recv_x is not None and recv_slot.device != recv_x.device:
        raise ValueError(f"recv_slot: expected a tensor on {recv_x.device}, got {recv_slot.device}")


def _check_float32(
    name: str, t: torch.Tensor | None, recv_x: torch.Tensor, rows: int, shape: tuple[int, int] | None
) -> None:
    """``t`` is None or a float32 tensor on ``recv_x``'s device: exactly ``shape`` when given, else ``[>= rows, S]``."""
    if t is None:
        return
    if (
        not isinstance(t, torch.Tensor)
        or t.dim() != 2
        or t.shape[0] < rows
        or (shape is not None and tuple(t.shape) != shape)
    ):
        expected = list(shape) if shape is not None else [f">= {rows}", "S"]
        raise ValueError(f"{name}: expected shape {expected}, got {_describe(t)}")
    if t.dtype != torch.float32:
        raise TypeError(f"{name}: expected float32, got {t.dtype}")
    if t.device != recv_x.device:
        raise ValueError(f"{name}: expected a tensor on {recv_x.device}, got {t.device}")
