"""Host time of a fresh nvlink dispatch (no handle), split: from the call to the dispatch kernel's launch, and
where the host then waits for the counts.

    python3 benchmarks/fresh_dispatch_host.py --ranks 2    # ranks sharing GPU 0 (an MPS daemon running)

A fresh dispatch launches notify (barrier + count exchange), allocates receive tensors of the most rows any rank
received so far, launches the dispatch kernel into them and only then waits for notify's counts (one
device-to-host copy on a side stream), trimming the outputs to the rows received. So the span that holds the GPU
back is the call to the dispatch kernel's launch; the count read overlaps the kernel. Each phase is
``time.perf_counter_ns`` around the runtime's own calls (wrapped on the instance; a probe, not a mode), with the GPU
idle and the ranks started together before every call; median of ``--calls`` calls, the slowest rank's. The cached
dispatch's call-to-launch on the same inputs is printed beside: what a fresh call costs the host beyond it.
``--record`` appends the rows (benchmarks/records.py); ``--profile`` prints torch.profiler's CPU table of ten fresh
BF16 calls (which ops, how many, their host time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

import records  # noqa: E402
from sm_sweep import route  # noqa: E402

from moe_ep_plugin import Buffer  # noqa: E402
from moe_ep_plugin.launch import spawn  # noqa: E402
from moe_ep_plugin.transports.nvlink import transport as nvlink_transport  # noqa: E402

PHASES = (
    ("call to notify launched", "call", "notify"),
    ("notify launched to dispatch kernel launched", "notify", "kernel"),
    ("  of which receive allocation", "alloc0", "alloc1"),
    ("call to dispatch kernel launched", "call", "kernel"),
    ("waiting for the counts (GPU notify + read)", "wait0", "wait1"),
    ("call to return", "call", "end"),
)
FORMS = {"bf16": {}, "fp8, quantized in send path": dict(fp8_dispatch=True, fp8_out=True)}


class Probe:
    """Timestamps (ns) of one call's phases, from wrappers around the runtime's methods and the receive allocation."""

    def __init__(self, nv: Buffer) -> None:
        self.t: dict[str, int] = {}
        rt = nv.transport._rt
        self._wrap(rt, "notify_dispatch", "notify")
        self._wrap(rt, "dispatch", "kernel", first=True)
        read = rt.start_read

        def start_read(*args):
            wait = read(*args)

            def timed_wait():
                self.t["wait0"] = time.perf_counter_ns()
                values = wait()
                self.t["wait1"] = time.perf_counter_ns()
                return values

            return timed_wait

        rt.start_read = start_read
        alloc = nvlink_transport._recv_tensors

        def recv_tensors(*args):
            self.t.setdefault("alloc0", time.perf_counter_ns())
            out = alloc(*args)
            self.t.setdefault("alloc1", time.perf_counter_ns())
            return out

        nvlink_transport._recv_tensors = recv_tensors

    def _wrap(self, obj: object, name: str, after: str, first: bool = False) -> None:
        """``obj.name`` wrapped to stamp ``after`` when it returns (``first``: only its first return per call)."""
        fn = getattr(obj, name)

        def wrapped(*args):
            out = fn(*args)
            if not first or after not in self.t:  # a dispatch again after a short guess: its first launch
                self.t[after] = time.perf_counter_ns()
            return out

        setattr(obj, name, wrapped)

    def span(self, call: Callable[[], object]) -> dict[str, int]:
        self.t = {"call": time.perf_counter_ns()}
        call()
        self.t["end"] = time.perf_counter_ns()
        return self.t


def _calls(probe: Probe, call: Callable[[], object], n: int, group: dist.ProcessGroup) -> list[dict[str, int]]:
    spans = []
    for i in range(n + 5):
        torch.cuda.synchronize()
        dist.barrier(group=group)
        t = probe.span(call)
        if i >= 5:
            spans.append(t)
    torch.cuda.synchronize()
    return spans


def _median(spans: list[dict[str, int]], a: str, b: str) -> float:
    return statistics.median((t[b] - t[a]) / 1e3 for t in spans if a in t and b in t)


def _run(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    nv = Buffer(dist.group.WORLD, transport="nvlink", device=device)
    probe = Probe(nv)
    rows = []
    for tokens in args.tokens:
        idx = route(tokens, world, args.seed * 1000 + rank).to(device)
        x = torch.randn(tokens, args.hidden, device=device).to(torch.bfloat16)
        for form, opts in FORMS.items():
            *_, handle, _ = nv.dispatch(x, topk_idx=idx, num_experts=256, **opts)  # the guess grows to fit
            fresh = _calls(
                probe, lambda o=opts: nv.dispatch(x, topk_idx=idx, num_experts=256, **o), args.calls, dist.group.WORLD
            )
            cached = _calls(probe, lambda o=opts, h=handle: nv.dispatch(x, handle=h, **o), args.calls, dist.group.WORLD)
            for name, a, b in PHASES:
                rows.append((tokens, form, name, _median(fresh, a, b)))
            rows.append((tokens, form, "cached: call to dispatch kernel launched", _median(cached, "call", "kernel")))
    if args.profile:  # where the host time before the launch goes: torch ops and the library's calls, by count
        x = torch.randn(args.tokens[0], args.hidden, device=device).to(torch.bfloat16)
        idx = route(args.tokens[0], world, args.seed * 1000 + rank).to(device)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            _calls(probe, lambda: nv.dispatch(x, topk_idx=idx, num_experts=256), 10, dist.group.WORLD)
        if rank == 0:
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    gathered: list = [None] * world
    dist.all_gather_object(gathered, rows, group=dist.group.WORLD)
    if rank == 0:
        print(
            f"\nFresh nvlink dispatch, host time (µs, median of {args.calls} calls, the slowest of {world} ranks "
            f"sharing {torch.cuda.get_device_name(device)}); hidden {args.hidden}, top-8 of 256 group-limited"
        )
        print("| tokens | form | phase | µs |\n|---:|---|---|---:|")
        for i, (tokens, form, name, _) in enumerate(rows):
            us = max(g[i][3] for g in gathered)
            print(f"| {tokens} | {form} | {name} | {us:.1f} |")
            config = dict(layout="shared GPU", ranks=world, tokens=tokens, form=form, phase=name.strip())
            records.record(args, "fresh_dispatch_host", config, round(us, 1), None, "µs", device=records.machine(1))
    nv.destroy()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="ranks sharing GPU 0")
    p.add_argument("--tokens", type=lambda s: [int(v) for v in s.split(",")], default=[4096, 128])
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--profile", action="store_true", help="torch.profiler's CPU table of 10 fresh BF16 calls")
    records.add_argument(p)
    args = p.parse_args()
    if torch.cuda.device_count() < 1:
        raise SystemExit("fresh_dispatch_host: needs a CUDA GPU")
    spawn(_run, args.ranks, args=(args,), backend="gloo", timeout_s=300.0)


if __name__ == "__main__":
    main()
