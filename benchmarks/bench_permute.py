"""Time the local permute kernels (``moe_ep_plugin.ops.permute``, csrc/permute.cu) against their torch path, one GPU.

Shapes model one receiving rank at DeepSeek-V3 size (hidden 7168, 256 experts, top-8, random routing): EP1 takes
all experts of its 4096 tokens; EP2 and EP8 keep the rows of ``ranks x 4096`` tokens that name a local expert.
Rows are BF16 (FP8 with 1x128 scales where noted). Method: CUDA events around each call, ``--warmup`` calls, median
of ``--iters``. Bytes: permute = received rows read once + M expert-major rows written (scales and probs included);
unpermute = M rows read + received rows written; expert_slots = ids read + slots written. Before timing, the
kernel results are compared with the torch path bit for bit. Usage: ``python benchmarks/bench_permute.py``.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import records
import torch
from standard_shape import add_shape_arguments

from moe_ep_plugin.ops import fp8
from moe_ep_plugin.ops import permute as P


def _median_us(fn: Callable[[], object], iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    pairs = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in pairs) * 1e3


def _received(tokens: int, ranks: int, experts: int, topk: int, gen: torch.Generator) -> torch.Tensor:
    """Local top-k ids ``[N, K]`` of rank 0 of ``ranks``: the rows of ``ranks * tokens`` tokens with a local expert."""
    idx = torch.rand(ranks * tokens, experts, generator=gen, device="cuda").topk(topk, dim=1).indices
    local = experts // ranks
    idx = torch.where(idx < local, idx, -1)
    return idx[(idx >= 0).any(dim=1)]


def _same(a, b) -> bool:
    return all(
        (u is None and v is None) or torch.equal(u.view(torch.uint8), v.view(torch.uint8))
        for u, v in zip(a, b, strict=True)
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_arguments(p)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    records.add_argument(p)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_permute.py times the CUDA kernels: it needs a CUDA GPU")
    if P._kernels() is None:
        raise SystemExit(
            "bench_permute.py: the kernel library lacks the permute kernels: python -m moe_ep_plugin._build"
        )
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = args.hidden
    # (label, tokens per rank, EP ranks, alignment, FP8 rows)
    configs = [
        ("EP1", args.tokens, 1, 1, False),
        ("EP2", args.tokens, 2, 1, False),
        ("EP2 align128", args.tokens, 2, 128, False),
        ("EP2 fp8", args.tokens, 2, 1, True),
        ("EP8", args.tokens, 8, 1, False),
        ("EP2 128 tok", 128, 2, 1, False),
    ]
    print(
        f"{'config':<14} {'N':>6} {'M':>6} {'op':<13} {'kernel us':>10} {'GB/s':>8} {'torch us':>10} {'same bits':>9}"
    )
    for label, tokens, ranks, alignment, use_fp8 in configs:
        idx = _received(tokens, ranks, args.experts, args.topk, gen)
        num_local = args.experts // ranks
        n, k = idx.shape
        counts = torch.bincount(idx[idx >= 0], minlength=num_local)
        tokens_per_expert = ((counts + alignment - 1) // alignment * alignment).tolist()
        m = sum(tokens_per_expert)
        x = torch.randn(n, h, device="cuda", generator=gen).bfloat16()
        scales = None
        if use_fp8:
            x, scales = fp8.quantize(x)
        weights = torch.rand(n, k, device="cuda", generator=gen)
        y = torch.randn(m, h, device="cuda", generator=gen).bfloat16()
        slot = P.expert_slots(idx, num_local, alignment)[0]
        row_bytes = h * x.element_size() + (0 if scales is None else scales.shape[1] * 4) + 4
        rows = [
            (
                "expert_slots",
                lambda: (P.expert_slots(idx, num_local, alignment)[0],),
                lambda: (P._torch_expert_slots(idx, num_local, alignment)[0],),
                n * k * 12,
            ),
            (
                "permute",
                lambda: P.permute(x, slot, m, weights, scales),
                lambda: P._torch_permute(x, slot, m, weights, scales),
                (n + m) * row_bytes,
            ),
            ("unpermute", lambda: (P.unpermute(y, slot),), lambda: (P._torch_unpermute(y, slot),), (n + m) * h * 2),
        ]
        for op, kernel, reference, num_bytes in rows:
            same = _same(kernel(), reference())
            us = _median_us(kernel, args.iters, args.warmup)
            torch_us = _median_us(reference, args.iters, args.warmup)
            print(
                f"{label:<14} {n:>6} {m:>6} {op:<13} {us:>10.1f} {num_bytes / us / 1e3:>8.0f} {torch_us:>10.1f} "
                f"{'yes' if same else 'NO':>9}"
            )
            if same:  # a case whose bits differ is a failure, not a figure
                records.record(
                    args,
                    "bench_permute",
                    {"case": label, "received rows": n, "expert rows": m, "op": op},
                    round(us, 1),
                    round(torch_us, 1),
                    "µs",
                )


if __name__ == "__main__":
    main()
