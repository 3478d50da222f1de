"""Time dispatch/combine of the ``nvlink`` kernels and the ``torch`` transport (NCCL) on the standard shape.

One process per local GPU (spawned; or under torchrun). Standard shape (DeepSeek-V3's MoE layer): 4096 tokens
per rank, hidden 7168, 256 experts, top-8 with group-limited sigmoid routing (8 groups, top-4 groups); FP8
dispatch, BF16 dispatch, BF16 combine, and the expert-major pair (``dispatch_experts`` straight into the
grouped-GEMM layout, ``combine_experts`` from expert outputs). ``kernel dispatch fp8`` quantizes BF16 rows in the
send path; ``kernel dispatch fp8 input`` ships rows quantized beforehand, as DeepEP's FP8 dispatch does. Before
timing, the nvlink results are checked against the torch transport on the same inputs. Method: CUDA events around
each call, warm-up, median of ``--iters`` runs over 4 rotating input sets, a barrier before every timed series; the
slowest rank's median is reported.
Bandwidth: *logical* = all rows a rank receives (its own included, DeepEP's way); *physical* = rows that
cross NVLink. Usage: ``python benchmarks/bench_dispatch_combine.py [--iters 30] [--json out.json] [--record]``
(``--record``: the cases at ``--tokens`` as rows of benchmarks/results.jsonl; the variants and the sweep are
printed only).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from collections.abc import Callable

import records
import torch
import torch.distributed as dist
from standard_shape import add_shape_arguments

from moe_ep_plugin import Buffer, gating
from moe_ep_plugin.config import NVLinkTuning
from moe_ep_plugin.launch import launch
from moe_ep_plugin.ops import fp8
from moe_ep_plugin.transports import DispatchArgs


def _routing(n: int, num_experts: int, topk: int, device: torch.device, seed: int):
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(n, num_experts, device=device, generator=gen)
    weights, idx = gating.group_limited_topk(logits, topk, score_function="sigmoid", num_groups=8, group_topk=4)
    return idx, weights.float().contiguous()


def _median_us(fn: Callable[[int], object], iters: int, warmup: int) -> float:
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    dist.barrier()
    pairs = []
    for i in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i)
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    median = statistics.median(s.elapsed_time(e) for s, e in pairs) * 1e3
    slowest = torch.tensor([median], device="cuda")
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest.item())


def _graph_us(fn: Callable[[int], object], iters: int, reps: int = 8) -> float:
    """GPU time per call without host overhead: ``reps`` calls captured in one CUDA graph, replays timed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(2):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(i)
    torch.cuda.synchronize()
    dist.barrier()
    return _median_us(lambda i: graph.replay(), iters, 2) / reps


def _same(a, b) -> bool:
    if isinstance(a, tuple):
        return all(_same(u, v) for u, v in zip(a, b, strict=True))
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _shape_rows(buffer: Buffer, inputs: list, num_experts: int) -> tuple[int, int, int, int]:
    """(rows received, rows received from other ranks, rows sent back by combine to others) on this rank."""
    x, idx, w = inputs[0]
    _, _, _, _, handle, _ = buffer.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=num_experts)
    rpm = handle.rank_prefix_matrix.cpu()
    me = dist.get_rank()
    own = int(rpm[me, me] - (rpm[me - 1, me] if me else 0))
    total = int(handle.num_recv_tokens)
    return total, total - own, total - own, x.shape[0]


