"""Time Megatron-Core MoE token dispatchers at DeepSeek-V3 shapes on all local GPUs: Megatron's own (alltoall,
flex+DeepEP) and this library's (``ep_plugin`` on each transport, and flex+deepep served by the plugin's shim).

The timed region is the same for every kind:
identity experts, the six dispatcher methods end to end (preprocess, dispatch, permute, and back),
forward and forward+backward, median of 30 CUDA-event-timed runs after a barrier; every rank times and the
slowest rank's median is reported. Before timing, each kind's output is checked against ``x * sum(probs)``
(``x`` rounded through FP8 first for FP8-dispatch kinds). With ``--pad-capacity`` the routing goes through
Megatron's router token dropping first, as its router does for drop-and-pad (each expert keeps exactly its
capacity of pairs, dropped and padding pairs with probability 0), so the same check holds; ``--cuda-graph`` then
also times the forward captured in one CUDA graph and replayed (drop-and-pad exists for that: no method reads
the host, so the eager launch overhead of small batches is gone). With ``--recv-capacity-factor`` the ``ep_plugin``
kinds run dropless sized on the device from that row budget (``megatron/budget.py``), which ``--cuda-graph`` captures
on ``nvlink`` (``local`` at one rank); the other kinds stay as they are and get no graph time.

Kinds: ``alltoall``, ``flex`` (Megatron's flex dispatcher with whatever ``deep_ep`` provides), ``flex_plugin``
(the same flex dispatcher after ``moe_ep_plugin.megatron.install()``), ``ep_plugin:<transport>[:fp8]`` with
transport ``torch`` / ``nvlink`` / ``auto``. The table gives each row's time over the first kind's at the same token
count.
Run: torchrun --nproc-per-node N benchmarks/mcore_dispatchers.py [--tokens 4096,128] [--kinds ...] [--record]
(``--record``: each plugin kind's correct timings as rows of benchmarks/results.jsonl, stock ``alltoall``'s).
Without CUDA it runs on CPU ranks (gloo) as a smoke check of the harness itself; those timings mean nothing.
"""

import argparse
import os
import time
import warnings

warnings.filterwarnings("ignore")
import records  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--tokens", default="4096,128", help="comma-separated token counts per rank")
p.add_argument("--hidden", type=int, default=7168)
p.add_argument("--experts", type=int, default=256)
p.add_argument("--topk", type=int, default=8)
p.add_argument("--iters", type=int, default=30)
p.add_argument("--num-sms", type=int, default=24, help="SMs for the communication kernels (plugin and DeepEP)")
p.add_argument("--kinds", default="alltoall,ep_plugin:torch,ep_plugin:nvlink,ep_plugin:nvlink:fp8,flex_plugin")
p.add_argument(
    "--pad-capacity",
    type=float,
    default=0.0,
    metavar="FACTOR",
    help="drop-and-pad (moe_pad_expert_input_to_capacity) at this moe_expert_capacity_factor; 0: dropless",
)
p.add_argument(
    "--recv-capacity-factor",
    type=float,
    default=0.0,
    metavar="FACTOR",
    help="ep_plugin kinds: dropless with this ep_plugin.recv_capacity_factor row budget; 0: the counted dispatch",
)
p.add_argument(
    "--cuda-graph",
    action="store_true",
    help="with --pad-capacity or --recv-capacity-factor on a GPU: also time the forward captured in a CUDA graph, "
    "replayed (every kind that reads nothing on the host)",
)
p.add_argument("--breakdown", action="store_true", help="also print each forward method's median time (GPU only)")
p.add_argument(
    "--trace",
    action="store_true",
    help="also print (rank 0) the host and GPU timeline of one forward: when each method ran on the host, "
    "and every GPU activity (GPU only)",
)
p.add_argument(
    "--profile-host",
    type=int,
    default=0,
    metavar="STEPS",
    help="also print (rank 0) a cProfile of STEPS forwards: the Python functions the host spends its "
    "time in, by own time and by cumulative time",
)
records.add_argument(p)


