"""SM sweep: the nvlink dispatch and combine kernels at S SMs beside a plain copy kernel moving the same remote
bytes through the same peer (CUDA-IPC) mapping with S SMs, and a copy-engine copy of them.

    python3 benchmarks/sm_sweep.py --ranks 2            # ranks sharing GPU 0 (start an MPS daemon first)
    python3 benchmarks/sm_sweep.py --ranks 4
    python3 benchmarks/sm_sweep.py --layout per-gpu      # one rank per visible GPU (NCCL), the same sweep

Each rank routes its tokens at the standard shape (hidden 7168, top-8 of 256, group-limited 8 groups / top-4,
sigmoid scores; ``--tokens`` 4096 and 1024) and sends the bytes it would send at that EP size (the rank count).
For every S: FP8 dispatch quantizing in the send path (FP8 rows out), FP8 dispatch of pre-quantized rows, BF16
dispatch and BF16 combine, each with a cached handle, timed from CUDA-graph replay (``--calls`` calls per graph on
as many fresh inputs, refilled before every replay; median of ``--reps`` replays, the slowest rank's). Every
graph's outputs are first checked bit for bit against the ``torch`` transport on the same inputs.

The yardstick is ``benchmarks/nvlink_ceiling.cu``'s copy kernel (built into ``build/libnvlink_copy.so`` on first
use) writing each peer's share of the remote bytes into that peer's staging region with S SMs, and the same bytes
by ``cudaMemcpyAsync`` (copy engines). With ranks sharing one GPU the bytes never cross NVLink: the table gives the
kernels' SM-bound throughput and their distance from a copy with the same SMs, not the link's speed.
``--record`` appends each kernel's GB/s beside the copy kernel's (benchmarks/records.py).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

import records  # noqa: E402

from moe_ep_plugin import Buffer, Config, gating  # noqa: E402
from moe_ep_plugin.launch import spawn  # noqa: E402
from moe_ep_plugin.ops import fp8  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COPY_LIB = os.path.join(ROOT, "build", "libnvlink_copy.so")
KERNELS = ("fp8 dispatch, quantized in send path", "fp8 dispatch, pre-quantized", "bf16 dispatch", "bf16 combine")
COPY_SMS = (32, 48, 64)  # beyond the kernels' SM counts: where the copy kernel's best is looked for


def copy_library() -> ctypes.CDLL:
    """The copy yardstick, built from benchmarks/nvlink_ceiling.cu on first use (needs nvcc)."""
    source = os.path.join(ROOT, "benchmarks", "nvlink_ceiling.cu")
    if not os.path.exists(COPY_LIB) or os.path.getmtime(COPY_LIB) < os.path.getmtime(source):
        os.makedirs(os.path.dirname(COPY_LIB), exist_ok=True)
        subprocess.run(
            [
                "nvcc",
                "-O3",
                "-arch=sm_90",
                "-shared",
                "-Xcompiler",
                "-fPIC",
                "-DNVLINK_CEILING_LIBRARY",
                source,
                "-o",
                COPY_LIB,
            ],
            check=True,
        )
    lib = ctypes.CDLL(COPY_LIB)
    lib.nvlink_copy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.nvlink_copy_engine.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return lib


@dataclass
class Case:
    """One kernel at one token count: its cached call, the fresh inputs the graph takes and their references."""

    kernel: str
    tokens: int
    call: object  # (inputs, config) -> outputs
    pool: list  # fresh inputs (tensors or FP8 pairs), more than one graph's calls
    want: list  # the torch transport's outputs of pool[i]
    remote_bytes: list[int]  # bytes this rank sends to each rank (0 to itself)


def route(tokens: int, world: int, seed: int) -> torch.Tensor:
    logits = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(seed))
    _, idx = gating.group_limited_topk(logits, 8, score_function="sigmoid", num_groups=8, group_topk=4)
    return idx


def token_ranks(idx: torch.Tensor, world: int) -> torch.Tensor:
    """``[T, R]`` bool: token t goes to rank r (once, whichever of its experts there; -1 goes nowhere)."""
    return (idx.unsqueeze(-1) // (256 // world) == torch.arange(world)).any(1)


def rows_to(idx: torch.Tensor, world: int) -> list[int]:
    """Tokens this rank sends to each rank (a token goes once to every rank of one of its experts)."""
    return token_ranks(idx, world).sum(0).tolist()


def _same(got, want) -> bool:
    if isinstance(want, tuple):
        return all(_same(g, w) for g, w in zip(got, want, strict=True))
    if want.dtype == fp8.FP8_DTYPE:
        return torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    return got.dtype == want.dtype and torch.equal(got, want)


def _to(v, device):
    return tuple(_to(p, device) for p in v) if isinstance(v, tuple) else v.to(device)


def _clone(v):
    return tuple(p.clone() for p in v) if isinstance(v, tuple) else v.clone()


def _fill(dst, src) -> None:
    if isinstance(dst, tuple):
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)
    else:
        dst.copy_(src)


def _cases(nv: Buffer, ref: Buffer, tokens: int, hidden: int, pool_size: int, seed: int) -> list[Case]:
    rank, world, device = nv.rank, nv.group_size, nv.device
    gen = torch.Generator().manual_seed(seed * 7 + rank)
    idx = route(tokens, world, seed * 1000 + rank)
    sent = rows_to(idx, world)
    rows_from: list = [None] * world
    dist.all_gather_object(rows_from, sent, group=ref.group)
    back = [rows_from[r][rank] if r != rank else 0 for r in range(world)]  # rows each rank sent here
    remote = [n if r != rank else 0 for r, n in enumerate(sent)]

    def bf16() -> torch.Tensor:
        return torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)

    cases = []
    forms = {KERNELS[0]: dict(fp8_dispatch=True, fp8_out=True), KERNELS[1]: {}, KERNELS[2]: {}}
    fp8_row, bf16_row = hidden + hidden // 128 * 4, 2 * hidden
    for kernel, opts in forms.items():
        pre = kernel == KERNELS[1]
        pool_cpu = [fp8.quantize(x) if pre else x for x in (bf16() for _ in range(pool_size))]
        x0 = _to(pool_cpu[0], device)
        *_, handle, _ = nv.dispatch(x0, topk_idx=idx.to(device), num_experts=256, **opts)
        *_, ref_handle, _ = ref.dispatch(pool_cpu[0], topk_idx=idx, num_experts=256, **opts)
        want = [_to(ref.dispatch(x, handle=ref_handle, **opts)[0], device) for x in pool_cpu]
        row = fp8_row if (pre or opts) else bf16_row
        cases.append(
            Case(
                kernel,
                tokens,
                lambda x, cfg, h=handle, o=opts: nv.dispatch(x, handle=h, config=cfg, **o)[0],
                [_to(x, device) for x in pool_cpu],
                want,
                [n * row for n in remote],
            )
        )
        if kernel == KERNELS[2]:  # combine takes rows in this layout
            received = want[0].shape[0]
            ys = [torch.randn(received, hidden, generator=gen).to(torch.bfloat16) for _ in range(pool_size)]
            want_c = [ref.combine(y, ref_handle)[0].to(device) for y in ys]
            cases.append(
                Case(
                    KERNELS[3],
                    tokens,
                    lambda y, cfg, h=handle: nv.combine(y, h, config=cfg)[0],
                    [y.to(device) for y in ys],
                    want_c,
                    [n * bf16_row for n in back],
                )
            )
    return cases


def _median_us(graph: torch.cuda.CUDAGraph, refill, reps: int, group: dist.ProcessGroup) -> float:
    """Median time of one replay (after ``refill(i)``, outside the timed span), ranks started together."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(reps + 3):
        refill(i)
        torch.cuda.synchronize()
        dist.barrier(group=group)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _time_case(case: Case, sms: int, calls: int, reps: int, group: dist.ProcessGroup) -> tuple[float, bool]:
    """``(µs per call, outputs exact)`` of ``case`` at ``sms`` SMs, replayed from one graph of ``calls`` calls."""
    cfg = Config(num_sms=sms)
    inputs = [_clone(case.pool[j]) for j in range(calls)]  # the graph's own input tensors, refilled per replay
    for x in inputs:  # warm-up outside the capture (lazy allocations, the plan's first use)
        case.call(x, cfg)
    torch.cuda.synchronize()
    dist.barrier(group=group)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [case.call(x, cfg) for x in inputs]
    n = len(case.pool)

    def refill(i: int) -> None:
        for j, x in enumerate(inputs):
            _fill(x, case.pool[(i * calls + j) % n])

    refill(0)
    graph.replay()
    torch.cuda.synchronize()
    exact = all(_same(outs[j], case.want[j % n]) for j in range(calls))
    us = _median_us(graph, refill, reps, group) / calls
    del graph, outs
    return us, exact


