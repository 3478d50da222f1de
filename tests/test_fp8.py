"""FP8 1x128 block quantization against a per-block plain loop."""

from __future__ import annotations

import math

import pytest
import torch

from moe_ep_plugin.ops import fp8


def _loop_quantize(x: torch.Tensor, round_scale: bool):
    n, h = x.shape
    q = torch.empty(n, h, dtype=fp8.FP8_DTYPE)
    scales = torch.empty(n, h // 128)
    for t in range(n):
        for b in range(h // 128):
            block = x[t, b * 128 : (b + 1) * 128].float()
            amax = max(float(block.abs().max()), 1e-4)
            amax_t = torch.tensor(amax, dtype=torch.float32)
            if round_scale:
                scale = torch.tensor(2.0 ** math.ceil(math.log2(float(amax_t / 448.0))), dtype=torch.float32)
                factor = 1.0 / scale
            else:
                scale = amax_t / 448.0
                factor = torch.tensor(448.0, dtype=torch.float32) / amax_t
            q[t, b * 128 : (b + 1) * 128] = (block * factor).to(fp8.FP8_DTYPE)
            scales[t, b] = scale
    return q, scales


@pytest.mark.parametrize("round_scale", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_matches_loop(round_scale: bool, dtype: torch.dtype) -> None:
    x = (torch.randn(6, 384) * torch.logspace(-6, 3, 6).unsqueeze(1)).to(dtype)
    x[2, 128:256] = 0  # an all-zero block uses the 1e-4 amax floor
    q, s = fp8.quantize(x, round_scale=round_scale)
    ref_q, ref_s = _loop_quantize(x, round_scale)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(s, ref_s)
    back = fp8.dequantize(q, s, torch.float32)
    assert torch.equal(back, (q.float().view(6, 3, 128) * s.unsqueeze(2)).view(6, 384))
    # e4m3 keeps 3 mantissa bits: relative error per element ≤ 2^-4 of the block's max
    err = (back - x.float()).abs().view(6, 3, 128).amax(2)
    assert bool((err <= s * 448 / 16 + 1e-12).all())


def test_ue8m0_pack_roundtrip() -> None:
    _, s = fp8.quantize(torch.randn(4, 128 * 7) * 100, round_scale=True)
    packed = fp8.pack_ue8m0(s)
    assert packed.shape == (4, 2) and packed.dtype == torch.int32
    assert torch.equal(fp8.unpack_ue8m0(packed, 7), s)
    exponents = [int(v) >> 23 for v in s[0].view(torch.int32)]
    assert int(packed[0, 0]) & 0xFF == exponents[0] and (int(packed[0, 1]) >> 16) & 0xFF == exponents[6]


def test_errors() -> None:
    with pytest.raises(ValueError, match="multiple of 128"):
        fp8.quantize(torch.randn(2, 100))
    with pytest.raises(TypeError, match="x"):
        fp8.quantize(torch.zeros(2, 128, dtype=torch.int32))
    with pytest.raises(ValueError, match="scales"):
        fp8.dequantize(fp8.quantize(torch.randn(2, 128))[0], torch.ones(2, 2))
    with pytest.raises(ValueError, match="power-of-two"):
        fp8.pack_ue8m0(torch.full((1, 1), 0.3))
