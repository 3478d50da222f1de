"""``deep_ep.utils.envs`` for DeepEP's own test files run against this library with their ranks sharing one GPU
(``deepep_own/deep_ep`` registers it): what their ``init_dist`` sets up — one process per rank, BF16 and CUDA as
the default dtype and device, seeds derived from one global seed — over gloo with a file rendezvous at
``MOE_EP_DEEPEP_RENDEZVOUS`` (no port to race for) and every rank on ``cuda:0``, where DeepEP starts NCCL, which
refuses two ranks on one GPU. The library's Buffer then runs its ``nvlink`` kernels between the ranks (MPS lets
their kernels run side by side)."""
from __future__ import annotations

import datetime
import os
import random

import torch
import torch.distributed as dist

_seeds = {"local": 0, "global": 0}
_local_rank: list[int] = []


def init_seed(global_seed: int) -> None:
    """Seeds torch and ``random`` with ``global_seed`` plus this rank."""
    _seeds["global"], _seeds["local"] = global_seed, global_seed + dist.get_rank()
    torch.manual_seed(_seeds["local"])
    random.seed(_seeds["local"])


def get_local_seed() -> int:
    return _seeds["local"]


def get_global_seed() -> int:
    return _seeds["global"]


def dist_print(s: str = "", once_in_node: bool = False) -> None:
    """Prints ``s`` (on local rank 0 only with ``once_in_node``), then waits for every rank."""
    if not once_in_node or _local_rank[0] == 0:
        print(s, flush=True)
    dist.barrier()


def init_dist(local_rank: int, num_local_ranks: int, seed: int = 0) -> tuple[int, int, dist.ProcessGroup]:
    """Joins rank ``local_rank`` of ``num_local_ranks`` (one node) → ``(rank, world size, the group of all)``."""
    _local_rank[:] = [local_rank]
    dist.init_process_group("gloo", init_method="file://" + os.environ["MOE_EP_DEEPEP_RENDEZVOUS"],
                            world_size=num_local_ranks, rank=local_rank,
                            timeout=datetime.timedelta(seconds=float(os.environ.get("MOE_EP_DEEPEP_TIMEOUT_S", 300))))
    torch.cuda.set_device(0)
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device("cuda")
    init_seed(seed)
    return dist.get_rank(), dist.get_world_size(), dist.new_group(list(range(num_local_ranks)))
