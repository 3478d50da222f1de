"""Per-token 1x128 FP8 (e4m3) block quantization: the reference every transport and kernel matches bit for bit.

For each token and each block of 128 channels: ``amax = max(|x|)`` in fp32, floored at 1e-4;
``scale = amax / 448``; ``q = fp8(x * (448 / amax))`` (round to nearest even, fp32 arithmetic).
With ``round_scale`` the scale is the power of two ``2**ceil(log2(amax / 448))`` (UE8M0, what DeepGEMM and
TransformerEngine's Float8BlockScaling expect) and ``q = fp8(x * (1 / scale))``, exact since 1/scale is a power of two.
"""

from __future__ import annotations

import torch

BLOCK = 128
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4
FP8_DTYPE = torch.float8_e4m3fn


def check_fp8_hidden(hidden: int, name: str = "x") -> None:
    """FP8 needs whole 128-channel blocks."""
    if hidden % BLOCK != 0:
        raise ValueError(f"{name}: FP8 needs the hidden size to be a multiple of {BLOCK}, got {hidden}")


def _power_of_two_ceil(x: torch.Tensor) -> torch.Tensor:
    """2**ceil(log2(x)) for positive normal fp32 ``x``, computed on the exponent bits (no libm rounding)."""
    bits = x.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    exponent = exponent + (mantissa != 0).to(torch.int32)
    return (exponent << 23).view(torch.float32)


def quantize(x: torch.Tensor, round_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[N, H]`` (BF16/FP32, H % 128 == 0) → ``(q [N, H] float8_e4m3fn, scales [N, H/128] float32)``."""
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2-D [tokens, hidden] tensor, got shape {tuple(x.shape)}")
    if not x.is_floating_point() or x.dtype == FP8_DTYPE:
        raise TypeError(f"x: expected a BF16/FP16/FP32 tensor, got {x.dtype}")
    n, h = x.shape
    check_fp8_hidden(h)
    blocks = x.float().view(n, h // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=2).clamp_min(AMAX_FLOOR)
    # True IEEE fp32 divisions against a full tensor: torch turns division by a Python scalar into a multiply by
    # its reciprocal, which rounds differently from the kernels' ``448.0f / amax``.
    fp8_max = torch.full_like(amax, FP8_MAX)
    if round_scale:
        scales = _power_of_two_ceil(amax / fp8_max)
        factor = torch.ones_like(scales) / scales
    else:
        scales = amax / fp8_max
        factor = fp8_max / amax
    q = (blocks * factor.unsqueeze(2)).to(FP8_DTYPE).view(n, h)
    return q, scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``(q [N, H] e4m3, scales [N, H/128] float32)`` → ``[N, H]`` of ``dtype`` (``fp32(q) * scale`` then cast)."""
    if q.dtype != FP8_DTYPE:
        raise TypeError(f"q: expected {FP8_DTYPE}, got {q.dtype}")
    n, h = q.shape
    check_fp8_hidden(h, "q")
    if scales.shape != (n, h // BLOCK) or scales.dtype != torch.float32:
        raise ValueError(f"scales: expected float32 [{n}, {h // BLOCK}], got {scales.dtype} {tuple(scales.shape)}")
    out = q.float().view(n, h // BLOCK, BLOCK) * scales.unsqueeze(2)
    return out.view(n, h).to(dtype)


def pack_ue8m0(scales: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 scales ``[N, S]`` → int32 ``[N, ceil(S/4)]``: four UE8M0 exponent bytes per int32,
    lowest channel block in the lowest byte (DeepGEMM's packed layout)."""
    if scales.dtype != torch.float32:
        raise TypeError(f"scales: expected float32, got {scales.dtype}")
    exponents = (scales.contiguous().view(torch.int32) >> 23) & 0xFF
    if bool(((scales.view(torch.int32) & 0x7FFFFF) != 0).any()):
        raise ValueError("scales: UE8M0 packing needs power-of-two scales (quantize with round_scale=True)")
    n, s = exponents.shape
    padded = torch.zeros(n, (s + 3) // 4 * 4, dtype=torch.int32, device=scales.device)
    padded[:, :s] = exponents
    padded = padded.view(n, (s + 3) // 4, 4)  # explicit: n may be 0
    return padded[..., 0] | (padded[..., 1] << 8) | (padded[..., 2] << 16) | (padded[..., 3] << 24)


def unpack_ue8m0(packed: torch.Tensor, num_scales: int) -> torch.Tensor:
    """Inverse of :func:`pack_ue8m0`: int32 ``[N, ceil(S/4)]`` → float32 ``[N, S]``."""
    if packed.dtype != torch.int32:
        raise TypeError(f"packed: expected int32, got {packed.dtype}")
    shifts = torch.tensor([0, 8, 16, 24], dtype=torch.int32, device=packed.device)
    exponents = (packed.unsqueeze(-1) >> shifts) & 0xFF
    exponents = exponents.reshape(packed.shape[0], -1)[:, :num_scales]
    return (exponents << 23).contiguous().view(torch.float32)
