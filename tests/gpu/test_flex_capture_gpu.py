"""The sync-free forms of the ``flex`` shims and of ``ElasticBuffer`` on the ``nvlink`` transport (``local`` at one
rank), captured in one CUDA graph: the GPU side of tests/test_flex_capture.py.

Each step (dispatch, combine and, for the shims, the backward of both) is warmed up, run once eagerly under
``torch.cuda.set_sync_debug_mode("error")`` (a host sync raises), captured, and replayed three times on new inputs
refilled into the graph's input tensors; each replay equals an eager call on the same inputs bit for bit
(``support.graph_replay.check_replays``):

- ``hybrid_ep_dispatch``/``_combine`` with ``num_permuted_tokens`` (a budget of the mean pairs, so some rounds cut
  and some pad) and ``nccl_ep_dispatch``/``_combine`` in static mode (a capacity of the mean pairs, dropping on
  overflow): rows, probs, counts, the overflow flag / ``total_recv_tokens``, output, gradients of ``x`` and probs.
- ``ElasticBuffer.dispatch(do_cpu_sync=False)``, expanded and not, its cached dispatch with new weights and its
  combine (with weights), alignment 1 and 128, BF16 and FP8 rows; then the same calls with the CPU sync on the last
  inputs: the valid rows equal, the rows past them zero (expanded; not expanded: local ids -1, weights 0), the
  counts and the combine equal.
- ``deepepv2_dispatch``/``_combine`` with ``do_cpu_sync=False``, forward and backward; then the counted form
  (``do_cpu_sync=True``) on the last inputs: valid rows, ids, probs, counts, output and gradients equal.

Rows of a ``do_cpu_sync=False`` non-expanded dispatch past the valid prefix (``num_worst_tokens`` rows) hold no data
on ``nvlink``: those outputs are compared on the prefix the handle counts. ``ensure_nccl_ep_bootstrapped`` takes no
device (Megatron's NCCL group gives the current one): with gloo ranks sharing a GPU it runs with the default device
set to it, as DeepEP's own harness does.

With one GPU, 2 ranks share it (gloo, start MPS first); with more, one rank per GPU (up to 4), still over gloo.
Skips without a GPU, the kernel library, or (the shims) megatron-core.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from support.gpu_marks import GPUS, NEEDS_KERNELS  # noqa: E402
from support.graph_replay import check_replays  # noqa: E402

from moe_ep_plugin.launch import spawn  # noqa: E402

pytestmark = NEEDS_KERNELS
NEEDS_MEGATRON = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None,
    reason="megatron-core is not installed (the flex shims' module imports it)",
)
WORLDS = [1, min(max(GPUS, 2), 4)]
TOKENS, HIDDEN, LOCAL, TOPK, ALIGN = 64, 256, 4, 2, 4  # the shims
ELASTIC_TOPK = 3
SMS = 8  # ElasticBuffer's kernels: few SMs, so that ranks sharing a GPU all get theirs
TIMEOUT_S = 60


def _setup() -> torch.device:
    device = torch.device("cuda", dist.get_rank() % GPUS)
    torch.cuda.set_device(device)
    return device


def _elastic_buffer(device: torch.device, num_topk: int):
    """An ``ElasticBuffer`` on ``device`` (it takes no device in DeepEP) over the nvlink kernels, this file's sizes."""
    from moe_ep_plugin.deep_ep import ElasticBuffer

    return ElasticBuffer(
        dist.group.WORLD,
        num_max_tokens_per_rank=TOKENS,
        hidden=HIDDEN,
        num_topk=num_topk,
        transport="nvlink",
        device=device,
        num_cpu_timeout_secs=TIMEOUT_S,
    )


@contextlib.contextmanager
def _default_device(device: torch.device) -> Iterator[None]:
    previous = torch.get_default_device()
    torch.set_default_device(device)
    try:
        yield
    finally:
        torch.set_default_device(previous)