def cfg(kind):
    kw = dict(
        num_layers=1,
        hidden_size=a.hidden,
        num_attention_heads=8,
        num_moe_experts=a.experts,
        moe_router_topk=a.topk,
        expert_model_parallel_size=world,
        moe_router_dtype="fp32",
        bf16=True,
        params_dtype=torch.bfloat16,
        moe_aux_loss_coeff=0.0,
        moe_router_load_balancing_type="none",
        moe_token_dispatcher_type=kind.split(":")[0].replace("flex_plugin", "flex"),
    )
    if a.pad_capacity:
        kw.update(
            moe_expert_capacity_factor=a.pad_capacity,
            moe_pad_expert_input_to_capacity=True,
            moe_token_drop_policy="probs",
        )
    if kw["moe_token_dispatcher_type"] == "flex":
        kw["moe_flex_dispatcher_backend"] = "deepep"
        sms_field = (
            "moe_flex_dispatcher_num_sms"
            if hasattr(TransformerConfig, "moe_flex_dispatcher_num_sms")
            else "moe_deepep_num_sms"
        )  # 0.19 name, 0.16 name
        kw[sms_field] = a.num_sms
    return TransformerConfig(**kw)


def make_dispatcher(kind):
    """(dispatcher, whether rows travel in FP8) for one kind."""
    if kind == "alltoall":
        return MoEAlltoAllTokenDispatcher(L, local_idx, cfg(kind), pg_collection=pg), False
    if kind == "flex":
        return MoEFlexTokenDispatcher(L, local_idx, cfg(kind), pg_collection=pg), False
    if kind == "flex_plugin":
        ep_megatron.install(ep_megatron.PluginOptions(transport="auto"))
        return MoEFlexTokenDispatcher(L, local_idx, cfg(kind), pg_collection=pg), False
    name, transport, *flags = kind.split(":") + ["auto"] * (kind.count(":") == 0)
    if name != "ep_plugin" or any(f != "fp8" for f in flags):
        raise ValueError(f"unknown kind {kind!r}")
    budget = a.recv_capacity_factor or None
    options = ep_megatron.PluginOptions(
        transport=transport, fp8_dispatch="fp8" in flags, num_sms=a.num_sms, recv_capacity_factor=budget
    )
    return ep_megatron.EPPluginTokenDispatcher(L, local_idx, cfg(kind), pg, options=options), options.fp8_dispatch


def step(d, x, rmap, probs, backward):
    h, pr = d.dispatch_preprocess(x, rmap, probs)
    h, pr = d.token_dispatch(h, pr)
    h, tpe, pp = d.dispatch_postprocess(h, pr)
    h = h * pp.unsqueeze(-1).to(h.dtype)
    h = d.combine_preprocess(h)
    h = d.token_combine(h)
    out = d.combine_postprocess(h)
    if backward:
        out.backward(torch.ones_like(out))
    return out


PHASES = (
    "dispatch_preprocess",
    "token_dispatch",
    "dispatch_postprocess",
    "experts",
    "combine_preprocess",
    "token_combine",
    "combine_postprocess",
)


