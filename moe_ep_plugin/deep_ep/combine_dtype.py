"""DeepEP 2.6's optional FP32 combine output (``EPBuffer.combine(..., out_dtype=torch.float32)``).

The combine sums a token's rows in fp32 and rounds the sum to the rows' dtype once. Asked for fp32 output, the rows
and biases go to the Buffer as fp32 (exact: fp32 holds every BF16 value), so nothing rounds to BF16 at all: not the
final sum, nor, in the expanded combine, each rank's sum of its local experts' rows. The cost is the combine's
bytes on the wire, twice those of BF16 rows (the kernels send the rows' dtype).
"""

from __future__ import annotations

import torch

from ..buffer import Buffer
from .streams import run_prologue

Bias = torch.Tensor | tuple[torch.Tensor, ...] | None


def check_out_dtype(out_dtype: object, x: torch.Tensor) -> bool:
    """Whether a combine of ``x`` with ``out_dtype`` (None: ``x.dtype``; or ``torch.float32``) must widen its rows.
    Anything else is a ValueError (a TypeError when it is no dtype) naming ``out_dtype``."""
    if out_dtype is None or out_dtype == x.dtype:
        return False
    if not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"out_dtype: expected a torch.dtype or None, got {out_dtype!r}")
    if out_dtype != torch.float32:
        raise ValueError(f"out_dtype: expected None (x's dtype) or torch.float32, got {out_dtype}")
    return True


def widened(buffer: Buffer, kw: dict, x: torch.Tensor, bias: Bias) -> tuple[torch.Tensor, Bias]:
    """``x`` ``[rows, H]`` and ``bias`` (None, a ``[T, H]`` tensor or a tuple of them) as float32, converted where
    the Buffer call taking ``kw`` will read them (after its ``previous_event``: ``streams.run_prologue``)."""
    tensors = (x,) if bias is None else (x, bias) if isinstance(bias, torch.Tensor) else (x, *bias)
    if not all(isinstance(t, torch.Tensor) and t.dtype == x.dtype for t in tensors):
        raise TypeError(f"bias: expected a tensor or a tuple of tensors of x's dtype {x.dtype}")
    wide = run_prologue(buffer, kw, lambda: tuple(t.float() for t in tensors), tensors)
    if bias is None:
        return wide[0], None
    return wide[0], wide[1] if isinstance(bias, torch.Tensor) else tuple(wide[1:])


__all__ = ["check_out_dtype", "widened"]
