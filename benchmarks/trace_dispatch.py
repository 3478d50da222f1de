"""Timeline of one fresh (uncached) dispatch + combine on the GPU: what runs on which stream, when, and for how long.

Run: torchrun --nproc-per-node 2 benchmarks/trace_dispatch.py [--op dispatch|experts] [--set dispatch_pull=0 ...]
Rank 0 prints the median host time of the dispatch call over ``--iters`` calls (after warm-up), then, for the
last of three more calls under the profiler, every GPU activity (kernel, copy, memset) with its start relative to
the call's first GPU activity, its duration and its stream (the barrier after the call included); with
``--trace PATH`` it also writes the Chrome trace (open in chrome://tracing or Perfetto). ``--set`` changes an
``NVLinkTuning`` field of every call's Config (as in ``bench_dispatch_combine.py --variants``).
"""

import argparse
import dataclasses
import os
import time

import torch
import torch.distributed as dist
from bench_dispatch_combine import tuning_settings
from standard_shape import add_shape_arguments
from torch.profiler import ProfilerActivity, profile

from moe_ep_plugin import Buffer, gating
from moe_ep_plugin.config import NVLinkTuning

p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
add_shape_arguments(p)
p.add_argument("--sms", type=int, default=24)
p.add_argument("--iters", type=int, default=5)
p.add_argument("--op", choices=("dispatch", "experts"), default="dispatch")
p.add_argument("--fp8", action="store_true", help="FP8 dispatch (quantized in the send path, received as FP8)")
p.add_argument("--set", action="append", default=[], help="NAME=INT: an NVLinkTuning field for every call")
p.add_argument("--trace", default="")
a = p.parse_args()
rank = int(os.environ["RANK"])
dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
torch.cuda.set_device(dev)
dist.init_process_group("nccl", device_id=dev)
Buffer.set_num_sms(a.sms)
buffer = Buffer(dist.group.WORLD, transport="nvlink")
tuning = NVLinkTuning(**tuning_settings(a.set, "--set"))
dcfg = dataclasses.replace(Buffer.get_dispatch_config(dist.get_world_size()), nvlink=tuning)
ccfg = dataclasses.replace(Buffer.get_combine_config(dist.get_world_size()), nvlink=tuning)
torch.manual_seed(1 + rank)
logits = torch.randn(a.tokens, a.experts, device=dev)
weights, idx = gating.group_limited_topk(logits, a.topk, score_function="sigmoid", num_groups=8, group_topk=4)
weights = weights.float()
x = torch.randn(a.tokens, a.hidden, device=dev).to(torch.bfloat16)


def step() -> float:
    """One fresh dispatch and its combine; returns the host seconds of the dispatch call."""
    start = time.perf_counter()
    if a.op == "experts":
        out, _, _, _, handle, _ = buffer.dispatch_experts(
            x, topk_idx=idx, topk_weights=weights, num_experts=a.experts, fp8_dispatch=a.fp8, config=dcfg
        )
        host = time.perf_counter() - start
        rows = handle.expert_layout.num_rows
        buffer.combine_experts(torch.ones(rows, a.hidden, dtype=torch.bfloat16, device=dev), handle, config=ccfg)
    else:
        recv, _, _, _, handle, _ = buffer.dispatch(
            x, topk_idx=idx, topk_weights=weights, num_experts=a.experts, fp8_dispatch=a.fp8, fp8_out=a.fp8, config=dcfg
        )
        host = time.perf_counter() - start
        buffer.combine(
            torch.ones(handle.num_recv_rows, a.hidden, dtype=torch.bfloat16, device=dev), handle, config=ccfg
        )
    torch.cuda.synchronize()
    dist.barrier()
    return host


for _ in range(5):
    step()
hosts = [step() for _ in range(a.iters)]
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(3):  # the first profiled call also carries the profiler's start-up skew between ranks
        step()
if rank == 0:
    gpu = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.start
    )
    # Each call ends with the barrier's all-reduce kernel: the last call is what follows the one before it.
    ends = [i for i, e in enumerate(gpu) if e.name.startswith("ncclDevKernel_AllReduce")]
    last = gpu[ends[-2] + 1 :] if len(ends) >= 2 else gpu
    t0 = last[0].time_range.start if last else 0
    what = ", ".join(f"{n}={v}" for n, v in a.set) or "defaults"
    print(
        f"{a.op}{' fp8' if a.fp8 else ''}, {a.tokens} x {a.hidden}, {a.sms} SMs, {what}: host time of the dispatch "
        f"call {1e6 * sorted(hosts)[len(hosts) // 2]:.0f} us (median of {a.iters}, without the profiler)"
    )
    print(f"{'start us':>9} {'dur us':>8} {'stream':>7}  activity")
    for e in last:
        stream = getattr(e, "stream", None) or getattr(e, "device_resource_id", "")
        print(f"{e.time_range.start - t0:>9.1f} {e.time_range.elapsed_us():>8.1f} {str(stream):>7}  {e.name[:90]}")
    if a.trace:
        prof.export_chrome_trace(a.trace)
dist.barrier()
buffer.destroy()
dist.destroy_process_group()