def _topk_routing(gen: torch.Generator, device: torch.device, experts: int, topk: int) -> torch.Tensor:
    """``[T, K]`` int64 distinct global expert ids, about 15% of them -1."""
    top = torch.rand(TOKENS, experts, generator=gen, device=device).topk(topk, dim=1).indices
    return torch.where(torch.rand(TOKENS, topk, generator=gen, device=device) < 0.15, -1, top)


def _trim(names: list[str], prefixed: set[str], count: str) -> Callable[[tuple], tuple]:
    """Outputs → the ones named in ``prefixed`` cut to the valid prefix, ``outputs[count][-1]`` rows (an inclusive
    prefix sum over the source ranks, on the device)."""
    where = names.index(count)

    def trim(outputs: tuple) -> tuple:
        n = int(outputs[where][-1])
        return tuple(t[:n] if name in prefixed else t for name, t in zip(names, outputs, strict=True))

    return trim


# ---- the flex shims ----


def _hybridep(world: int) -> None:
    from moe_ep_plugin.megatron import PluginOptions, deepep_shim
    from moe_ep_plugin.megatron import hybridep_shim as shim

    device = _setup()
    deepep_shim.configure(PluginOptions(transport="nvlink", timeout_s=TIMEOUT_S))
    experts, budget = LOCAL * world, TOKENS * TOPK  # the mean pairs: some rounds cut rows, some pad
    gen = torch.Generator(device).manual_seed(11 + dist.get_rank())
    x = torch.empty(TOKENS, HIDDEN, dtype=torch.bfloat16, device=device, requires_grad=True)
    probs = torch.empty(TOKENS, experts, device=device, requires_grad=True)
    routing_map = torch.empty(TOKENS, experts, dtype=torch.bool, device=device)
    scale = torch.empty(budget, dtype=torch.bfloat16, device=device)
    grad_out = torch.empty(TOKENS, HIDDEN, dtype=torch.bfloat16, device=device)
    grad_rows = torch.empty(budget, device=device)

    def refill() -> None:
        with torch.no_grad():
            x.copy_(torch.randn(TOKENS, HIDDEN, generator=gen, device=device))
            scores = torch.rand(TOKENS, experts, generator=gen, device=device)
            chosen = torch.zeros_like(routing_map).scatter_(1, scores.topk(TOPK, dim=1).indices, True)
            chosen &= torch.rand(TOKENS, experts, generator=gen, device=device) > 0.15  # some tokens on fewer
            routing_map.copy_(chosen)
            probs.copy_(torch.where(chosen, torch.rand(TOKENS, experts, generator=gen, device=device) + 0.1, 0.0))
            scale.copy_(torch.randn(budget, generator=gen, device=device))
            grad_out.copy_(torch.randn(TOKENS, HIDDEN, generator=gen, device=device))
            grad_rows.copy_(torch.randn(budget, generator=gen, device=device))

    def step() -> tuple[torch.Tensor, ...]:
        rows, row_probs, _, counts, handle = shim.hybrid_ep_dispatch(
            x, routing_map, probs, dist.group.WORLD, LOCAL, num_permuted_tokens=budget, pad_multiple=ALIGN
        )
        out = shim.hybrid_ep_combine(rows * scale.unsqueeze(1), handle, budget, ALIGN)
        grad_x, grad_probs = torch.autograd.grad((out, row_probs), (x, probs), (grad_out, grad_rows))
        return rows, row_probs, counts, handle[-1], out, grad_x, grad_probs

    names = ["rows", "row probs", "tokens_per_expert", "overflow", "combined", "grad x", "grad probs"]
    try:
        check_replays(step, (), refill, names, device)
    finally:
        deepep_shim.configure(PluginOptions())
    dist.barrier()


