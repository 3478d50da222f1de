"""Where the host time of one fresh dispatch + combine goes (cProfile on rank 0), per transport.

Run: torchrun --nproc-per-node 2 benchmarks/profile_dispatch.py [--tokens 128] [--transport torch] [--op dispatch]
``--op experts`` (default): ``dispatch_experts`` + ``combine_experts``; ``--op dispatch``: ``dispatch`` (the layout
computed inside) + ``combine``.
Prints the functions with the most cumulative time over ``--iters`` calls (after warm-up), with a CUDA sync
after each call so device waits show up inside the call that caused them.
"""

import argparse
import cProfile
import os
import pstats

import torch
import torch.distributed as dist
from standard_shape import add_shape_arguments

from moe_ep_plugin import Buffer, gating

p = argparse.ArgumentParser()
add_shape_arguments(p, tokens=128)
p.add_argument("--iters", type=int, default=50)
p.add_argument("--transport", default="torch")
p.add_argument("--op", choices=("experts", "dispatch"), default="experts")
a = p.parse_args()
rank = int(os.environ["RANK"])
dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
torch.cuda.set_device(dev)
dist.init_process_group("nccl", device_id=dev)
buffer = Buffer(dist.group.WORLD, transport=a.transport)
logits = torch.randn(a.tokens, a.experts, device=dev)
weights, idx = gating.group_limited_topk(logits, a.topk, score_function="sigmoid", num_groups=8, group_topk=4)
x = torch.randn(a.tokens, a.hidden, device=dev).to(torch.bfloat16)


def step() -> None:
    if a.op == "experts":
        ex, _, _, _, handle, _ = buffer.dispatch_experts(
            x, topk_idx=idx, topk_weights=weights.float(), num_experts=a.experts
        )
        buffer.combine_experts(ex, handle)
    else:
        recv, _, _, _, handle, _ = buffer.dispatch(x, topk_idx=idx, topk_weights=weights.float(), num_experts=a.experts)
        buffer.combine(recv, handle)
    torch.cuda.synchronize()


for _ in range(10):
    step()
dist.barrier()
profiler = cProfile.Profile()
profiler.enable()
for _ in range(a.iters):
    step()
profiler.disable()
if rank == 0:
    print(f"{a.transport}, {a.tokens} tokens x {a.hidden}, {a.iters} fresh {a.op} + combine")
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
dist.barrier()
dist.destroy_process_group()