def phase_us(d, x, rmap, probs, iters):
    """Median microseconds of each forward method (CUDA events between the calls; host syncs inside a method
    count towards it, as they stall the stream that follows)."""
    samples = []
    for _ in range(iters):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(len(PHASES) + 1)]
        events[0].record()
        h, pr = d.dispatch_preprocess(x, rmap, probs)
        events[1].record()
        h, pr = d.token_dispatch(h, pr)
        events[2].record()
        h, tpe, pp = d.dispatch_postprocess(h, pr)
        events[3].record()
        h = h * pp.unsqueeze(-1).to(h.dtype)
        events[4].record()
        h = d.combine_preprocess(h)
        events[5].record()
        h = d.token_combine(h)
        events[6].record()
        d.combine_postprocess(h)
        events[7].record()
        torch.cuda.synchronize()
        samples.append([events[i].elapsed_time(events[i + 1]) * 1000 for i in range(len(PHASES))])
    return [sorted(col)[len(col) // 2] for col in zip(*samples, strict=False)]


def trace(d, x, rmap, probs, label):
    """Rank 0 prints one forward's timeline (after warm-up): each method's host span and every GPU activity, in
    microseconds from the start of the forward's first method. Collective: every rank runs the steps."""
    from torch.profiler import ProfilerActivity, profile, record_function

    def forward():
        calls = [
            ("dispatch_preprocess", lambda v: d.dispatch_preprocess(x, rmap, probs)),
            ("token_dispatch", lambda v: d.token_dispatch(*v)),
            ("dispatch_postprocess", lambda v: d.dispatch_postprocess(*v)),
            ("experts", lambda v: v[0] * v[2].unsqueeze(-1).to(v[0].dtype)),
            ("combine_preprocess", d.combine_preprocess),
            ("token_combine", d.token_combine),
            ("combine_postprocess", d.combine_postprocess),
        ]
        value = None
        for name, fn in calls:
            with record_function(f"phase:{name}"):
                value = fn(value)
        torch.cuda.synchronize()
        dist.barrier()

    for _ in range(5):
        forward()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        forward()
    if rank != 0:
        return
    events = [
        e for e in prof.events() if e.name.startswith("phase:") or e.device_type == torch.autograd.DeviceType.CUDA
    ]
    events = [
        e
        for e in events
        if "nccl" not in e.name.lower()
        or e.device_type != torch.autograd.DeviceType.CUDA
        or e.time_range.elapsed_us() < 1000
    ]  # leave out the barrier after the step
    t0 = min(e.time_range.start for e in events if e.name.startswith("phase:"))
    print(f"TRACE {label}: start us, duration us, host phase or GPU activity")
    for e in sorted(events, key=lambda e: e.time_range.start):
        where = "host" if e.name.startswith("phase:") else "gpu "
        print(f"TRACE {e.time_range.start - t0:9.1f} {e.time_range.elapsed_us():8.1f} {where} {e.name[:100]}")


def profile_host(d, x, rmap, probs, steps, label):
    """Rank 0 prints where the host spends ``steps`` forwards (cProfile; its own overhead inflates every Python call
    alike, so read shares, not absolute times). Collective: every rank runs the steps."""
    import cProfile
    import io
    import pstats

    for _ in range(5):
        step(d, x, rmap, probs, False)
    torch.cuda.synchronize()
    dist.barrier()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step(d, x, rmap, probs, False)
    torch.cuda.synchronize()
    prof.disable()
    if rank != 0:
        return
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(order).print_stats(35)
        print(f"PROFILE {label} ({steps} forwards) by {order}")
        lines = text.getvalue().splitlines()
        start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls")), 0)
        for line in lines[start:]:
            if line.strip():
                print(f"PROFILE {line.replace(os.getcwd() + '/', '').replace('/tmp/mcore/', '')[:180]}")


def run_us(fn):
    """Microseconds of one call: CUDA events on GPU, the host clock on CPU."""
    if not use_cuda:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) * 1000


def bench(fn, iters):
    for _ in range(5):
        fn()
    if use_cuda:
        torch.cuda.synchronize()
    dist.barrier()
    times = sorted(run_us(fn) for _ in range(iters))
    slowest = torch.tensor(times[len(times) // 2], device=dev)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest)


def graph_us(fn, iters):
    """Median microseconds of one replay of ``fn`` captured in a CUDA graph (slowest rank); warmed up on a side
    stream first, as capture requires."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench(graph.replay, iters)


def ratios(rows):
    """Each row plus its times (forward, forward+backward, and the graph replay's with ``--cuda-graph``) over the
    first kind's at its token count (empty where a row is missing)."""
    times = {(r[0], r[1]): r[2:-1] for r in rows if r[2] != "-"}
    first = a.kinds.split(",")[0]

    def over(key, base):
        if key not in times or base not in times:
            return ""
        return "/".join(
            f"{float(t) / float(b):.2f}" if t != "-" and b != "-" else "-"
            for t, b in zip(times[key], times[base], strict=False)
        )

    return [r + (over((r[0], r[1]), (first, r[1])),) for r in rows]


def kind_label(kind: str, world: int) -> str:
    """A plugin kind as results.jsonl names it: with the transport that serves it where the name does not say."""
    if kind == "flex_plugin":
        return "flex + this library"
    flags = kind.split(":")[2:]
    if world == 1:  # every transport serves a group of one rank with 'local'
        return "ep_plugin" + "".join(f":{f}" for f in flags) + " (local)"
    return f"{kind} (NCCL)" if kind.startswith("ep_plugin:torch") else kind


def graphed(kind: str) -> bool:
    """Whether ``--cuda-graph`` captures ``kind``: every kind with drop-and-pad; with the row budget only the
    ``ep_plugin`` kinds on the transports that read nothing on the host."""
    if a.pad_capacity:
        return True
    return kind.startswith("ep_plugin") and (world == 1 or kind.split(":")[1] == "nvlink")


def record_rows(
    timed: dict[tuple[str, int], dict[str, float]], world: int, pad_capacity: float, recv_capacity_factor: float = 0.0
) -> list[tuple[str, dict, float, float | None]]:
    """(benchmark, configuration, plugin µs, stock µs) per plugin kind, token count and phase of ``timed`` ((kind,
    tokens) -> phase -> µs, correct runs only); stock: ``alltoall``'s at the same tokens and phase, else None.
    ``recv_capacity_factor``: the ``ep_plugin`` kinds' row budget (0: none), named in their configuration."""
    benchmark = "mcore_drop_and_pad" if pad_capacity else "mcore_dispatchers"
    rows = []
    for (kind, tokens), phases in timed.items():
        if kind in ("alltoall", "flex"):  # Megatron's own dispatchers: stock, not plugin
            continue
        stock = timed.get(("alltoall", tokens), {})
        for phase, us in phases.items():
            drop = {"capacity factor": pad_capacity} if pad_capacity else {}
            if recv_capacity_factor and kind.startswith("ep_plugin"):
                drop["recv capacity factor"] = recv_capacity_factor
            config = {"ep": world, "tokens": tokens, "kind": kind_label(kind, world), **drop, "phase": phase}
            rows.append((benchmark, config, round(us, 1), round(stock[phase], 1) if phase in stock else None))
    return rows


if __name__ == "__main__":
    a = p.parse_args()
    if a.cuda_graph and not (a.pad_capacity or a.recv_capacity_factor):
        p.error(
            "--cuda-graph: needs --pad-capacity or --recv-capacity-factor (only those dispatch without a host read)"
        )
    if a.pad_capacity and a.recv_capacity_factor:
        p.error("--recv-capacity-factor: a dropless row budget; drop-and-pad (--pad-capacity) fixes every row itself")
    if a.record and not torch.cuda.is_available():
        p.error("--record: CPU timings are a smoke check of the harness, not results")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher, MoEFlexTokenDispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig

    import moe_ep_plugin.megatron as ep_megatron
    from moe_ep_plugin.ops import fp8

    pg = moe_utils.get_default_pg_collection()
    L = a.experts // world
    local_idx = list(range(rank * L, (rank + 1) * L))

    rows = []
    timed: dict[tuple[str, int], dict[str, float]] = {}  # the correct runs' times, for --record
    for tokens in (int(t) for t in a.tokens.split(",")):
        torch.manual_seed(1234 + rank)
        logits = torch.randn(tokens, a.experts, device=dev)
        bias = torch.randn(a.experts, device=dev) * 0.01
        probs, rmap = moe_utils.topk_routing_with_score_function(
            logits,
            a.topk,
            use_pre_softmax=True,
            num_groups=8,
            group_topk=4,
            scaling_factor=2.5,
            score_function="sigmoid",
            expert_bias=bias,
        )
        x0 = torch.randn(tokens, 1, a.hidden, device=dev, dtype=torch.bfloat16)
        if a.pad_capacity:
            probs, rmap = moe_utils.apply_router_token_dropping(
                probs, rmap, a.topk, a.pad_capacity, "probs", pad_to_capacity=True
            )
        for kind in a.kinds.split(","):
            try:
                disp, wire_fp8 = make_dispatcher(kind)
                xf = x0.clone()
                out = step(disp, xf, rmap, probs, False)
                seen = fp8.dequantize(*fp8.quantize(x0.view(tokens, -1))).view_as(x0) if wire_fp8 else x0
                ok = torch.allclose(out.float(), seen.float() * probs.sum(-1).view(-1, 1, 1), rtol=2e-2, atol=2e-2)
                ok_all = torch.tensor(int(ok), device=dev)
                dist.all_reduce(ok_all, op=dist.ReduceOp.MIN)
                fwd = bench(lambda: step(disp, xf, rmap, probs, False), a.iters)
                xg = x0.clone().requires_grad_(True)
                fb = bench(lambda: step(disp, xg, rmap, probs, True), a.iters)
                graph = (
                    [graph_us(lambda: step(disp, xf, rmap, probs, False), a.iters)]
                    if a.cuda_graph and graphed(kind)
                    else []
                )
                shown = [f"{g:.1f}" for g in graph] or ["-"] * a.cuda_graph
                rows.append((kind, tokens, f"{fwd:.1f}", f"{fb:.1f}", *shown, str(bool(ok_all.item()))))
                if ok_all.item():
                    timed[kind, tokens] = dict(zip(("fwd", "fwd+bwd", "graph fwd"), (fwd, fb, *graph), strict=False))
                if a.breakdown and use_cuda:
                    parts = phase_us(disp, xf, rmap, probs, a.iters)  # collective: every rank runs it
                    if rank == 0:
                        print(
                            f"PHASES mcore-{kind} tokens={tokens} "
                            + " ".join(f"{name}={us:.0f}us" for name, us in zip(PHASES, parts, strict=False)),
                            flush=True,
                        )
                if a.trace and use_cuda:
                    trace(disp, xf, rmap, probs, f"mcore-{kind} tokens={tokens}")
                if a.profile_host and use_cuda:
                    profile_host(disp, xf, rmap, probs, a.profile_host, f"mcore-{kind} tokens={tokens}")
                if rank == 0:
                    print(
                        f"RESULT mcore-{kind} EP{world} tokens={tokens} hidden={a.hidden} fwd_us={fwd:.1f} "
                        f"fwd_bwd_us={fb:.1f}{f' graph_fwd_us={graph[0]:.1f}' if graph else ''} "
                        f"correct={bool(ok_all.item())}",
                        flush=True,
                    )
            except Exception as ex:
                rows.append(
                    (kind, tokens, "-", "-", *["-"] * a.cuda_graph, f"FAILED {type(ex).__name__}: {str(ex)[:80]}")
                )
                if rank == 0:
                    import traceback

                    traceback.print_exc()
                    print(f"RESULT mcore-{kind} tokens={tokens} FAILED {type(ex).__name__}: {ex}", flush=True)
            dist.barrier()
    if rank == 0:
        header = (
            "kind",
            "tokens",
            "fwd us",
            "fwd+bwd us",
            *["graph fwd us"] * a.cuda_graph,
            "correct",
            f"/ {a.kinds.split(',')[0]}",
        )
        rows = ratios(rows)
        widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
        pad = f", drop-and-pad at capacity factor {a.pad_capacity}" if a.pad_capacity else ""
        if a.recv_capacity_factor:
            pad = f", ep_plugin dropless with row budget {a.recv_capacity_factor}"
        print(
            f"\nMegatron-Core {__import__('megatron.core').core.__version__} dispatchers, EP{world}, "
            f"hidden {a.hidden}, top-{a.topk} of {a.experts}{pad}, identity experts, median of {a.iters} (slowest rank)"
        )
        for r in [header] + rows:
            print(" | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=False)))
        if a.record:
            device = records.machine(world)
            for benchmark, config, plugin, stock in record_rows(timed, world, a.pad_capacity, a.recv_capacity_factor):
                records.record(a, benchmark, config, plugin, stock, "µs", device=device)
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()