def _ncclep(world: int) -> None:
    from moe_ep_plugin.megatron import PluginOptions, deepep_shim
    from moe_ep_plugin.megatron import ncclep_shim as shim

    device = _setup()
    deepep_shim.configure(PluginOptions(transport="nvlink", timeout_s=TIMEOUT_S))
    experts, capacity = LOCAL * world, TOKENS * TOPK  # the mean pairs: some rounds drop rows, some pad
    shim.nccl_ep_finalize()
    with _default_device(device):  # the bootstrap's Buffer goes on the default group's device (see the docstring)
        shim.ensure_nccl_ep_bootstrapped(dist.group.WORLD, experts, TOKENS, capacity, HIDDEN, drop_on_overflow=True)
    gen = torch.Generator(device).manual_seed(23 + dist.get_rank())
    x = torch.empty(TOKENS, HIDDEN, dtype=torch.bfloat16, device=device, requires_grad=True)
    idx = torch.empty(TOKENS, TOPK, dtype=torch.int64, device=device)
    weights = torch.empty(TOKENS, TOPK, device=device, requires_grad=True)
    scale = torch.empty(capacity, dtype=torch.bfloat16, device=device)
    grad_out = torch.empty(TOKENS, HIDDEN, dtype=torch.bfloat16, device=device)
    grad_rows = torch.empty(capacity, device=device)

    def refill() -> None:
        with torch.no_grad():
            x.copy_(torch.randn(TOKENS, HIDDEN, generator=gen, device=device))
            idx.copy_(_topk_routing(gen, device, experts, TOPK))
            weights.copy_(torch.where(idx >= 0, torch.rand(TOKENS, TOPK, generator=gen, device=device) + 0.1, 0.0))
            scale.copy_(torch.randn(capacity, generator=gen, device=device))
            grad_out.copy_(torch.randn(TOKENS, HIDDEN, generator=gen, device=device))
            grad_rows.copy_(torch.randn(capacity, generator=gen, device=device))

    def step() -> tuple[torch.Tensor, ...]:
        buffer = shim.new_nccl_ep_buffer(TOPK, TOKENS, capacity, HIDDEN, LOCAL, alignment=ALIGN)
        rows, counts, row_probs = shim.nccl_ep_dispatch(buffer, x, idx, weights)
        out = shim.nccl_ep_combine(buffer, rows * scale.unsqueeze(1), TOKENS)
        grad_x, grad_weights = torch.autograd.grad((out, row_probs), (x, weights), (grad_out, grad_rows))
        return rows, counts, row_probs, buffer.total_recv_tokens, out, grad_x, grad_weights

    names = ["rows", "tokens_per_expert", "row probs", "total_recv_tokens", "combined", "grad x", "grad weights"]
    try:
        check_replays(step, (), refill, names, device)
    finally:
        shim.nccl_ep_finalize()
        deepep_shim.configure(PluginOptions())
    dist.barrier()


