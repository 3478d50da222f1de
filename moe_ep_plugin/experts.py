"""Expert GEMMs over expert-major rows (``dispatch_experts``' layout): one grouped matmul per projection.

M = rows, L = local experts, K = input width, N = output width. Rows are expert-major: expert ``l`` owns the
contiguous rows ``[offs[l-1], offs[l])`` where ``offs`` is the inclusive cumulative sum of ``counts`` (length L,
summing to M; zero rows for an expert is fine).

Two implementations, chosen per call by ``impl``:

- ``"grouped"``: torch's grouped matmul (``torch.nn.functional.grouped_mm``, ``torch._grouped_mm`` before it was
  public). Its offsets are an int32 tensor on the rows' device, so on CUDA the per-expert row counts never have
  to be read on the host; on SM90+ with BF16 operands it is one CUTLASS kernel per projection. Other dtypes or
  GPUs take torch's own per-group fallback (which reads the offsets on the host), and on CPU it is a loop inside
  ATen. Every operand's strides must be multiples of 16 bytes (K and N multiples of 8 in BF16, of 4 in FP32).
- ``"loop"``: one matmul per expert over ``torch.split(rows, counts)`` — the reference the tests compare with.
- ``"auto"``: ``"grouped"`` where :func:`grouped_mm_supported` says torch runs it without a host sync (CUDA,
  compute capability 9.0+, BF16, aligned) or on CPU (FP32/BF16/FP16, aligned); ``"loop"`` otherwise.

Both give the same numbers: on CPU bit for bit (ATen's grouped kernel is the same per-group matmul), on GPU
within the accumulation-order differences of two GEMM kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from .config import positive_int

EXPERT_COMPUTE = ("auto", "grouped", "loop")

_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ALIGN_BYTES = 16


def _aligned(t: torch.Tensor) -> bool:
    """Every non-unit stride and the base address are multiples of 16 bytes (the grouped kernels' rule)."""
    size = t.element_size()
    return t.data_ptr() % _ALIGN_BYTES == 0 and all(
        (s * size) % _ALIGN_BYTES == 0 for s, n in zip(t.stride(), t.shape, strict=False) if s != 1 and n != 1
    )


def grouped_mm_supported(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether torch's grouped matmul takes ``x [M, K]`` with each of ``weights`` ``[L, K, N]`` here, on its
    no-host-sync path: CUDA capability 9.0+ with BF16 everywhere, or CPU (FP32/BF16/FP16); all operands of one
    dtype and 16-byte aligned (``K``, ``N`` and the weights' strides)."""
    if _grouped_mm is None or any(w.dtype != x.dtype or w.device != x.device for w in weights):
        return False
    if x.device.type == "cuda":
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (9, 0):
            return False
    elif x.device.type != "cpu" or x.dtype not in _CPU_DTYPES:
        return False
    # the widths of the activations in and out (row strides of x, of the outputs, of x^T in the weight gradient)
    widths = (x.shape[-1], *(w.shape[-1] for w in weights))
    return (
        _aligned(x)
        and all(_aligned(w) for w in weights)
        and all((n * x.element_size()) % _ALIGN_BYTES == 0 for n in widths)
    )


def resolve_impl(impl: str, x: torch.Tensor, *weights: torch.Tensor, name: str = "impl") -> str:
    """``impl`` (one of :data:`EXPERT_COMPUTE`) → ``"grouped"`` or ``"loop"`` for these operands; ``"grouped"``
    on operands torch cannot take is a ``ValueError`` naming what is wrong (and ``name``, the caller's
    argument)."""
    if impl not in EXPERT_COMPUTE:
        raise ValueError(f"{name}: expected one of {EXPERT_COMPUTE}, got {impl!r}")
    if impl == "loop":
        return "loop"
    supported = grouped_mm_supported(x, *weights)
    if impl == "grouped" and not supported:
        if _grouped_mm is None:
            raise ValueError(
                f"{name}: 'grouped' needs torch.nn.functional.grouped_mm (torch {torch.__version__} "
                "has none); use 'loop' or 'auto'"
            )
        shapes = ", ".join(f"{tuple(w.shape)} {w.dtype}" for w in weights)
        raise ValueError(
            f"{name}: 'grouped' cannot run x {tuple(x.shape)} {x.dtype} on {x.device} with weights "
            f"{shapes} (CUDA needs capability 9.0+ and BF16; widths must be multiples of 16 bytes); "
            "use 'loop' or 'auto'"
        )
    return "grouped" if supported else "loop"


def check_counts(counts: object, num_experts: int, num_rows: int) -> list[int]:
    """``counts`` must be ``num_experts`` non-negative ints summing to ``num_rows``."""
    if not isinstance(counts, (list, tuple)):
        raise TypeError(f"counts: expected a list of ints (rows per local expert), got {counts!r}")
    if len(counts) != num_experts:
        raise ValueError(f"counts: expected {num_experts} entries (one per local expert), got {len(counts)}")
    for i, c in enumerate(counts):
        positive_int(c, f"counts[{i}]", 0)
    if sum(counts) != num_rows:
        raise ValueError(f"counts: expected rows per expert summing to the {num_rows} rows, got {list(counts)}")
    return list(counts)


def expert_offsets(counts: Sequence[int], device: torch.device) -> torch.Tensor:
    """``counts`` (host ints) → inclusive cumulative sum ``[L]`` int32 on ``device``. On CUDA the copy is
    asynchronous from pinned memory, so building the offsets never waits for the GPU."""
    ends, total = [], 0
    for c in counts:
        total += c
        ends.append(total)
    host = torch.tensor(ends, dtype=torch.int32, device="cpu")
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class _GroupedMM(torch.autograd.Function):
    """``y = grouped_mm(x, w, offs)`` with the backward as grouped matmuls too (contiguous gradients in:
    the kernels refuse broadcast strides). ``grad_x = grad_y @ w[l]^T``; ``grad_w[l] = x_l^T @ grad_y_l``
    (zero for an expert without rows), laid out like ``w``: for ``w`` a transposed view of ``[L, N, K]``
    (stacked ``nn.Linear`` weights) it is computed as ``grad_y_l^T @ x_l``, so each expert's ``[N, K]`` slice is
    contiguous and becomes that parameter's gradient without a copy."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight, offs)
        return _grouped_mm(x, weight, offs=offs)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x, weight, offs = ctx.saved_tensors
        grad_y = grad_y.contiguous()
        grad_x = _grouped_mm(grad_y, weight.transpose(-2, -1), offs=offs) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (
                _grouped_mm(grad_y.t(), x, offs=offs).transpose(-2, -1)
                if weight.transpose(-2, -1).is_contiguous()
                else _grouped_mm(x.t(), grad_y, offs=offs)
            )
        return grad_x, grad_w, None


def loop_linear(
    x: torch.Tensor, weight: torch.Tensor, counts: Sequence[int], bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Reference: ``x [M, K]`` rows of expert ``l`` times ``weight[l]`` (``weight [L, K, N]``), plus ``bias[l]``
    (``bias [L, N]`` or None) → ``[M, N]``."""
    outputs = [
        rows @ weight[le] if bias is None else rows @ weight[le] + bias[le]
        for le, rows in enumerate(torch.split(x, list(counts)))
    ]
    return torch.cat(outputs) if outputs else x.new_zeros(0, weight.shape[-1])


def grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    counts: Sequence[int],
    impl: str,
    offsets: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [M, K]`` expert-major rows, ``weight [L, K, N]``, ``counts`` rows per expert, ``bias [L, N]`` or None
    → ``[M, N]``. ``impl``: ``"grouped"`` or ``"loop"`` (already resolved, see :func:`resolve_impl`);
    ``offsets``: the grouped path's int32 ``[L]`` (from :func:`expert_offsets`; built here when None)."""
    if impl == "loop":
        return loop_linear(x, weight, counts, bias)
    if offsets is None:
        offsets = expert_offsets(counts, x.device)
    y = _GroupedMM.apply(x, weight, offsets)
    if bias is None:
        return y
    return _ExpertBias.apply(y, bias, offsets)


class _ExpertBias(torch.autograd.Function):
    """``y [M, N] + bias[l]`` on expert ``l``'s rows (``offsets`` as :func:`expert_offsets`). The bias gradient
    sums each expert's rows in fp32 and rounds once, as the loop's ``grad.sum(0)`` does: a BF16 segment sum
    (``repeat_interleave``'s backward) would round after every row."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, bias: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        # rows per expert from the device offsets, so no host list crosses to the GPU
        sizes = torch.diff(offsets, prepend=offsets.new_zeros(1))
        expert_of_row = torch.repeat_interleave(
            torch.arange(bias.shape[0], device=y.device), sizes, output_size=y.shape[0]
        )
        ctx.save_for_backward(expert_of_row)
        ctx.bias_shape, ctx.bias_dtype = bias.shape, bias.dtype
        return y + bias.index_select(0, expert_of_row)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (expert_of_row,) = ctx.saved_tensors
        grad_bias = None
        if ctx.needs_input_grad[1]:
            grad_bias = (
                grad.new_zeros(ctx.bias_shape, dtype=torch.float32)
                .index_add_(0, expert_of_row, grad.float())
                .to(ctx.bias_dtype)
            )
        return grad, grad_bias, None


def swiglu_experts(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, counts: Sequence[int], impl: str = "auto"
) -> torch.Tensor:
    """SwiGLU experts: ``x [M, H]``, ``gate_up [L, H, 2F]`` (gate columns first), ``down [L, F, H]``,
    ``counts`` rows per expert → ``down_l(silu(x W_gate,l) * (x W_up,l))`` ``[M, H]`` in ``x.dtype``."""
    counts = check_counts(counts, gate_up.shape[0], x.shape[0])
    impl = resolve_impl(impl, x, gate_up, down)
    offsets = expert_offsets(counts, x.device) if impl == "grouped" else None
    gate, up = grouped_linear(x, gate_up, counts, impl, offsets).chunk(2, dim=-1)
    return grouped_linear(F.silu(gate) * up, down, counts, impl, offsets)


def ffn_experts(
    x: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    activation: Callable,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    counts: Sequence[int],
    impl: str = "auto",
) -> torch.Tensor:
    """Two-layer FFN experts: ``x [M, H]``, ``w1 [L, H, F]``, ``b1 [L, F]`` or None, ``activation``
    elementwise, ``w2 [L, F, H]``, ``b2 [L, H]`` or None → ``activation(x w1_l + b1_l) w2_l + b2_l`` ``[M, H]``."""
    counts = check_counts(counts, w1.shape[0], x.shape[0])
    impl = resolve_impl(impl, x, w1, w2)
    offsets = expert_offsets(counts, x.device) if impl == "grouped" else None
    hidden = activation(grouped_linear(x, w1, counts, impl, offsets, b1))
    return grouped_linear(hidden, w2, counts, impl, offsets, b2)
