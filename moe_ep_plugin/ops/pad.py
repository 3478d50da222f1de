"""Drop-and-pad's fixed-capacity layout (``megatron/drop_and_pad.py``): every expert takes exactly ``C`` tokens, so
every row's place is known without a count.

Pair ``p = e * C + c`` is expert ``e``'s ``c``-th token. Two row orders:

- pair order ``[G * L * C]``: source group ``g``, expert ``l`` of ``L``, token ``c`` (one group: the ``E * C`` pairs
  of a sender, ``E = L``);
- expert-major ``[L * block]``: expert ``l``'s ``G * C`` rows by group, then zero rows up to ``block``.

A token's ``slot`` ``[T, E]`` int32 holds each of its pairs ``p`` (-1 where the expert does not take it); rows of
pairs sit in blocks of ``block`` >= C rows per expert, pair ``p``'s at ``(p // C) * block + p % C``. CUDA tensors go
through ``csrc/kernels/drop_and_pad.cuh`` (one launch per call) when the kernel library loads, everything else
through the torch ops here, which define the results: the kernels give the same bits. No host reads, so CUDA graphs
can hold every call. Not differentiable by themselves.
"""

from __future__ import annotations

import torch

from ..config import positive_int
from . import library, permute
from .library import ptr as _ptr

_INT32_MAX = 2**31 - 1


