"""Low-latency dispatch/combine timings from CUDA-graph replay, against the normal-mode path in the same run.

    python benchmarks/bench_low_latency.py                          # EP1 on one GPU: the standard decode shape
    python benchmarks/bench_low_latency.py --sweep 1,8,32,128,256   # and a sweep of tokens per rank
    torchrun --nproc-per-node 2 benchmarks/bench_low_latency.py     # EP2 (one GPU per rank)

Standard decode shape (DeepEP's low-latency benchmark): 128 tokens per rank, hidden 7168, 256 experts, top-8, FP8
dispatch, BF16 combine. For each token count it captures, each in its own CUDA graph: the dispatch, the combine,
both, and the hook halves (send half of the dispatch and its receive hook, then of the combine), and reports the
mean GPU time per replay (CUDA events over ``--iters`` replays, after warm-up). ``stock`` is normal-mode
``Buffer.dispatch`` + ``combine`` of the same tokens (eager, the path without low-latency mode).

Bytes: logical = every (token, expert) selection's message, DeepEP's count (dispatch: FP8 row + scales + 16-byte
header, or BF16 row + header; combine: BF16 row), including selections served by this rank itself; physical =
the selections whose expert lives on another rank (what crosses NVLink; 0 at EP1). Blocks: the grid of each kernel
(dispatch send E, receive L; combine send L*R, receive N), next to the GPU's SM count.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import records  # noqa: E402
from standard_shape import add_shape_arguments  # noqa: E402

from moe_ep_plugin import Buffer, launch  # noqa: E402


def _time(fn, iters: int) -> float:
    """Mean µs of ``fn()`` on the current stream (CUDA events), after a warm-up."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dist.barrier()
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def _graph(fn):
    """``fn`` captured once (after an eager warm-up); returns the replay."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def run(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    m_max, hidden, num_experts, k = max(args.sweep + [args.tokens]), args.hidden, args.experts, args.topk
    buffer = Buffer(
        num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(m_max, hidden, world, num_experts),
        low_latency_mode=True,
        num_qps_per_rank=num_experts // world,
        transport=args.transport,
    )
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    local = num_experts // world
    use_fp8 = not args.bf16
    msg = (hidden + hidden // 128 * 4 + 16) if use_fp8 else (2 * hidden + 16)
    if rank == 0:
        print(
            f"EP{world}, hidden {hidden}, {num_experts} experts, top-{k}, {'FP8' if use_fp8 else 'BF16'} dispatch, "
            f"BF16 combine, transport {buffer.transport_name}, {sms} SMs; µs per call (CUDA-graph replay)"
        )
        print(
            f"{'tokens':>6} {'dispatch':>9} {'combine':>8} {'both':>8} {'d.send':>7} {'d.recv':>7} {'c.send':>7} "
            f"{'c.recv':>7} {'stock':>8} {'logical GB/s':>13} {'physical GB/s':>14} {'blocks d/c':>14}"
        )
    for n in [args.tokens] + [t for t in args.sweep if t != args.tokens]:
        gen = torch.Generator(device=device).manual_seed(1000 * rank + n)
        x = torch.randn(n, hidden, device=device, generator=gen).bfloat16()
        idx = torch.rand(n, num_experts, device=device, generator=gen).argsort(dim=1)[:, :k].contiguous()
        w = torch.rand(n, k, device=device, generator=gen)
        y = torch.randn(local, world * m_max, hidden, device=device, generator=gen).bfloat16()
        handle = buffer.low_latency_dispatch(x, idx, m_max, num_experts, use_fp8=use_fp8)[2]

        def dispatch():
            buffer.low_latency_dispatch(x, idx, m_max, num_experts, use_fp8=use_fp8)

        def combine():
            buffer.low_latency_combine(y, idx, w, handle)

        def both():
            dispatch()
            combine()

        hooks: dict = {}

        def dispatch_send():
            hooks["d"] = buffer.low_latency_dispatch(
                x, idx, m_max, num_experts, use_fp8=use_fp8, return_recv_hook=True
            )[4]

        def combine_send():
            hooks["c"] = buffer.low_latency_combine(y, idx, w, handle, return_recv_hook=True)[2]

        times = {
            name: _time(_graph(fn), args.iters)
            for name, fn in (("dispatch", dispatch), ("combine", combine), ("both", both))
        }
        # the hook halves: a send half and its hook captured in two graphs (after an eager pair), replayed in turn
        halves = {}
        for name, send in (("d", dispatch_send), ("c", combine_send)):
            send()
            hooks[name]()
            torch.cuda.synchronize()
            first, second = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(first):
                send()
            with torch.cuda.graph(second):
                hooks[name]()
            start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            total_send = total_recv = 0.0
            dist.barrier()
            for _ in range(args.iters):
                start.record()
                first.replay()
                mid.record()
                second.replay()
                end.record()
                torch.cuda.synchronize()
                total_send += start.elapsed_time(mid) * 1e3
                total_recv += mid.elapsed_time(end) * 1e3
            halves[name + ".send"], halves[name + ".recv"] = total_send / args.iters, total_recv / args.iters

        def stock():
            recv, _, _, _, h, _ = buffer.dispatch(
                x, topk_idx=idx, topk_weights=w, num_experts=num_experts, fp8_dispatch=use_fp8
            )
            buffer.combine(recv, h)

        stock_us = _time(stock, args.iters)
        valid = idx >= 0
        selections = int(valid.sum())
        remote = int((valid & (idx // local != rank)).sum())
        logical = selections * (msg + 2 * hidden) / (times["both"] * 1e-6) / 1e9
        physical = remote * (msg + 2 * hidden) / (times["both"] * 1e-6) / 1e9
        if rank == 0:
            print(
                f"{n:>6} {times['dispatch']:>9.1f} {times['combine']:>8.1f} {times['both']:>8.1f} "
                + "".join(f"{halves[h]:>7.1f} " for h in ("d.send", "d.recv", "c.send", "c.recv"))
                + f"{stock_us:>8.1f} {logical:>13.1f} {physical:>14.1f} "
                f"{f'{num_experts}+{local}/{local * world}+{n}':>14}"
            )
            # one rank has the local transport whatever was asked; its stock is the normal-mode path
            path = "local" if world == 1 else "kernels" if args.transport == "nvlink" else args.transport
            config = {"ep": world, "path": path, "tokens": n} | ({"dispatch": "BF16"} if not use_fp8 else {})
            records.record(args, "bench_low_latency", config, round(times["both"], 1), round(stock_us, 1), "µs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(parser, tokens=128)
    parser.add_argument(
        "--sweep",
        type=lambda s: [int(v) for v in s.split(",") if v],
        default=[],
        help="more tokens-per-rank values, e.g. 1,2,4,8,16,32,64,128,256",
    )
    parser.add_argument("--bf16", action="store_true", help="BF16 dispatch instead of FP8")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--transport", default="nvlink", help="nvlink (kernels) or torch (collective form)")
    parser.add_argument("--nprocs", type=int, default=1, help="ranks to spawn when not under torchrun")
    records.add_argument(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_low_latency.py needs a CUDA GPU")
    launch.launch(run, args.nprocs, (args,), backend="nccl")


if __name__ == "__main__":
    main()