def _bench_one(
    buffer: Buffer,
    n: int,
    args,
    seed: int,
    tag: str,
    results: list,
    check: Buffer | None,
    tuning: NVLinkTuning | None = None,
) -> None:
    """Every op on ``buffer``, timed with the default Configs at ``Buffer.num_sms`` carrying ``tuning``."""
    device = buffer.device
    tuning = NVLinkTuning() if tuning is None else tuning
    dcfg = dataclasses.replace(Buffer.get_dispatch_config(dist.get_world_size()), nvlink=tuning)
    ccfg = dataclasses.replace(Buffer.get_combine_config(dist.get_world_size()), nvlink=tuning)
    h, e, k = args.hidden, args.experts, args.topk
    inputs = []
    for j in range(4):
        idx, w = _routing(n, e, k, device, seed + 17 * j)
        inputs.append((torch.randn(n, h, device=device).to(torch.bfloat16), idx, w))
    layouts = [buffer.get_dispatch_layout(idx, e) for _, idx, _ in inputs]
    total, remote, _, _ = _shape_rows(buffer, inputs, e)
    sums = torch.tensor([total, remote], dtype=torch.float64, device=device)
    dist.all_reduce(sums, op=dist.ReduceOp.MAX)
    total, remote = int(sums[0]), int(sums[1])

    def disp(i: int, **kw):
        x, idx, w = inputs[i % 4]
        per_rank, _, per_expert, in_rank, _ = layouts[i % 4]
        return buffer.dispatch(
            x,
            num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=idx,
            topk_weights=w,
            config=dcfg,
            **kw,
        )

    def edisp(i: int, **kw):
        x, idx, w = inputs[i % 4]
        return buffer.dispatch_experts(x, topk_idx=idx, topk_weights=w, num_experts=e, config=dcfg, **kw)

    if check is not None:
        ok = True
        for kw in (dict(), dict(fp8_dispatch=True, fp8_out=True), dict(fp8_dispatch=True)):
            got, want = disp(0, **kw), None
            x, idx, w = inputs[0]
            want = check.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=e, **kw)
            ok &= all(_same(a, b) for a, b in zip(got[:3], want[:3], strict=True)) and got[3] == want[3]
            y = (
                got[0]
                if not isinstance(got[0], tuple)
                else torch.randn(got[4].num_recv_rows, h, device=device).to(torch.bfloat16)
            )
            ok &= _same(buffer.combine(y, got[4])[0], check.combine(y, want[4])[0])
            got, want = edisp(0, **kw), check.dispatch_experts(x, topk_idx=idx, topk_weights=w, num_experts=e, **kw)
            ok &= all(_same(a, b) for a, b in zip(got[:3], want[:3], strict=True) if a is not None)
            ok &= got[3] == want[3]
            if not kw.get("fp8_out"):
                y = torch.randn(got[4].expert_layout.num_rows, h, device=device).to(torch.bfloat16)
                ok &= _same(buffer.combine_experts(y, got[4])[0], check.combine_experts(y, want[4])[0])
        flag = torch.tensor([0 if ok else 1], device=device)
        dist.all_reduce(flag)
        results.append(dict(tag=tag, tokens=n, op="check vs torch", ok=int(flag.item()) == 0))

    handles = [disp(j)[4] for j in range(4)]
    ys = [torch.randn(hd.num_recv_rows, h, device=device).to(torch.bfloat16) for hd in handles]
    ehandles = [edisp(j)[4] for j in range(4)]
    eys = [torch.randn(hd.expert_layout.num_rows, h, device=device).to(torch.bfloat16) for hd in ehandles]
    bf16_row, fp8_row = h * 2, h + h // 128 * 4
    worst = n * dist.get_world_size()
    ops = [
        ("layout", lambda i: buffer.get_dispatch_layout(inputs[i % 4][1], e), 0),
        ("dispatch fp8", lambda i: disp(i, fp8_dispatch=True, fp8_out=True), fp8_row),
        ("dispatch fp8->bf16", lambda i: disp(i, fp8_dispatch=True), fp8_row),
        ("dispatch bf16", lambda i: disp(i), bf16_row),
        (
            "dispatch bf16 cached",
            lambda i: buffer.dispatch(inputs[i % 4][0], handle=handles[i % 4], config=dcfg),
            bf16_row,
        ),
        ("dispatch fp8 worst", lambda i: disp(i, fp8_dispatch=True, fp8_out=True, num_worst_tokens=worst), fp8_row),
        ("combine bf16", lambda i: buffer.combine(ys[i % 4], handles[i % 4], config=ccfg), bf16_row),
        ("experts dispatch bf16", lambda i: edisp(i), bf16_row),
        ("experts dispatch fp8->bf16", lambda i: edisp(i, fp8_dispatch=True), fp8_row),
        ("experts combine bf16", lambda i: buffer.combine_experts(eys[i % 4], ehandles[i % 4], config=ccfg), bf16_row),
    ]
    if buffer.transport_name == "nvlink":
        # The kernels alone: straight to the transport, no Buffer validation, streams or host syncs.
        transport = buffer.transport

        quantized = [fp8.quantize(x) for x, _, _ in inputs]  # DeepEP's FP8 dispatch takes pre-quantized rows

        def cached_args(i: int, wire_fp8: bool, handle, fp8_out: bool = True, fp8_in: bool = False) -> DispatchArgs:
            x, scales = quantized[i % 4] if fp8_in else (inputs[i % 4][0], None)
            return DispatchArgs(
                x=x,
                x_scales=scales,
                topk_idx=None,
                topk_weights=None,
                num_tokens_per_rank=None,
                is_token_in_rank=None,
                num_experts=e,
                handle=handle,
                num_worst_tokens=0,
                wire_fp8=wire_fp8,
                fp8_out=fp8_out,
                round_scale=False,
                config=dcfg,
            )

        def kernel_dispatch(i: int, wire_fp8: bool, fp8_in: bool = False):
            return transport.dispatch(cached_args(i, wire_fp8, handles[i % 4], fp8_in=fp8_in))

        ops += [
            ("kernel layout", lambda i: transport.get_dispatch_layout(inputs[i % 4][1], e), 0),
            ("kernel dispatch fp8", lambda i: kernel_dispatch(i, True), fp8_row),
            ("kernel dispatch fp8 input", lambda i: kernel_dispatch(i, False, fp8_in=True), fp8_row),
            ("kernel dispatch bf16", lambda i: kernel_dispatch(i, False), bf16_row),
            ("kernel combine bf16", lambda i: transport.combine(ys[i % 4], handles[i % 4], None, (), ccfg), bf16_row),
            (
                "kernel experts dispatch bf16",
                lambda i: transport.dispatch_experts(cached_args(i, False, ehandles[i % 4]), 1),
                bf16_row,
            ),
            (
                "kernel experts dispatch fp8->bf16",
                lambda i: transport.dispatch_experts(cached_args(i, True, ehandles[i % 4], fp8_out=False), 1),
                fp8_row,
            ),
            (
                "kernel experts combine bf16",
                lambda i: transport.combine_experts(eys[i % 4], ehandles[i % 4], None, (), ccfg),
                bf16_row,
            ),
        ]
    if args.quick:
        ops = [op for op in ops if op[0].startswith("kernel ")]
    if buffer.transport_name == "nvlink" and not args.quick:
        ops += [(f"graph {name}", fn, row_bytes) for name, fn, row_bytes in ops if name.startswith("kernel ")]
    for name, fn, row_bytes in ops:
        us = _graph_us(fn, args.iters) if name.startswith("graph ") else _median_us(fn, args.iters, args.warmup)
        results.append(
            dict(
                tag=tag,
                tokens=n,
                op=name,
                us=us,
                logical_gbs=total * row_bytes / us / 1e3 if row_bytes else None,
                physical_gbs=remote * row_bytes / us / 1e3 if row_bytes else None,
                rows=total,
                remote_rows=remote,
            )
        )


