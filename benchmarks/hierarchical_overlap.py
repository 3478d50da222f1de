"""Dispatch + combine time of the ``hierarchical`` transport against ``Config.hierarchical_chunks`` (stage overlap).

Run from the repository root:
``PYTHONPATH=. python3 benchmarks/hierarchical_overlap.py [--ranks 4 --ranks-per-node 2 --chunks 1 2 4 8
--tokens 1024 --hidden 2048 --experts 64 --topk 8 --iters 10 --warmup 2 --device cpu]``

Spawns ``--ranks`` local processes emulating ``ranks / ranks_per_node`` nodes (``Buffer(transport="hierarchical",
ranks_per_node=...)``). Every rank draws uniform random top-k routing over all experts (so most tokens reach
every node) and BF16 rows; per chunk count it times an uncached dispatch (with weights) and a combine of the
received rows, each between barriers, the variants in turn within each iteration, and reports the median over
``--iters`` of the slowest rank, in ms, with the ratio of the chunks = 1 time to each row's (above 1: faster
than the stages one after the other).
``--serial`` adds a control row per chunk count: the same chunks with the stages one after the other (on that
row's Buffer the rail stage's ``start_dispatch``/``start_combine`` complete each exchange before returning), so
that what the overlap buys is told apart from what smaller exchanges change by themselves.

``--device cpu`` (gloo, one torch thread per rank): every "link" is the host's memory and every rank shares its
cores, so the numbers say what chunking costs in per-chunk collectives and host work and whether gloo's worker
threads overlap anything there, not what a network would give. ``--device cuda``: NCCL, rank r on ``cuda:r``
(one GPU per rank: NCCL refuses two ranks on one GPU, and a gloo group cannot carry the torch stages' CUDA
tensors); the nodes are still emulated, so the rail stage crosses NVLink, not a NIC.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import records
import torch
import torch.distributed as dist
from standard_shape import add_shape_arguments

from moe_ep_plugin import Buffer, Config
from moe_ep_plugin.launch import spawn
from moe_ep_plugin.transports.base import Transport


def _timed(fn, device: torch.device) -> float:
    """Seconds ``fn`` takes on the slowest rank, started together after a barrier (CUDA work included)."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _dispatch_combine(
    buffer: Buffer,
    config: Config,
    x: torch.Tensor,
    idx: torch.Tensor,
    w: torch.Tensor,
    num_experts: int,
    device: torch.device,
) -> tuple[float, float]:
    """Seconds of one uncached dispatch of ``x`` ``[N, H]`` BF16 (top-k ``idx`` ``[N, K]`` int64, weights ``w``
    ``[N, K]`` float32) and of the combine of its received rows, each on the slowest rank."""
    received: list[tuple] = []
    dispatch_s = _timed(
        lambda: received.append(
            buffer.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=num_experts, config=config)
        ),
        device,
    )
    recv_x, _, _, _, handle, _ = received[0]
    return dispatch_s, _timed(lambda: buffer.combine(recv_x, handle, config=config), device)


def _make_serial(rail: Transport) -> None:
    """The control: ``rail``'s exchanges complete before ``start_*`` returns, so nothing overlaps them."""
    start_dispatch, start_combine = rail.start_dispatch, rail.start_combine

    def at_once(start: Callable[..., Callable[[], object]]) -> Callable[..., Callable[[], object]]:
        def run(*args: object) -> Callable[[], object]:
            result = start(*args)()
            return lambda: result

        return run

    rail.start_dispatch, rail.start_combine = at_once(start_dispatch), at_once(start_combine)


def _rank_main(args: argparse.Namespace) -> None:
    rank = dist.get_rank()
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # the ranks share the host's cores: one thread each, as a GPU rank drives one GPU
    overlapped = Buffer(transport="hierarchical", ranks_per_node=args.ranks_per_node, device=str(device))
    serial = Buffer(transport="hierarchical", ranks_per_node=args.ranks_per_node, device=str(device))
    _make_serial(serial.transport.rail)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.tokens, args.hidden, generator=gen).to(torch.bfloat16).to(device)
    idx = torch.rand(args.tokens, args.experts, generator=gen).topk(args.topk, dim=1).indices.to(device)
    w = torch.rand(args.tokens, args.topk, generator=gen).to(device)
    variants = [(c, False) for c in args.chunks]
    if args.serial:
        variants += [(c, True) for c in args.chunks if c > 1]
    # Round robin: each iteration times every variant once, so drifting load from other processes on the host
    # falls on all rows alike.
    times: list[list[tuple[float, float]]] = [[] for _ in variants]
    for _ in range(args.warmup + args.iters):
        for timed, (chunks, is_serial) in zip(times, variants, strict=True):
            buffer = serial if is_serial else overlapped
            timed.append(_dispatch_combine(buffer, Config(hierarchical_chunks=chunks), x, idx, w, args.experts, device))
    rows = [
        (
            f"{chunks}{' serial' if is_serial else ''}",
            statistics.median(t[0] for t in timed[args.warmup :]) * 1e3,
            statistics.median(t[1] for t in timed[args.warmup :]) * 1e3,
        )
        for (chunks, is_serial), timed in zip(variants, times, strict=True)
    ]
    if rank == 0:
        _print_table(args, rows)


def _print_table(args: argparse.Namespace, rows: list[tuple[str, float, float]]) -> None:
    nodes = args.ranks // args.ranks_per_node
    print(
        f"hierarchical transport, {nodes} emulated nodes x {args.ranks_per_node} ranks on {args.device}; "
        f"{args.tokens} tokens/rank, hidden {args.hidden}, {args.experts} experts, top-{args.topk}, BF16; "
        f"median of {args.iters} (slowest rank)"
    )
    base = rows[0][1] + rows[0][2]
    print(
        f"{'chunks':>8} | {'dispatch ms':>11} | {'combine ms':>10} | {'total ms':>8} | {'vs chunks=' + rows[0][0]:>12}"
    )
    for label, d, c in rows:
        print(f"{label:>8} | {d:>11.2f} | {c:>10.2f} | {d + c:>8.2f} | {base / (d + c):>11.2f}x")
    for label, d, c in rows[1:]:  # stock: the first chunk count (one exchange by default)
        chunks, _, serial = label.partition(" ")
        records.record(
            args,
            "hierarchical_overlap",
            {
                "nodes x ranks": f"{nodes}x{args.ranks_per_node}",
                "chunks": int(chunks),
                "mode": "serial control" if serial else "chunked",
            },
            round((d + c) / 1e3, 2),
            round(base / 1e3, 2),
            "s",
            device="cpu" if args.device == "cpu" else None,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument(
        "--chunks",
        type=int,
        nargs="+",
        default=[1, 2, 4, 8],
        help="chunk counts to time; the first is the baseline of the ratio column",
    )
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--serial", action="store_true", help="add the chunked-but-serial control rows")
    records.add_argument(parser)
    add_shape_arguments(parser, tokens=1024, hidden=2048, experts=64, topk=8)
    args = parser.parse_args()
    if args.ranks % args.ranks_per_node or args.ranks == args.ranks_per_node:
        parser.error("--ranks must be a multiple (>= 2) of --ranks-per-node")
    spawn(_rank_main, args.ranks, args=(args,), backend="nccl" if args.device == "cuda" else "gloo", timeout_s=3600)


if __name__ == "__main__":
    main()
