"""The ``nvlink`` kernels against the ``torch`` transport on the same inputs, on every local GPU.

BF16/FP16/FP32 rows and FP8 bytes must match bit for bit, metadata exactly, combine bit for bit (both sum from the
biases in summing order in fp32). Also: ``num_worst_tokens``, cached dispatch,
the expert-major dispatch/combine against the torch transport's dispatch + permute / unpermute + combine,
both ways rows travel (copy engine and SM stores, alone and together), CUDA-graph captured dispatch+combine replayed
on new inputs, and a peer that never arrives. Skips without a GPU or without the built kernel library.

With two or more GPUs every rank has its own GPU and the reference runs on NCCL. With one GPU, 2, 3 and 4 ranks
share it (gloo group, ``Buffer(device=...)``; NCCL refuses two ranks on one GPU) and the reference runs on the
CPU: the kernels' peer paths (IPC mappings, flags, pushes and pulls) are exercised, their speed is not.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import time
import traceback

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from support.gpu_marks import GPUS, NEEDS_KERNELS  # noqa: E402
from support.settle import settle  # noqa: E402

from moe_ep_plugin import Buffer  # noqa: E402
from moe_ep_plugin.config import Config, NVLinkTuning  # noqa: E402
from moe_ep_plugin.launch import spawn  # noqa: E402
from moe_ep_plugin.ops import fp8  # noqa: E402

pytestmark = NEEDS_KERNELS
# (ranks, backend) of the multi-rank runs: one rank per GPU, or 2-4 ranks sharing the only GPU
_RUNS = [(min(GPUS, 8), "nccl")] if GPUS >= 2 else [(r, "gloo") for r in (2, 3, 4)]
_PEER_BACKEND = "nccl" if GPUS >= 2 else "gloo"


class _OnCpu:
    """A CPU ``Buffer`` (torch transport over gloo) taking the CUDA tensors the kernels' buffer takes."""

    def __init__(self, buffer: Buffer) -> None:
        self._buffer = buffer

    def __getattr__(self, name: str):
        method = getattr(self._buffer, name)

        def on_cpu(*args, **kwargs):
            return method(*map(_cpu, args), **{k: _cpu(v) for k, v in kwargs.items()})

        return on_cpu


def _cpu(v):
    if isinstance(v, torch.Tensor):
        return v.cpu()
    return tuple(map(_cpu, v)) if isinstance(v, tuple) else v


# This process's nvlink buffers, which _settled checks.
_LIVE: list[Buffer] = []


def _nvlink_buffer(timeout_s: float) -> Buffer:
    """This rank's ``nvlink`` buffer: on its own GPU under NCCL, on the shared GPU under gloo."""
    shared = dist.get_backend() != "nccl"
    nv = Buffer(dist.group.WORLD, transport="nvlink", timeout_s=timeout_s, device="cuda:0" if shared else None)
    _LIVE.append(nv)
    return nv


def _settled() -> None:
    """``settle`` this process's nvlink buffers: after a failed comparison and at the end of each case."""
    settle(*_LIVE)


def _reference_buffer(timeout_s: float):
    ref = Buffer(dist.group.WORLD, transport="torch", timeout_s=timeout_s)
    return ref if dist.get_backend() == "nccl" else _OnCpu(ref)


# tokens on rank r, hidden, top-k, experts per rank, routing; fresh random data every run.
CASES = [
    dict(tokens=lambda r: 4096, hidden=7168, topk=8, experts_per_rank=128, routing="random"),
    dict(tokens=lambda r: 0 if r == 0 else 37, hidden=2048, topk=1, experts_per_rank=4, routing="random"),
    dict(tokens=lambda r: 8192 if r == 0 else 100, hidden=4096, topk=4, experts_per_rank=32, routing="sparse"),
    dict(tokens=lambda r: 513 + 400 * r, hidden=2560, topk=6, experts_per_rank=16, routing="one_expert"),
    dict(tokens=lambda r: 3 + 2 * r, hidden=136, topk=2, experts_per_rank=8, routing="random"),
    dict(tokens=lambda r: 2000 - 500 * r, hidden=5120, topk=8, experts_per_rank=4, routing="random"),
    # 11 FP8 scales per row: not whole 16-byte vectors, so they travel apart from the payload
    dict(tokens=lambda r: 300 + 50 * r, hidden=1408, topk=3, experts_per_rank=8, routing="random"),
]
# (x dtype, fp8_dispatch, fp8_out, round_scale, FP8 tuple input)
MODES = [
    ("bf16", torch.bfloat16, False, False, False, False),
    ("fp32", torch.float32, False, False, False, False),
    ("fp8_wire_bf16_out", torch.bfloat16, True, False, False, False),
    ("fp8_wire_fp8_out", torch.bfloat16, True, True, False, False),
    ("fp8_wire_ue8m0", torch.bfloat16, True, True, True, False),
    ("fp8_wire_from_fp32", torch.float32, True, False, False, False),
    ("fp8_input", torch.bfloat16, False, False, False, True),
    ("fp16", torch.float16, False, False, False, False),  # moved as BF16 rows are, summed by the __half kernels
]