# The Buffer API's ops (stock: the torch transport in the same run) and the kernels' CUDA-graph ops (stock: DeepEP
# V1's figure from its own run), as results.jsonl names them.
API_OPS = {
    "layout": "layout",
    "dispatch fp8": "FP8 dispatch, fresh",
    "dispatch fp8->bf16": "FP8 → BF16 dispatch, fresh",
    "dispatch bf16": "BF16 dispatch, fresh",
    "dispatch bf16 cached": "BF16 dispatch, cached handle",
    "dispatch fp8 worst": "FP8 dispatch, num_worst_tokens",
    "combine bf16": "BF16 combine",
    "experts dispatch bf16": "expert-major dispatch BF16",
    "experts dispatch fp8->bf16": "expert-major dispatch FP8 → BF16",
    "experts combine bf16": "expert-major combine",
}
GRAPH_OPS = {
    "graph kernel layout": "layout",
    "graph kernel dispatch fp8 input": "FP8 dispatch, rows quantized beforehand",
    "graph kernel dispatch fp8": "FP8 dispatch, BF16 rows quantized in the send path",
    "graph kernel dispatch bf16": "BF16 dispatch",
    "graph kernel combine bf16": "BF16 combine",
    "graph kernel experts dispatch bf16": "expert-major dispatch BF16 (kernel + permute)",
    "graph kernel experts dispatch fp8->bf16": "expert-major dispatch FP8 → BF16",
    "graph kernel experts combine bf16": "expert-major combine",
}


def record_rows(
    results: list[dict], tokens: int, sms: int, world: int, device: str, data: str = str(records.DEFAULT_PATH)
) -> list[tuple[dict, float, float | None]]:
    """(configuration, plugin µs, stock µs) of each case of ``results`` at ``tokens`` (not the variants' or the
    sweep's); the graph rows' stock is DeepEP V1's figure of the newest such row in ``data`` (it is measured in its
    own run). No rows when the check against the torch transport failed: a wrong result is no figure."""
    checks = [r["ok"] for r in results if "ok" in r]
    if not checks or not all(checks):
        return []
    timed = {(r["tag"], r["op"]): r["us"] for r in results if r["tokens"] == tokens and "us" in r}
    plugin, stock = f"nvlink {sms} SMs", "torch (NCCL)"

    def config(timing: str, stock_path: str, op: str) -> dict:
        return {"ep": world, "tokens": tokens, "sms": sms, "timing": timing, "stock path": stock_path, "op": op}

    rows = [
        (config("api", "torch transport (NCCL)", label), round(timed[plugin, op], 1), round(timed[stock, op], 1))
        for op, label in API_OPS.items()
        if (plugin, op) in timed and (stock, op) in timed
    ]
    for op, label in GRAPH_OPS.items():
        if (plugin, op) in timed:
            row = config("graph", "DeepEP V1 (its own run)", label)
            rows.append(
                (row, round(timed[plugin, op], 1), records.reference(data, "bench_dispatch_combine", row, device))
            )
    return rows