def _deepepv2(world: int) -> None:
    from moe_ep_plugin.megatron import PluginOptions, deepep_shim
    from moe_ep_plugin.megatron import deepepv2_shim as shim

    device = _setup()
    deepep_shim.configure(PluginOptions(transport="nvlink", timeout_s=TIMEOUT_S))
    experts = LOCAL * world
    buffer = _elastic_buffer(device, TOPK)  # what get_elastic_buffer makes, on this rank's GPU
    gen = torch.Generator(device).manual_seed(37 + dist.get_rank())
    x = torch.empty(TOKENS, HIDDEN, dtype=torch.bfloat16, device=device, requires_grad=True)
    idx = torch.empty(TOKENS, TOPK, dtype=torch.int64, device=device)
    weights = torch.empty(TOKENS, TOPK, device=device, requires_grad=True)
    grad_out = torch.empty(TOKENS, HIDDEN, dtype=torch.bfloat16, device=device)

    def refill() -> None:
        with torch.no_grad():
            x.copy_(torch.randn(TOKENS, HIDDEN, generator=gen, device=device))
            idx.copy_(_topk_routing(gen, device, experts, TOPK))
            weights.copy_(torch.where(idx >= 0, torch.rand(TOKENS, TOPK, generator=gen, device=device) + 0.1, 0.0))
            grad_out.copy_(torch.randn(TOKENS, HIDDEN, generator=gen, device=device))

    def step(cpu_sync: bool = False) -> tuple[torch.Tensor, ...]:
        rows, recv_idx, recv_probs, counts, handle = shim.deepepv2_dispatch(
            buffer, x, idx, weights, experts, TOKENS, expert_alignment=ALIGN, num_sms=SMS, do_cpu_sync=cpu_sync
        )
        # the experts and Megatron's unpermute: each row scaled by its probabilities' sum
        out, _ = shim.deepepv2_combine(buffer, (rows * recv_probs.sum(1, keepdim=True)).to(rows.dtype), handle)
        grad_x, grad_weights = torch.autograd.grad(out, (x, weights), grad_out)
        received = handle.psum_num_recv_tokens_per_scaleup_rank
        return rows, recv_idx, recv_probs, counts, out, grad_x, grad_weights, received

    names = ["rows", "recv ids", "recv probs", "tokens_per_expert", "combined", "grad x", "grad weights", "received"]
    try:
        free = check_replays(step, (), refill, names, device, _trim(names, {"rows"}, "received"))
        counted = step(cpu_sync=True)
        torch.cuda.synchronize(device)
        n, rank = counted[0].shape[0], dist.get_rank()
        assert int(free[7][-1]) == n, f"rank {rank}: {int(free[7][-1])} valid rows, the counted form {n}"
        assert torch.equal(free[0][:n], counted[0]), f"rank {rank}: rows differ from the counted form's"
        assert torch.equal(free[1][:n], counted[1]) and bool((free[1][n:] == -1).all()), f"rank {rank}: recv ids"
        assert torch.equal(free[2][:n], counted[2]) and not free[2][n:].any(), f"rank {rank}: recv probs"
        assert free[3].tolist() == counted[3].tolist(), f"rank {rank}: tokens_per_expert {free[3]} vs {counted[3]}"
        for name, a, b in zip(names[4:7], free[4:7], counted[4:7], strict=True):
            assert torch.equal(a, b), f"rank {rank}: {name} differs from the counted form's"
    finally:
        deepep_shim.configure(PluginOptions())
    dist.barrier()


SHIMS = {"hybridep": _hybridep, "ncclep": _ncclep, "deepepv2": _deepepv2}


@NEEDS_MEGATRON
@pytest.mark.parametrize("shim", list(SHIMS))
@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"{w}ranks")
def test_flex_shim_sync_free_form_captured_equals_eager(world: int, shim: str) -> None:
    spawn(SHIMS[shim], world, args=(world,), backend="gloo", timeout_s=300)


# ---- ElasticBuffer ----