def _routing(kind: str, n: int, k: int, num_experts: int, device: torch.device) -> torch.Tensor:
    if kind == "one_expert":
        idx = torch.full((n, k), -1, dtype=torch.int64, device=device)
        idx[:, 0] = 0
        return idx
    idx = torch.rand(n, num_experts, device=device).topk(min(k, num_experts), dim=1).indices
    if kind == "sparse":
        idx[torch.rand(n, k, device=device) < 0.5] = -1
    else:
        idx[torch.rand(n, k, device=device) < 0.05] = -1
    return idx


def _bits(t: torch.Tensor) -> torch.Tensor:
    # a fresh row-major copy: .contiguous() keeps odd strides of empty or size-1 dims, which view() refuses; on
    # the CPU, where the reference may live
    return torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t).view(torch.uint8).cpu()


def _same(name: str, a, b) -> None:
    if isinstance(a, tuple):
        assert isinstance(b, tuple) and len(a) == len(b), name
        for i, (u, v) in enumerate(zip(a, b, strict=False)):
            _same(f"{name}[{i}]", u, v)
        return
    if a is None or b is None:
        assert a is None and b is None, f"{name}: {type(a)} vs {type(b)}"
        return
    assert a.dtype == b.dtype and a.shape == b.shape, f"{name}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    if not torch.equal(_bits(a), _bits(b)):
        _settled()
        diff = (_bits(a) != _bits(b)).reshape(a.shape[0], -1).any(dim=1).nonzero().flatten()
        raise AssertionError(f"{name}: {diff.numel()} of {a.shape[0]} rows differ, first {diff[:5].tolist()}")


def _same_sums(name: str, got: tuple, want: tuple) -> None:
    """Combined rows and weights bit for bit: both sum in fp32 from the biases in ``summing_order`` (the kernel
    derives it per token, the torch transport orders its slot columns by it)."""
    try:
        _same(name, got[0], want[0])
        _same(f"{name} weights", got[1], want[1])
    except AssertionError:
        _settled()
        raise


def _make_x(mode: tuple, n: int, h: int, device: torch.device):
    _, dtype, _, _, _, fp8_input = mode
    # Per-token scales spread amax over decades so the FP8 scales vary.
    x = (torch.randn(n, h, device=device) * torch.logspace(-3, 2, max(n, 1), device=device)[:n, None]).to(dtype)
    return fp8.quantize(x) if fp8_input else x


def _case_inputs(case: dict, mode: tuple, device: torch.device):
    """``(n, h, k, num_experts, x, topk_idx, topk_weights)`` for this rank, or None when the mode needs hidden % 128."""
    _, _, fp8_dispatch, _, _, fp8_input = mode
    n, h, k = case["tokens"](dist.get_rank()), case["hidden"], case["topk"]
    if (fp8_dispatch or fp8_input) and h % 128:
        return None
    num_experts = case["experts_per_rank"] * dist.get_world_size()
    return (
        n,
        h,
        k,
        num_experts,
        _make_x(mode, n, h, device),
        _routing(case["routing"], n, k, num_experts, device),
        torch.rand(n, k, device=device),
    )