def _time_copy(
    nv: Buffer,
    remote: list[int],
    sms: int,
    engine: bool,
    calls: int,
    reps: int,
    group: dist.ProcessGroup,
    lib: ctypes.CDLL,
) -> float:
    """µs per copy of ``remote[p]`` bytes to every peer ``p``'s staging region (copy kernel on ``sms`` SMs, or
    the copy engines), replayed from one graph of ``calls`` copies."""
    src = torch.randint(-100, 100, (max(max(remote), 16) // 2,), dtype=torch.int16, device=nv.device)
    targets = [nv.transport.peer_region(p) + (n,) for p, n in enumerate(remote) if n]
    for _, size, n in targets:
        if n > size:
            raise ValueError(f"--tokens: {n} remote bytes do not fit a staging region of {size}")

    def copies() -> None:
        stream = torch.cuda.current_stream().cuda_stream
        for address, _, n in targets:
            code = (
                lib.nvlink_copy_engine(address, src.data_ptr(), n // 16 * 16, stream)
                if engine
                else lib.nvlink_copy(address, src.data_ptr(), n // 16 * 16, sms, stream)
            )
            if code:
                raise RuntimeError(f"copy yardstick: CUDA error {code}")

    copies()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            copies()
    us = _median_us(graph, lambda i: src.add_(1), reps, group) / calls
    del graph
    return us


def _sweep(args: argparse.Namespace, shared: bool) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", 0 if shared else rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    cpu_group = dist.group.WORLD if shared else dist.new_group(backend="gloo")
    nv = Buffer(dist.group.WORLD, transport="nvlink", device=device if shared else None)
    ref = Buffer(cpu_group, transport="torch", device="cpu")
    lib = copy_library()
    rows = []
    for tokens in args.tokens:
        cases = _cases(nv, ref, tokens, args.hidden, 2 * args.calls, args.seed)
        for case in cases:
            for sms in args.sms:
                us, exact = _time_case(case, sms, args.calls, args.reps, cpu_group)
                copy_us = _time_copy(nv, case.remote_bytes, sms, False, args.calls, args.reps, cpu_group, lib)
                rows.append((case.kernel, tokens, sms, sum(case.remote_bytes), us, copy_us, exact))
        remote = cases[2].remote_bytes  # BF16 dispatch's bytes: the copy's best SM count and the copy engines
        for sms in COPY_SMS:
            if sms * world <= torch.cuda.get_device_properties(device).multi_processor_count or not shared:
                us = _time_copy(nv, remote, sms, False, args.calls, args.reps, cpu_group, lib)
                rows.append(("copy kernel", tokens, sms, sum(remote), us, us, True))
        us = _time_copy(nv, remote, 0, True, args.calls, args.reps, cpu_group, lib)
        rows.append(("copy engine", tokens, 0, sum(remote), us, us, True))
    gathered: list = [None] * world
    dist.all_gather_object(gathered, rows, group=cpu_group)
    if rank == 0:
        _report(
            args, gathered, world, shared, torch.cuda.get_device_name(device), records.machine(1 if shared else world)
        )
    nv.destroy()


def _report(args: argparse.Namespace, gathered: list, world: int, shared: bool, device_name: str, machine: str) -> None:
    layout = f"{world} ranks sharing one GPU" if shared else f"{world} ranks, one per GPU"
    print(
        f"\nSM sweep, {layout} ({device_name}); hidden {args.hidden}, top-8 of 256 group-limited; "
        f"{args.calls} calls per graph, median of {args.reps} replays, the slowest rank"
    )
    if shared:
        print(
            "Ranks share one GPU: the bytes never cross NVLink. These are the kernels' SM-bound throughputs and "
            "their distance from a copy with the same SMs, not the link's speed."
        )
    print(
        "| kernel | tokens | SMs | remote MB/rank | µs | GB/s | GB/s per SM | copy kernel µs | copy GB/s | "
        "kernel/copy | exact |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for i, row in enumerate(gathered[0]):
        kernel, tokens, sms, _, _, _, _ = row
        remote = max(g[i][3] for g in gathered)  # per rank; all ranks alike within routing noise
        us = max(g[i][4] for g in gathered)
        copy_us = max(g[i][5] for g in gathered)
        exact = all(g[i][6] for g in gathered)
        gbs, copy_gbs = remote / us / 1e3, remote / copy_us / 1e3
        per_sm = f"{gbs / sms:.1f}" if sms else "-"
        print(
            f"| {kernel} | {tokens} | {sms or '-'} | {remote / 1e6:.1f} | {us:.1f} | {gbs:.0f} | {per_sm} | "
            f"{copy_us:.1f} | {copy_gbs:.0f} | {gbs / copy_gbs:.2f} | {'yes' if exact else 'NO'} |"
        )
        config = dict(
            layout="shared GPU" if shared else "one GPU per rank", ranks=world, tokens=tokens, kernel=kernel, sms=sms
        )
        records.record(
            args,
            "sm_sweep",
            config,
            round(gbs, 1),
            None if kernel.startswith("copy") else round(copy_gbs, 1),
            "GB/s",
            device=machine,
        )
    if not all(g[i][6] for g in gathered for i in range(len(g))):
        raise SystemExit("sm_sweep: some outputs differ from the torch transport's (rows marked NO)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--layout",
        choices=("shared", "per-gpu"),
        default=None,
        help="shared: ranks share GPU 0 (default with one GPU); per-gpu: one rank per visible GPU",
    )
    p.add_argument("--ranks", type=int, default=2, help="ranks sharing the GPU (shared layout)")
    p.add_argument("--tokens", type=lambda s: [int(v) for v in s.split(",")], default=[4096, 1024])
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--sms", type=lambda s: [int(v) for v in s.split(",")], default=[4, 6, 8, 12, 16, 24])
    p.add_argument("--calls", type=int, default=4, help="calls per captured graph, each on fresh inputs")
    p.add_argument("--reps", type=int, default=30, help="timed replays (median)")
    p.add_argument("--seed", type=int, default=1)
    records.add_argument(p)
    args = p.parse_args()
    gpus = torch.cuda.device_count()
    if gpus < 1:
        raise SystemExit("sm_sweep: needs a CUDA GPU")
    shared = (args.layout or ("shared" if gpus == 1 else "per-gpu")) == "shared"
    world = args.ranks if shared else gpus
    spawn(_sweep, world, args=(args, shared), backend="gloo" if shared else "nccl", timeout_s=600.0)


if __name__ == "__main__":
    main()