def _flat(rows: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return rows if isinstance(rows, tuple) else (rows,)


def _elastic_case(buffer, device: torch.device, world: int, expand: bool, alignment: int, use_fp8: bool) -> None:
    from moe_ep_plugin.ops import fp8

    experts, rank = LOCAL * world, dist.get_rank()
    case = f"rank {rank} do_expand={expand} alignment={alignment} fp8={use_fp8}"
    gen = torch.Generator(device).manual_seed(1000 * alignment + 10 * rank + 2 * expand + use_fp8)
    x = torch.empty(TOKENS, HIDDEN, dtype=torch.bfloat16, device=device)
    x_q = torch.empty(TOKENS, HIDDEN, dtype=fp8.FP8_DTYPE, device=device)
    x_scales = torch.empty(TOKENS, HIDDEN // fp8.BLOCK, device=device)
    idx = torch.empty(TOKENS, ELASTIC_TOPK, dtype=torch.int64, device=device)
    weights, new_weights = (torch.empty(TOKENS, ELASTIC_TOPK, device=device) for _ in range(2))

    def refill() -> None:
        x.copy_(torch.randn(TOKENS, HIDDEN, generator=gen, device=device))
        q, s = fp8.quantize(x)
        x_q.copy_(q)
        x_scales.copy_(s)
        idx.copy_(_topk_routing(gen, device, experts, ELASTIC_TOPK))
        drawn = torch.rand(TOKENS, ELASTIC_TOPK, generator=gen, device=device) + 0.1
        weights.copy_(torch.where(idx >= 0, drawn, 0.0))
        new_weights.copy_(torch.rand(TOKENS, ELASTIC_TOPK, generator=gen, device=device) + 0.1)

    def step(cpu_sync: bool = False) -> tuple[torch.Tensor, ...]:
        x_in = (x_q, x_scales) if use_fp8 else x
        rows, recv_idx, recv_w, handle, _ = buffer.dispatch(
            x_in,
            topk_idx=idx,
            topk_weights=weights,
            num_experts=experts,
            num_max_tokens_per_rank=TOKENS,
            expert_alignment=alignment,
            num_sms=SMS,
            do_expand=expand,
            do_cpu_sync=cpu_sync,
        )
        cached, _, cached_w, _, _ = buffer.dispatch(
            x_in, handle=handle, topk_weights=new_weights, do_expand=expand, num_sms=SMS
        )
        dense = fp8.dequantize(*rows) if use_fp8 else rows
        scale = recv_w if expand else recv_w.sum(1)
        out, out_w, _ = buffer.combine((dense.float() * scale[:, None]).bfloat16(), handle, topk_weights=recv_w)
        ids = () if expand else (recv_idx,)
        counts = (handle.psum_num_recv_tokens_per_scaleup_rank, handle.psum_num_recv_tokens_per_expert)
        return (*_flat(rows), recv_w, *_flat(cached), cached_w, *counts, out, out_w, *ids)

    scales = ["row scales", "cached scales"] if use_fp8 else []
    names = ["rows", *scales[:1], "weights", "cached rows", *scales[1:], "cached weights"]
    names += ["received", "expert psum", "combined", "combined weights", *([] if expand else ["recv ids"])]
    rows_like = {"rows", "row scales", "cached rows", "cached scales", "cached weights"}
    # not expanded, the rows past the received ones are unwritten (num_worst_tokens); expanded, zero
    trim = None if expand else _trim(names, rows_like, "received")
    with torch.no_grad():
        free = check_replays(step, (), refill, names, device, trim)
        sync = step(cpu_sync=True)
    torch.cuda.synchronize(device)
    got, want = dict(zip(names, free, strict=True)), dict(zip(names, sync, strict=True))
    m = want["rows"].shape[0]
    if not expand:
        assert int(got["received"][-1]) == m, f"{case}: {int(got['received'][-1])} valid rows, CPU sync {m}"
    for name in names:
        a, b = got[name], want[name]
        if name in rows_like or name in ("weights", "recv ids"):
            assert torch.equal(a[:m], b), f"{case}: {name} differs from the CPU-sync dispatch's on the valid rows"
            if expand:
                assert not a[m:].float().any(), f"{case}: {name} not zero past the valid rows"
            elif name in ("weights", "recv ids"):
                tail = -1 if name == "recv ids" else 0
                assert bool((a[m:] == tail).all()), f"{case}: {name} not {tail} past the valid rows"
        else:
            assert torch.equal(a, b), f"{case}: {name} differs from the CPU-sync dispatch's"


def _elastic(world: int, expand: bool) -> None:
    device = _setup()
    buffer = _elastic_buffer(device, ELASTIC_TOPK)
    for alignment in (1, 128):
        for use_fp8 in (False, True):
            _elastic_case(buffer, device, world, expand, alignment, use_fp8)
            dist.barrier()
    if dist.get_rank() == 0:
        print(f"ok ElasticBuffer do_expand={expand} without a CPU sync captured at {world} rank(s)", flush=True)


@pytest.mark.parametrize("expand", [False, True], ids=["plain", "expanded"])
@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"{w}ranks")
def test_elastic_sync_free_dispatch_captured_equals_eager_and_cpu_sync(world: int, expand: bool) -> None:
    spawn(_elastic, world, args=(world, expand), backend="gloo", timeout_s=300)