# _suite: every combine that fits pulls (by default small ones push)
PULL_ALL = NVLinkTuning(pull_combine_min_bytes=0)
# _variants' tunings, built here so that collecting this file (also without a GPU) fails on a field that is gone
PULL_QUANTIZED = dataclasses.replace(PULL_ALL, quantizing_dispatch_pull=True)
PUSH = dataclasses.replace(PULL_ALL, dispatch_pull=False, combine_pull=False, copy_engine_combine_below_sms=0)
COPY_ENGINE = [
    dataclasses.replace(PUSH, copy_engine_combine_below_sms=1000, copy_piece_rows=8, copy_streams=streams)
    for streams in (1, 4)
]
WARP_COMBINE = dataclasses.replace(PUSH, combine_send_blocks=0)
ONE_WARP = dataclasses.replace(
    PUSH,
    dispatch_send_warps=1,
    quantizing_dispatch_send_warps=1,
    dequantizing_dispatch_send_warps=1,
    combine_send_warps=1,
)


def _configs(tuning: NVLinkTuning) -> tuple[Config, Config]:
    """The default dispatch and combine Configs at ``Buffer.num_sms``, carrying ``tuning``."""
    world = dist.get_world_size()
    return (
        dataclasses.replace(Buffer.get_dispatch_config(world), nvlink=tuning),
        dataclasses.replace(Buffer.get_combine_config(world), nvlink=tuning),
    )


def _check_case(nv: Buffer, ref: Buffer, case: dict, mode: tuple, tuning: NVLinkTuning = PULL_ALL) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    dcfg, ccfg = _configs(tuning)
    device = nv.device
    name, _, fp8_dispatch, fp8_out, round_scale, fp8_input = mode
    inputs = _case_inputs(case, mode, device)
    if inputs is None:
        return
    n, h, k, num_experts, x, idx, w = inputs
    tag = f"{name} n={n} h={h} k={k} E={num_experts}"

    layout = nv.get_dispatch_layout(idx, num_experts)
    ref_layout = ref.get_dispatch_layout(idx, num_experts)
    for i in (0, 2, 3):
        _same(f"{tag} layout[{i}]", layout[i], ref_layout[i])
    kw = dict(
        num_tokens_per_rank=layout[0],
        is_token_in_rank=layout[3],
        num_tokens_per_expert=layout[2],
        topk_idx=idx,
        topk_weights=w,
        fp8_dispatch=fp8_dispatch,
        fp8_out=fp8_out,
        round_scale=round_scale,
    )
    out = nv.dispatch(x, config=dcfg, **kw)
    expect = ref.dispatch(x, **kw)
    for i, part in enumerate(("recv_x", "recv_topk_idx", "recv_topk_weights")):
        _same(f"{tag} {part}", out[i], expect[i])
    assert out[3] == expect[3], f"{tag} counts {out[3]} vs {expect[3]}"
    handle, ref_handle = out[4], expect[4]
    _same(f"{tag} rank_prefix_matrix", handle.rank_prefix_matrix, ref_handle.rank_prefix_matrix.to(device))
    _same(f"{tag} send_pos", handle.send_pos, ref_handle.send_pos)
    _same(f"{tag} recv_src_idx", handle.recv_src_idx, ref_handle.recv_src_idx)
    assert handle.num_recv_tokens == ref_handle.num_recv_tokens

    # combine of fresh rows with the received weights and a bias
    if not fp8_input and not (fp8_dispatch and fp8_out):
        dtype = out[0].dtype
        y = torch.randn(handle.num_recv_rows, h, device=device).to(dtype)
        bias = torch.randn(n, h, device=device).to(dtype)
        _same_sums(
            f"{tag} combine",
            nv.combine(y, handle, topk_weights=out[2], bias=bias, config=ccfg),
            ref.combine(y, ref_handle, topk_weights=expect[2], bias=bias),
        )

    # cached layout (no top-k): same rows
    cached = nv.dispatch(
        x, handle=handle, fp8_dispatch=fp8_dispatch, fp8_out=fp8_out, round_scale=round_scale, config=dcfg
    )
    _same(f"{tag} cached recv_x", cached[0], out[0])

    # num_worst_tokens: fixed rows, no host sync; the prefix is the exact result, the rest is padding
    worst = int(sum(case["tokens"](r) for r in range(world)))
    wout = nv.dispatch(x, num_worst_tokens=worst, config=dcfg, **kw)
    wref = ref.dispatch(x, num_worst_tokens=worst, **kw)
    for i, part in enumerate(("recv_x", "recv_topk_idx", "recv_topk_weights")):
        _same(f"{tag} worst {part}", wout[i], wref[i])
    assert wout[3] == [] and wout[4].num_recv_rows == worst
    got_src = wout[4].recv_src_idx
    num_recv = handle.num_recv_tokens
    _same(f"{tag} worst recv_src_idx", got_src[:num_recv], ref_handle.recv_src_idx)
    assert bool((got_src[num_recv:] == -1).all())
    _settled()
    if rank == 0:
        print(f"ok {tag}", flush=True)