def _worker(args) -> None:
    torch.manual_seed(1234 + dist.get_rank())
    Buffer.set_num_sms(args.sms)
    nvlink = Buffer(dist.group.WORLD, transport="nvlink")
    reference = Buffer(dist.group.WORLD, transport="torch")
    results: list = []
    _bench_one(nvlink, args.tokens, args, 7, f"nvlink {args.sms} SMs", results, reference)
    if not args.quick:
        _bench_one(reference, args.tokens, args, 7, "torch (NCCL)", results, None)
    for sms, settings in args.variants:
        Buffer.set_num_sms(sms)
        sub = argparse.Namespace(**{**vars(args), "quick": True})
        what = ", ".join(f"{name}={value}" for name, value in settings.items())
        _bench_one(
            nvlink,
            args.tokens,
            sub,
            7,
            f"nvlink {sms} SMs{', ' + what if what else ''}",
            results,
            None,
            NVLinkTuning(**settings),
        )
    Buffer.set_num_sms(args.sms)
    sub = argparse.Namespace(**{**vars(args), "quick": True})
    for n in args.sweep:
        if n != args.tokens:
            _bench_one(nvlink, n, sub, 11, f"nvlink {args.sms} SMs", results, None)
    if dist.get_rank() == 0:
        print(f"\n{'config':<34} {'tokens':>6} {'op':<22} {'time us':>9} {'logical GB/s':>13} {'physical GB/s':>14}")
        for r in results:
            if "ok" in r:
                print(f"{r['tag']:<34} {r['tokens']:>6} {r['op']:<22} {'PASS' if r['ok'] else 'FAIL':>9}")
                continue
            lg = f"{r['logical_gbs']:.0f}" if r["logical_gbs"] else "-"
            ph = f"{r['physical_gbs']:.0f}" if r["physical_gbs"] else "-"
            print(f"{r['tag']:<34} {r['tokens']:>6} {r['op']:<22} {r['us']:>9.1f} {lg:>13} {ph:>14}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(args={k: v for k, v in vars(args).items()}, results=results), f, indent=1)
        if args.record:
            device = records.machine(dist.get_world_size())
            for config, plugin, stock in record_rows(results, args.tokens, args.sms, dist.get_world_size(), device):
                records.record(args, "bench_dispatch_combine", config, plugin, stock, "µs", device=device)
    torch.cuda.synchronize()
    dist.barrier()
    nvlink.destroy()


def tuning_settings(pairs: list[str], what: str) -> dict[str, object]:
    """``["dispatch_pull=0", "combine_send_blocks=8"]`` → NVLinkTuning keyword arguments (bools for its bool
    fields), validated by building one."""
    fields = {f.name: f.type for f in dataclasses.fields(NVLinkTuning)}
    settings: dict[str, object] = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        if name not in fields or not value:
            raise argparse.ArgumentTypeError(f"{what}: expected NAME=INT with an NVLinkTuning field, got {pair!r}")
        settings[name] = bool(int(value)) if fields[name] in (bool, "bool") else int(value)
    try:
        NVLinkTuning(**settings)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"{what}: {exc}") from None
    return settings


def _variants(text: str) -> list[tuple[int, dict[str, object]]]:
    """``"24:combine_pull=0 32"`` -> ``[(24, {"combine_pull": False}), (32, {})]``."""
    out = []
    for item in text.split():
        sms, *settings = item.split(":")
        out.append((int(sms), tuning_settings(settings, "--variants")))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_arguments(p)
    p.add_argument("--sms", type=int, default=24)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--sweep", type=lambda s: [int(v) for v in s.split(",") if v], default=[1024, 2048, 8192])
    p.add_argument(
        "--variants",
        type=_variants,
        default="24:dispatch_pull=0:combine_pull=0 24:quantizing_dispatch_send_warps=12 12 16",
        help="space-separated SMs[:attr=value...]: kernel timings on the standard shape with these "
        "NVLinkTuning fields (e.g. 24:copy_engine_combine_below_sms=32:dispatch_send_warps=8)",
    )
    p.add_argument("--quick", action="store_true", help="only the kernel-level timings")
    p.add_argument("--json", default="")
    records.add_argument(p)
    args = p.parse_args()
    if torch.cuda.device_count() == 0:
        raise SystemExit("bench_dispatch_combine.py times the CUDA kernels: it needs at least one CUDA GPU")
    launch(_worker, args=(args,), nprocs=torch.cuda.device_count(), backend="nccl")


if __name__ == "__main__":
    main()