def select_pairs(routing_map: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``routing_map`` ``[T, E]`` bool, ``capacity`` ``C`` in ``[0, T]`` → ``(tokens [E * C] int64, slot [T, E] int32,
    experts [E * C] int64)``.

    Expert ``e`` takes the first ``C`` tokens of a stable descending sort of its column (its marked tokens in token
    order, then the unmarked ones): ``tokens[e * C + c]`` is the ``c``-th, ``experts[e * C + c] = e``, ``slot[t, e]``
    its pair ``e * C + c`` (-1 for the tokens it does not take).
    """
    if not isinstance(routing_map, torch.Tensor) or routing_map.dim() != 2 or routing_map.shape[1] < 1:
        raise ValueError(f"routing_map: expected a [T, E] tensor with E >= 1, got {_describe(routing_map)}")
    if routing_map.dtype != torch.bool:
        raise TypeError(f"routing_map: expected bool, got {routing_map.dtype}")
    num_tokens, num_experts = routing_map.shape
    positive_int(capacity, "capacity", 0, num_tokens)
    if num_experts * capacity > _INT32_MAX:
        raise ValueError(f"capacity: {num_experts} experts x {capacity} pairs exceed int32 slots")
    rmap = routing_map.contiguous()
    if not permute.kernels_for(rmap):
        return _torch_select_pairs(rmap, capacity)
    device = rmap.device
    tokens = torch.empty(num_experts * capacity, dtype=torch.int64, device=device)
    experts = torch.empty_like(tokens)
    slot = torch.empty(num_tokens, num_experts, dtype=torch.int32, device=device)
    if num_tokens:  # no tokens: empty outputs, which may have null data pointers
        permute._launch(
            rmap,
            "moe_ep_pad_select",
            rmap.data_ptr(),
            num_tokens,
            num_experts,
            capacity,
            tokens.data_ptr(),
            experts.data_ptr(),
            slot.data_ptr(),
        )
    return tokens, slot, experts


def arrange(
    rows: torch.Tensor,
    groups: int,
    local: int,
    capacity: int,
    block: int,
    *,
    tokens: torch.Tensor | None = None,
    probs: torch.Tensor | None = None,
    inverse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows between the pair order and the expert-major order (module docstring; ``G = groups``, ``L = local``,
    ``C = capacity``). Any dtype (rows move as bytes).

    Forward: ``rows`` the pair rows ``[G * L * C, H]``, or with ``tokens`` ``[G * L * C]`` int64 (``G = 1``) the
    ``[T, H]`` rows they index → ``(out [L * block, H], out_probs [L * block] float32 or None)``, padding rows and probs
    zero; ``probs`` float32 is ``[G * L * C]`` (one per pair row), or with ``tokens`` ``[T, G * L]`` (pair ``p`` takes
    ``probs[tokens[p], p // C]``). Inverse (no ``tokens``): ``rows`` ``[L * block, H]`` expert-major → the pair rows
    ``[G * L * C, H]`` (padding dropped), ``probs`` ``[L * block]`` alike. Source rows past ``rows`` read as zero.
    """
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2:
        raise ValueError(f"rows: expected a 2-D [rows, hidden] tensor, got {_describe(rows)}")
    for name, value in (("groups", groups), ("local", local)):
        positive_int(value, name)
    positive_int(capacity, "capacity", 0)
    positive_int(block, "block", groups * capacity)
    pairs = groups * local * capacity
    if tokens is not None:
        if inverse or groups != 1:
            raise ValueError("tokens: only for the forward arrangement of one group (a sender's pairs)")
        _check_tensor("tokens", tokens, (pairs,), torch.int64, rows.device)
    if probs is not None:
        shape = (rows.shape[0], local) if tokens is not None else (rows.shape[0],)
        _check_tensor("probs", probs, shape, torch.float32, rows.device)
    x = rows.contiguous()
    p = None if probs is None else probs.contiguous()
    num_out = pairs if inverse else local * block
    if not (x.shape[1] and permute._kernel_rows(x)):
        return _torch_arrange(x, groups, local, capacity, block, tokens, p, inverse)
    out = torch.empty(num_out, x.shape[1], dtype=x.dtype, device=x.device)
    out_probs = None if p is None else torch.empty(num_out, dtype=torch.float32, device=x.device)
    if num_out:  # nothing to write (and empty outputs may have null data pointers)
        permute._launch(
            x,
            "moe_ep_pad_arrange",
            x.data_ptr(),
            _ptr(tokens),
            _ptr(p),
            x.shape[0],
            x.shape[1] * x.element_size(),
            groups,
            local,
            capacity,
            block,
            int(inverse),
            out.data_ptr(),
            _ptr(out_probs),
        )
    return out, out_probs


def sum_pairs(
    rows: torch.Tensor, slot: torch.Tensor, capacity: int, block: int, weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``rows`` ``[M, H]`` BF16/FP32 (pair ``p``'s at ``(p // capacity) * block + p % capacity``), ``slot`` ``[T, K]``
    int32 pairs, ``weights`` ``[M]`` float32 or None → ``(out [T, H] rows.dtype, out_weights [T, K] float32 or None)``.

    ``out[t]`` = the rows of ``slot[t, k]`` summed over ``k`` ascending in fp32 from 0.0 and rounded once (pairs < 0
    or with a row past ``M`` add nothing; 0 for a token without pairs); ``out_weights[t, k]`` = ``0.0 +
    weights[row]`` (0 for an invalid pair; the addition makes -0.0 +0.0, as a sum into zeros does).
    """
    positive_int(capacity, "capacity")
    positive_int(block, "block", capacity, _INT32_MAX)
    permute._check_float_rows("rows", rows)
    if not isinstance(slot, torch.Tensor) or slot.dim() != 2 or slot.shape[1] < 1:
        raise ValueError(f"slot: expected a [T, K] tensor with K >= 1, got {_describe(slot)}")
    if slot.dtype != torch.int32:
        raise TypeError(f"slot: expected int32 (from select_pairs), got {slot.dtype}")
    if slot.device != rows.device:
        raise ValueError(f"slot: expected a tensor on {rows.device}, got {slot.device}")
    if weights is not None:
        _check_tensor("weights", weights, (rows.shape[0],), torch.float32, rows.device)
    y = rows.contiguous()
    s = slot.contiguous()
    w = None if weights is None else weights.contiguous()
    (num_tokens, num_slots), hidden = s.shape, y.shape[1]
    if not (num_slots <= library.PAD_MAX_SLOTS and permute._kernel_rows(y)):
        with torch.no_grad():
            return _torch_sum_pairs(y, s, capacity, block, w)
    out = torch.empty(num_tokens, hidden, dtype=y.dtype, device=y.device)
    out_weights = None if w is None else torch.empty(num_tokens, num_slots, dtype=torch.float32, device=y.device)
    if num_tokens:  # empty outputs may have null data pointers
        permute._launch(
            y,
            "moe_ep_pad_sum",
            y.data_ptr(),
            s.data_ptr(),
            _ptr(w),
            num_tokens,
            num_slots,
            capacity,
            block,
            y.shape[0],
            hidden,
            permute.DTYPE_CODES[y.dtype],
            out.data_ptr(),
            _ptr(out_weights),
        )
    return out, out_weights


# --- torch implementations (CPU, or CUDA without the kernel library): the definition the kernels match ---


def _torch_select_pairs(rmap: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A stable descending sort of every column (``alltoall``'s permute takes its tokens so), the first ``C`` kept."""
    num_tokens, num_experts = rmap.shape
    device = rmap.device
    order = rmap.t().to(torch.int8).argsort(dim=1, descending=True, stable=True)[:, :capacity]  # [E, C]
    expert = torch.arange(num_experts, device=device).unsqueeze(1).expand(-1, capacity)
    slot = torch.full((num_tokens, num_experts), -1, dtype=torch.int32, device=device)
    slot[order, expert] = torch.arange(num_experts * capacity, dtype=torch.int32, device=device).view(order.shape)
    return order.reshape(-1), slot, expert.reshape(-1)


def _torch_arrange(
    x: torch.Tensor,
    groups: int,
    local: int,
    capacity: int,
    block: int,
    tokens: torch.Tensor | None,
    probs: torch.Tensor | None,
    inverse: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every output row's source (``_source_rows``) gathered from ``x`` with a zero row appended."""
    src, prob_at = _source_rows(groups, local, capacity, block, tokens, inverse, x.device)
    num_in = x.shape[0]
    valid = (src >= 0) & (src < num_in)
    index = torch.where(valid, src, num_in)
    data = x.view(torch.uint8) if x.shape[1] else x
    out = torch.cat([data, data.new_zeros(1, data.shape[1])]).index_select(0, index).view(x.dtype)
    if probs is None:
        return out, None
    flat = probs.reshape(-1)
    picked = flat.index_select(0, torch.where(valid, prob_at, 0)) if flat.numel() else torch.zeros_like(src).float()
    return out, torch.where(valid, picked, 0.0)


def _source_rows(
    groups: int,
    local: int,
    capacity: int,
    block: int,
    tokens: torch.Tensor | None,
    inverse: bool,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(src, prob_at)`` int64 per output row of :func:`arrange`: the input row (-1 for padding) and the index of its
    prob in the flat ``probs``."""
    c = max(capacity, 1)  # no pairs: every expert-major row is padding
    if inverse:
        q = torch.arange(groups * local * capacity, device=device)
        g, rest = q // (local * c), q % (local * c)
        src = (rest // c) * block + g * capacity + rest % c
        return src, src
    i = torch.arange(local * block, device=device)
    j = i % block
    pair = ((j // c) * local + i // block) * capacity + j % c
    padding = j >= groups * capacity
    if tokens is None:
        src = torch.where(padding, -1, pair)
        return src, src
    src = tokens.index_select(0, torch.where(padding, 0, pair)) if tokens.numel() else pair
    src = torch.where(padding, -1, src)
    return src, src * local + pair // c


def _torch_sum_pairs(
    y: torch.Tensor, slot: torch.Tensor, capacity: int, block: int, weights: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each pair's row, then slot columns in ascending order, each adding its gathered rows to an fp32 sum from 0.0
    (``permute``'s unpermute sum); the weights gathered the same way."""
    p = slot.long()
    row = torch.where(p >= 0, p // capacity * block + p % capacity, -1)
    valid = (row >= 0) & (row < y.shape[0])
    out = permute._sum_slots(None, y, row.to(torch.int32)).to(y.dtype)
    if weights is None:
        return out, None
    if not weights.numel():  # no rows: every pair is invalid
        return out, torch.zeros(slot.shape, dtype=torch.float32, device=slot.device)
    picked = weights.index_select(0, torch.where(valid, row, 0).reshape(-1)).view(row.shape)
    return out, torch.where(valid, picked, 0.0) + 0.0


def _check_tensor(name: str, t: object, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    """``t`` is a ``dtype`` tensor of ``shape`` on ``device``, else the error names ``name``."""
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {list(shape)}, got {_describe(t)}")
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected {dtype}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got {t.device}")


def _describe(t: object) -> str:
    return f"shape {list(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