def _check_expert_case(
    nv: Buffer, ref: Buffer, case: dict, mode: tuple, alignment: int, tuning: NVLinkTuning = PULL_ALL
) -> None:
    """dispatch_experts / combine_experts on nvlink (layout from the notify kernel) equal the torch transport's
    composed path bit for bit."""
    rank = dist.get_rank()
    dcfg, ccfg = _configs(tuning)
    device = nv.device
    name, _, fp8_dispatch, fp8_out, round_scale, fp8_input = mode
    inputs = _case_inputs(case, mode, device)
    if inputs is None:
        return
    n, h, k, num_experts, x, idx, w = inputs
    tag = f"experts {name} n={n} h={h} k={k} E={num_experts} align={alignment}"
    kw = dict(
        topk_idx=idx,
        topk_weights=w,
        num_experts=num_experts,
        expert_alignment=alignment,
        fp8_dispatch=fp8_dispatch,
        fp8_out=fp8_out,
        round_scale=round_scale,
    )
    out = nv.dispatch_experts(x, config=dcfg, **kw)
    expect = ref.dispatch_experts(x, **kw)
    for i, part in enumerate(("expert_x", "expert_scales", "expert_probs")):
        _same(f"{tag} {part}", out[i], expect[i])
    assert out[3] == expect[3], f"{tag} tokens_per_expert {out[3]} vs {expect[3]}"
    handle, ref_handle = out[4], expect[4]
    _same(f"{tag} recv_slot", handle.expert_layout.recv_slot, ref_handle.expert_layout.recv_slot)
    _same(f"{tag} recv_src_idx", handle.recv_src_idx, ref_handle.recv_src_idx)
    if not fp8_input and not (fp8_dispatch and fp8_out):
        y = torch.randn(handle.expert_layout.num_rows, h, device=device).to(out[0].dtype)
        ew = torch.rand(handle.expert_layout.num_rows, device=device)
        # A pulling combine (PULL_ALL: pull_combine_min_bytes = 0, so at 2+ ranks every one that fits) has unpermute
        # write straight into the own region (x_in_region); with expert weights (copied to the region's weights
        # area) and without (Megatron's token_combine passes none).
        for weights in (ew, None):
            _same_sums(
                f"{tag} combine_experts weights={weights is not None}",
                nv.combine_experts(y, handle, expert_weights=weights, config=ccfg),
                ref.combine_experts(y, ref_handle, expert_weights=weights),
            )
    cached = nv.dispatch_experts(
        x, handle=handle, fp8_dispatch=fp8_dispatch, fp8_out=fp8_out, round_scale=round_scale, config=dcfg
    )
    _same(f"{tag} cached expert_x", cached[0], out[0])
    _settled()
    if rank == 0:
        print(f"ok {tag}", flush=True)


