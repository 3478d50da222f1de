"""Host (Python/CPU) time per call of each layer of the Megatron dispatcher path, on CPU.

Run from the repository root: PYTHONPATH=. python3 benchmarks/host_overhead.py [--tokens 128 --hidden 256
--experts 16 --topk 4 --iters 2000 --repeats 3] [--columns local stand-in] [--profile]

One process, a gloo group of world size 1, a tiny BF16 shape. Two transports under the same ``Buffer``:

- ``local``: the one-rank transport doing its real work on CPU (torch-op layout, expert-major permute, local
  copies, no communication).
- ``stand-in``: answers every call with the ``local`` transport's results recorded once (and, like it, derives the
  layout from top-k itself), so what is timed is the layers above the transport alone: ``Buffer``
  validation/streams/config, the autograd functions, the Megatron-Core dispatcher's six methods.

Each row is ``time.perf_counter`` over ``--iters`` calls after warm-up (best of ``--repeats``), µs per call,
cumulative (a row includes the layers below it). ``token_dispatch`` runs the torch-op form of the routing-map
conversion (one CUDA kernel on GPU), and the whole-dispatcher rows include the harness's CPU math (experts =
``rows * probs``, ``autograd.grad``). ``--profile`` adds cProfile's top cumulative entries of the dispatcher
forward + backward on the last column.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from collections.abc import Callable

import records
import torch
import torch.distributed as dist
from standard_shape import add_shape_arguments

from moe_ep_plugin import Buffer
from moe_ep_plugin import autograd as ep_autograd
from moe_ep_plugin.buffer_cache import get_buffer
from moe_ep_plugin.config import Config
from moe_ep_plugin.handle import DispatchHandle
from moe_ep_plugin.ops.routing import routing_map_to_topk
from moe_ep_plugin.transports.base import DispatchArgs, ExpertDispatchResult, Transport

Timed = list[tuple[str, Callable[[], object]]]
COLUMNS = ("local", "stand-in")


class StandInTransport(Transport):
    """Replays ``dispatch_experts``/``combine_experts`` results recorded from a real transport; no work at all."""

    name = "stand-in"
    expert_layout_from_topk = True  # as nvlink: the Buffer computes no layout first

    def __init__(
        self,
        real: Transport,
        fresh: ExpertDispatchResult,
        cached: ExpertDispatchResult,
        combined: tuple[torch.Tensor, None],
        combined_weights: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        super().__init__(real.group, real.device, real.timeout_s)
        self._fresh, self._cached = fresh, cached
        self._combined, self._combined_weights = combined, combined_weights

    def dispatch(self, args: DispatchArgs):
        raise NotImplementedError("the stand-in replays expert-major calls only")

    def combine(
        self,
        x: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: torch.Tensor | None,
        bias: tuple[torch.Tensor, ...],
        config: Config,
    ):
        raise NotImplementedError("the stand-in replays expert-major calls only")

    def dispatch_experts(self, args: DispatchArgs, alignment: int) -> ExpertDispatchResult:
        return self._fresh if args.handle is None else self._cached

    def combine_experts(
        self,
        y: torch.Tensor,
        handle: DispatchHandle,
        expert_weights: torch.Tensor | None,
        bias: tuple[torch.Tensor, ...],
        config: Config,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._combined if expert_weights is None else self._combined_weights


def per_call_us(fn: Callable[[], object], iters: int, repeats: int) -> float:
    """Best over ``repeats`` of the mean wall time of ``iters`` calls, in µs (after ``iters // 10`` warm-up calls)."""
    for _ in range(max(1, iters // 10)):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - start) / iters)
    return best * 1e6


def routing(tokens: int, experts: int, topk: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_idx [T, K] int64, probs [T, E] float32 zero off the map)``: distinct random experts per token."""
    idx = torch.rand(tokens, experts, generator=gen).topk(topk, dim=1).indices
    probs = torch.zeros(tokens, experts).scatter_(1, idx, torch.rand(tokens, topk, generator=gen) + 0.1)
    return idx, probs


def buffer_rows(buffer: Buffer, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, experts: int) -> Timed:
    """The Buffer's and the autograd functions' calls of one forward + backward, each on its own."""
    ex, _, probs, _, handle, _ = buffer.dispatch_experts(x, idx, w, experts)
    y = ex.clone()
    grad_probs = torch.ones_like(probs)
    xg, wg, yg = (t.clone().requires_grad_(True) for t in (x, w, y))
    grad_out = torch.ones_like(x)

    def autograd_step() -> object:  # both backward paths, no other ops: the rows' and the probs' gradients given
        e, p, _, h = ep_autograd.dispatch_experts(buffer, xg, idx, wg, experts)
        return torch.autograd.grad((ep_autograd.combine_experts(buffer, e, h), p), (xg, wg), (grad_out, grad_probs))

    return [
        ("Buffer.dispatch_experts (fresh)", lambda: buffer.dispatch_experts(x, idx, w, experts)),
        ("Buffer.combine_experts", lambda: buffer.combine_experts(y, handle)),
        ("Buffer.dispatch_experts (cached, bwd)", lambda: buffer.dispatch_experts(x, handle=handle)),
        ("Buffer.combine_experts (+weights, bwd)", lambda: buffer.combine_experts(y, handle, grad_probs)),
        ("autograd.dispatch_experts fwd", lambda: ep_autograd.dispatch_experts(buffer, xg, idx, wg, experts)),
        ("autograd.combine_experts fwd", lambda: ep_autograd.combine_experts(buffer, yg, handle)),
        ("autograd dispatch + combine, fwd + bwd", autograd_step),
    ]


def stand_in(buffer: Buffer, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, experts: int) -> StandInTransport:
    """A stand-in for ``buffer``'s transport, recorded from one real call of each kind at these inputs."""
    ex, scales, probs, _, handle, _ = buffer.dispatch_experts(x, idx, w, experts)
    cached = buffer.dispatch_experts(x, handle=handle)
    return StandInTransport(
        buffer.transport,
        ExpertDispatchResult(ex, scales, probs, handle),
        ExpertDispatchResult(cached[0], cached[1], None, handle),
        buffer.combine_experts(ex, handle)[:2],
        buffer.combine_experts(ex, handle, probs)[:2],
    )


class MegatronCase:
    """One ``EPPluginTokenDispatcher`` (all experts local) and the state between its methods, so each method can
    be timed on its own with the inputs its predecessor leaves (with autograd recording, as in training)."""

    def __init__(self, args: argparse.Namespace, x: torch.Tensor, gen: torch.Generator) -> None:
        from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
        from megatron.core.transformer.transformer_config import TransformerConfig

        from moe_ep_plugin.megatron import EPPluginTokenDispatcher, PluginOptions

        config = TransformerConfig(
            num_layers=1,
            hidden_size=args.hidden,
            num_attention_heads=2,
            num_moe_experts=args.experts,
            moe_router_topk=args.topk,
            use_cpu_initialization=True,
            moe_token_dispatcher_type="ep_plugin",
        )
        self.d = EPPluginTokenDispatcher(
            args.experts,
            list(range(args.experts)),
            config,
            get_default_pg_collection(),
            options=PluginOptions(transport="torch"),
        )
        _, probs = routing(args.tokens, args.experts, args.topk, gen)
        self.topk = args.topk
        self.routing_map = probs > 0
        self.tokens = x.view(args.tokens, 1, args.hidden).clone().requires_grad_(True)
        self.probs = probs.requires_grad_(True)
        self.grad_out = torch.ones_like(self.tokens)
        self.record()

    def record(self) -> None:
        """Run the methods once and keep what each one hands to the next."""
        d = self.d
        self.h, self.w = d.dispatch_preprocess(self.tokens, self.routing_map, self.probs)
        # what token_dispatch derives from the map: the stand-in transports are recorded from it
        self.topk_idx, self.topk_weights = routing_map_to_topk(self.routing_map, self.probs.detach(), self.topk)
        self.rows, self.rows_probs = d.token_dispatch(self.h, self.w)
        self.tokens_per_expert, self.handle, self.buffer = list(d._tokens_per_expert), d._handle, d._buffer
        d.dispatch_postprocess(self.rows, self.rows_probs)
        self.combined = d.token_combine(self.rows)
        d.combine_postprocess(self.combined)

    def forward(self) -> torch.Tensor:
        d = self.d
        h, w = d.dispatch_preprocess(self.tokens, self.routing_map, self.probs)
        h, w = d.token_dispatch(h, w)
        h, _, w = d.dispatch_postprocess(h, w)
        h = d.combine_preprocess(h * w.unsqueeze(1).to(h.dtype))  # the experts: identity times probs
        return d.combine_postprocess(d.token_combine(h))

    def step(self) -> object:
        out = self.forward()
        return torch.autograd.grad(out, (self.tokens, self.probs), self.grad_out)

    def timed_calls(self) -> Timed:
        d = self.d

        def preprocess() -> object:
            out = d.dispatch_preprocess(self.tokens, self.routing_map, self.probs)
            d._routing_map = None
            return out

        def token_dispatch() -> object:
            d._routing_map = self.routing_map
            out = d.token_dispatch(self.h, self.w)
            d._tokens_per_expert = d._handle = d._buffer = None
            return out

        def postprocess() -> object:
            d._tokens_per_expert = self.tokens_per_expert
            return d.dispatch_postprocess(self.rows, self.rows_probs)

        def token_combine() -> object:
            d._handle, d._buffer = self.handle, self.buffer
            out = d.token_combine(self.rows)
            d._buffer = None
            return out

        def combine_postprocess() -> object:
            d._buffer = self.buffer
            return d.combine_postprocess(self.combined)

        return [
            ("dispatcher.dispatch_preprocess", preprocess),
            ("dispatcher.token_dispatch", token_dispatch),
            ("dispatcher.dispatch_postprocess", postprocess),
            ("dispatcher.combine_preprocess", lambda: d.combine_preprocess(self.rows)),
            ("dispatcher.token_combine", token_combine),
            ("dispatcher.combine_postprocess", combine_postprocess),
            ("dispatcher forward (6 methods, x probs)", self.forward),
            ("dispatcher forward + backward", self.step),
        ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_arguments(p, tokens=128, hidden=256, experts=16, topk=4)
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--columns", nargs="+", choices=COLUMNS, default=list(COLUMNS), help="transports to time")
    p.add_argument("--profile", action="store_true", help="cProfile the dispatcher forward + backward")
    records.add_argument(p)
    args = p.parse_args()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())  # one process: no port
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, generator=gen).to(torch.bfloat16)
    idx, probs = routing(args.tokens, args.experts, args.topk, gen)
    w = probs.gather(1, idx)
    buffer = get_buffer(dist.group.WORLD, args.hidden * 2, "torch")
    megatron: MegatronCase | None = None
    try:
        from megatron.core import parallel_state as ps

        ps.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
        megatron = MegatronCase(args, x, gen)
    except ImportError as exc:
        print(f"(megatron-core not importable, dispatcher rows skipped: {exc})")

    columns = [label for label in COLUMNS if label in args.columns]  # in this order: each replaces the last
    results: dict[str, list[float]] = {}
    for label in columns:
        if label == "stand-in":  # recorded from the torch transport, still the buffers' own
            buffer.transport = stand_in(buffer, x, idx, w, args.experts)
            if megatron is not None:
                b = megatron.buffer
                b.transport = stand_in(b, megatron.h.detach(), megatron.topk_idx, megatron.topk_weights, args.experts)
        if megatron is not None and label != "local":  # handles of this column's transport
            megatron.record()
        rows = buffer_rows(buffer, x, idx, w, args.experts) + (megatron.timed_calls() if megatron is not None else [])
        for name, fn in rows:
            results.setdefault(name, []).append(per_call_us(fn, args.iters, args.repeats))

    print(
        f"host time per call, µs (CPU, gloo world 1, {args.tokens} tokens x {args.hidden} BF16, "
        f"{args.experts} experts, top-{args.topk}, best of {args.repeats} x {args.iters} calls, "
        f"torch {torch.__version__})"
    )
    print(f"| {'layer (cumulative: includes the layers below)':<46} |" + "".join(f" {label:>8} |" for label in columns))
    print(f"|{'-' * 48}|" + f"{'-' * 9}:|" * len(columns))
    for name, times in results.items():
        print(f"| {name:<46} |" + "".join(f" {t:8.1f} |" if t == t else f" {'-':>8} |" for t in times))
        for label, t in zip(columns, times, strict=True):
            if t == t:  # a layer a column has no row for is NaN
                config = dict(
                    layer=name,
                    column=label,
                    tokens=args.tokens,
                    hidden=args.hidden,
                    experts=args.experts,
                    topk=args.topk,
                )
                records.record(args, "host_overhead", config, round(t, 1), None, "µs", device="cpu")

    if args.profile and megatron is not None:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.iters):
            megatron.step()
        profiler.disable()
        print(f"\ncProfile, dispatcher forward + backward on {columns[-1]}, {args.iters} steps:")
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