def _graph_replay(nv: Buffer, cached: bool) -> None:
    """Capture dispatch + combine in one CUDA graph; replays on new inputs equal eager calls. Either a
    ``num_worst_tokens`` dispatch (no host read: SM senders) or a dispatch reusing a handle, whose counts are on
    the host (copy engine: the copy streams, their events and stream memory operations are captured too)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = nv.device
    n, h, k, num_experts = 1024, 4096, 8, 32 * world
    worst = n * world
    x = torch.empty(n, h, dtype=torch.bfloat16, device=device)
    idx = torch.empty(n, k, dtype=torch.int64, device=device)
    w = torch.empty(n, k, dtype=torch.float32, device=device)

    def refill() -> None:
        x.copy_(torch.randn(n, h, device=device))
        if not cached:  # a cached handle keeps its routing
            idx.copy_(_routing("random", n, k, num_experts, device))
        w.copy_(torch.rand(n, k, device=device))

    refill()
    idx.copy_(_routing("random", n, k, num_experts, device))
    first = nv.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=num_experts)[4] if cached else None

    def step():
        if cached:
            recv_x, _, _, _, handle, _ = nv.dispatch(x, handle=first, fp8_dispatch=True)
            return recv_x, nv.combine(recv_x, handle)[0]
        recv_x, _, recv_w, _, handle, _ = nv.dispatch(
            x, topk_idx=idx, topk_weights=w, num_experts=num_experts, num_worst_tokens=worst, fp8_dispatch=True
        )
        combined, combined_w, _ = nv.combine(recv_x, handle, topk_weights=recv_w)
        return recv_x, combined, combined_w

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    torch.cuda.synchronize(device)
    dist.barrier()
    for _ in range(3):
        refill()
        graph.replay()
        eager = step()
        torch.cuda.synchronize(device)
        for name, a, b in zip(("recv_x", "combined", "combined_weights"), static, eager, strict=False):
            _same(f"graph replay {name}", a, b)
    if rank == 0:
        what = "cached handle, copy engine" if cached else "num_worst_tokens"
        print(f"ok CUDA-graph replay of dispatch + combine ({what})", flush=True)


def _fail_fast(fn, *args) -> None:
    """Run ``fn``; on failure print this rank's traceback at once and leave without the NCCL teardown, so a
    rank stuck in a collective with it cannot hang the test (its own wait then times out)."""
    try:
        fn(*args)
    except BaseException:
        print(f"--- rank {dist.get_rank()} failed ---", file=sys.stderr)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def _suite_entry(part: str) -> None:
    _fail_fast(_suite, part)


# The suite in three parts, each its own test: a time-limited device call reports every part it finished.
PARTS = ("expert_major", "row_major", "variants")


def _suite(part: str) -> None:
    nv, ref = _nvlink_buffer(20.0), _reference_buffer(20.0)
    # Beyond two ranks on one shared GPU the CPU reference sets the pace: the first case at 1024 tokens, not 4096.
    shared_many = dist.get_backend() != "nccl" and dist.get_world_size() > 2
    cases = [dict(CASES[0], tokens=lambda r: 1024)] + CASES[1:] if shared_many else CASES
    Buffer.set_num_sms(24)
    if part == "expert_major":
        for case in cases:
            for mode in MODES:
                _check_expert_case(nv, ref, case, mode, 1)
        for i, case in enumerate(cases):
            for mode in (MODES[0], MODES[2], MODES[4]):
                _check_expert_case(nv, ref, case, mode, (16, 128)[i % 2])
    elif part == "row_major":
        for case in cases:
            for mode in MODES:
                _check_case(nv, ref, case, mode)
    else:
        _variants(nv, ref, cases)
    torch.cuda.synchronize()
    dist.barrier()
    nv.destroy()


def _variants(nv: Buffer, ref, cases: list[dict]) -> None:
    # the other kernel variants: quantized rows pulled; pushing rows instead of pulling them; the copy engines
    # carrying every combined row (no sender warps), in many small pieces on one or four streams; SM stores only
    # with the default roles, at 2 SMs, warp roles in combine, and 2 SMs with one sending warp each
    for mode in (MODES[2], MODES[3], MODES[5]):
        _check_case(nv, ref, cases[1], mode, PULL_QUANTIZED)
    _check_expert_case(nv, ref, cases[1], MODES[2], 16, PULL_QUANTIZED)
    for copy_engine in COPY_ENGINE:
        for mode in (MODES[0], MODES[2], MODES[6], MODES[7]):
            _check_case(nv, ref, cases[0], mode, copy_engine)
        _check_expert_case(nv, ref, cases[2], MODES[2], 16, copy_engine)
    Buffer.set_num_sms(2)
    _check_case(nv, ref, cases[3], MODES[3], PUSH)
    Buffer.set_num_sms(24)
    for case in (cases[0], cases[1], cases[5]):
        for mode in (MODES[0], MODES[2], MODES[3], MODES[6], MODES[7]):
            _check_case(nv, ref, case, mode, PUSH)
        _check_expert_case(nv, ref, case, MODES[2], 16, PUSH)
    _check_expert_case(nv, ref, cases[2], MODES[0], 16, WARP_COMBINE)
    _check_case(nv, ref, cases[2], MODES[0], WARP_COMBINE)
    _check_case(nv, ref, cases[2], MODES[7], WARP_COMBINE)
    _check_expert_case(nv, ref, cases[2], MODES[7], 16, WARP_COMBINE)
    _check_case(nv, ref, cases[2], MODES[2], WARP_COMBINE)
    Buffer.set_num_sms(2)
    _check_case(nv, ref, cases[0], MODES[2], ONE_WARP)
    _check_expert_case(nv, ref, cases[0], MODES[2], 1, ONE_WARP)
    Buffer.set_num_sms(24)
    _graph_replay(nv, cached=False)
    _graph_replay(nv, cached=True)


def _single_rank() -> None:
    """EP1: a group of one rank gets the ``local`` transport whatever is asked for; on the GPU it runs the layout,
    slot and permute kernels, on the CPU (the reference) torch ops, and both must give the same bits: every token
    with an expert, tokens without one (sparse), one expert, no tokens, alignments 1 and 16, and a cached
    expert-major handle replayed with FP8 on the wire."""
    nv, ref = _nvlink_buffer(20.0), _reference_buffer(20.0)
    assert nv.transport_name == "local" and nv.transport.device.type == "cuda"
    Buffer.set_num_sms(24)
    for case in (CASES[0], CASES[4]):
        for mode in (MODES[0], MODES[3], MODES[6], MODES[7]):
            _check_case(nv, ref, case, mode)
            _check_expert_case(nv, ref, case, mode, 1)
        _check_expert_case(nv, ref, case, MODES[2], 16)
    for case in (CASES[1], CASES[0], CASES[2], CASES[3]):
        for alignment in (1, 16):
            _check_expert_case(nv, ref, case, MODES[0], alignment)
    device = nv.device
    n, h, k, num_experts = 300, 1024, 4, 16
    x = torch.randn(n, h, device=device).to(torch.bfloat16)
    idx = _routing("random", n, k, num_experts, device)
    handle = nv.dispatch_experts(x, idx, None, num_experts)[4]
    ref_handle = ref.dispatch_experts(x, idx, None, num_experts)[4]
    _same(
        "layout handle replayed with FP8",
        nv.dispatch_experts(x, handle=handle, fp8_dispatch=True)[0],
        ref.dispatch_experts(x, handle=ref_handle, fp8_dispatch=True)[0],
    )
    _settled()
    torch.cuda.synchronize()
    nv.destroy()


def _single_rank_entry() -> None:
    _fail_fast(_single_rank)


def _absent_peer(timeout_s: float) -> None:
    """Rank 1 never dispatches: rank 0 must raise TimeoutError naming rank 1 within a few timeouts; its kernel
    trapped, so its CUDA context is lost (every later call raises)."""
    nv = _nvlink_buffer(timeout_s)
    device = nv.device
    if dist.get_rank() == 0:
        x = torch.randn(16, 256, device=device).to(torch.bfloat16)
        idx = torch.arange(16 * 2, device=device).reshape(16, 2) % 4
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="rank 1 did not reach the start-of-operation barrier"):
            nv.dispatch(x, topk_idx=idx, num_experts=4)
        assert time.monotonic() - start < 4 * timeout_s
        with pytest.raises(TimeoutError, match="rank 1"):  # sticky
            nv.dispatch(x, topk_idx=idx, num_experts=4)
        with pytest.raises(RuntimeError):  # the trap: the context is lost
            torch.cuda.synchronize(device)
        nv.destroy()  # touches nothing on the lost context
    else:
        torch.cuda.synchronize(device)
    dist.barrier()


def _refusing_peer(timeout_s: float) -> None:
    """Bad input on rank 1 only, in a fresh dispatch of each form and in the layout before one: rank 1 raises its
    cause, rank 0 the refusal of that class naming rank 1, both at the notify (well within the timeout, no trap).
    The refusal ends the buffer (as ranks that disagree do): each case takes a fresh one."""
    bad = dist.get_rank() == 1
    probe = _nvlink_buffer(timeout_s)
    device = probe.device
    probe.destroy()
    x = torch.randn(16, 256, device=device).to(torch.bfloat16)
    idx = torch.arange(16 * 2, device=device).reshape(16, 2) % 4
    cases = [
        (TypeError, "x: expected dtype", lambda nv: nv.dispatch(x.double() if bad else x, topk_idx=idx, num_experts=4)),
        (TypeError, "x: expected dtype", lambda nv: nv.dispatch_experts(x.double() if bad else x, idx, None, 4)),
        (ValueError, "topk_idx: expected shape", lambda nv: nv.dispatch_experts(x, idx[:3] if bad else idx, None, 4)),
        (
            TypeError,
            "topk_idx: expected dtype",
            lambda nv: nv.get_dispatch_layout(idx.float(), 4) if bad else nv.dispatch(x, topk_idx=idx, num_experts=4),
        ),
    ]
    for cls, cause, call in cases:
        nv = _nvlink_buffer(timeout_s)
        start = time.monotonic()
        with pytest.raises(cls, match=re.escape(cause) if bad else r"dispatch: rank\(s\) \[1\] refused the call"):
            call(nv)
        assert time.monotonic() - start < timeout_s
        torch.cuda.synchronize(device)  # no kernel trapped
        nv.destroy()


class _Late:
    """Stands in for a rank's dispatch launch: first a GPU sleep of ``cycles``, so the rank's dispatch kernel (after
    its notify and host read) starts late on the device."""

    def __init__(self, launch, cycles: int) -> None:
        self.launch, self.cycles = launch, cycles

    def __call__(self, params) -> None:
        torch.cuda._sleep(self.cycles)
        self.launch(params)


def _late_peer(timeout_s: float) -> None:
    """Rank 1 stalls inside a dispatch, past ``timeout_s``, after notify: rank 0's dispatch (``num_worst_tokens``:
    no host read waits for its kernel) returns before that kernel gave up on rank 1's rows. Reading those outputs
    must raise, not give data, and the next call raises the TimeoutError naming rank 1. Rank 1's dispatch completes
    late (rank 0 had sent its rows); its next call, whose barrier rank 0 never reaches, times out: reading its output
    raises, the call after raises naming rank 0."""
    nv = _nvlink_buffer(timeout_s)
    device, rank = nv.device, dist.get_rank()
    x = torch.randn(64, 256, device=device).to(torch.bfloat16)
    idx = torch.arange(64 * 2, device=device).reshape(64, 2) % 4
    recv_x, _, _, _, handle, _ = nv.dispatch(x, topk_idx=idx, num_experts=4)
    nv.combine(recv_x, handle)  # a first round sizes the receive guess, so the late dispatch runs its kernel once
    settle(nv)
    if rank == 1:  # ~2 GHz at most while it holds the GPU: the sleep lasts at least 1.5 timeouts
        nv.transport._rt.dispatch = _Late(nv.transport._rt.dispatch, int(3e9 * timeout_s))
    recv_x, _, _, _, handle, _ = nv.dispatch(x, topk_idx=idx, num_experts=4, num_worst_tokens=128)
    if rank == 0:
        with pytest.raises(RuntimeError):  # the dispatch kernel timed out and trapped: no data to read
            recv_x.float().sum().item()
        with pytest.raises(TimeoutError, match="dispatch rows from rank 1"):
            nv.dispatch(x, topk_idx=idx, num_experts=4)
    else:
        out, _, _ = nv.combine(recv_x, handle)
        with pytest.raises(RuntimeError):
            out.float().sum().item()
        with pytest.raises(TimeoutError, match="rank 0"):  # at the barrier (or, had rank 0's rows been lost, them)
            nv.combine(recv_x, handle)
    nv.destroy()
    dist.barrier()  # rank 0 keeps its peer buffer mapped until rank 1 is done writing into it


@pytest.mark.parametrize("part", PARTS)
@pytest.mark.parametrize("ranks,backend", _RUNS)
def test_nvlink_matches_torch_transport(ranks: int, backend: str, part: str) -> None:
    spawn(_suite_entry, ranks, args=(part,), backend=backend, timeout_s=60.0 if backend == "nccl" else 240.0)


def test_single_rank_local_kernels_match_torch_ops() -> None:
    spawn(_single_rank_entry, 1, backend="gloo", timeout_s=60.0)  # gloo: the reference runs on the CPU


def test_nvlink_peer_that_never_arrives_raises() -> None:
    spawn(_absent_peer, 2, args=(2.0,), backend=_PEER_BACKEND, timeout_s=120.0)


def test_nvlink_peer_refusal_raises_on_every_rank() -> None:
    spawn(_refusing_peer, 2, args=(5.0,), backend=_PEER_BACKEND, timeout_s=120.0)


def test_nvlink_late_peer_outputs_raise() -> None:
    spawn(_late_peer, 2, args=(2.0,), backend=_PEER_BACKEND, timeout_s=120.0)
