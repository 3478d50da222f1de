"""``deep_ep.utils.envs`` for DeepEP's own test files run against this library with their ranks sharing one GPU
(``deepep_own/deep_ep`` registers it): what their ``init_dist`` sets up — one process per rank, BF16 and CUDA as
the default dtype and device, seeds derived from one global seed — over gloo with a file rendezvous at
``MOE_EP_DEEPEP_RENDEZVOUS`` (no port to race for) and every rank on ``cuda:0``, where DeepEP starts NCCL, which
refuses two ranks on one GPU. The library's Buffer then runs its ``nvlink`` kernels between the ranks (MPS lets
their kernels run side by side). Two of the collectives DeepEP's tests and references call take on gloo what they
take on NCCL (``nccl_like_collectives``)."""

from __future__ import annotations

import datetime
import math
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


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous, at least 1-D) viewed as ``[rows, bytes per row]`` uint8: gloo moves any dtype so."""
    return t.view(t.shape[0], math.prod(t.shape[1:])).view(torch.uint8)


def nccl_like_collectives() -> None:
    """Makes ``dist.all_gather_into_tensor`` and ``dist.all_to_all_single`` take on gloo what they take on NCCL:
    an output stacked as ``[ranks, *input.shape]`` (gloo wants ``[ranks * rows, ...]``) and any dtype (gloo
    knows a fixed set, FP8 not in it): the rows travel as their bytes."""
    gather, all_to_all = dist.all_gather_into_tensor, dist.all_to_all_single
    if getattr(gather, "_nccl_like", False):
        return

    def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
        if input.dim() == 0 or not output.is_contiguous():
            return gather(output, input, group=group, async_op=async_op)
        rows = output.view(-1, *input.shape[1:])
        return gather(_as_bytes(rows), _as_bytes(input.contiguous()), group=group, async_op=async_op)

    def all_to_all_single(
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes=None,
        input_split_sizes=None,
        group=None,
        async_op: bool = False,
    ):
        if input.dim() == 0:
            return all_to_all(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
        out = output if output.is_contiguous() else torch.empty_like(output, memory_format=torch.contiguous_format)
        work = all_to_all(
            _as_bytes(out),
            _as_bytes(input.contiguous()),
            output_split_sizes,
            input_split_sizes,
            group=group,
            async_op=async_op,
        )
        if out is not output:
            if work is not None:
                work.wait()
            output.copy_(out)
        return work

    all_gather_into_tensor._nccl_like = True
    dist.all_gather_into_tensor, dist.all_to_all_single = all_gather_into_tensor, all_to_all_single


def init_dist(local_rank: int, num_local_ranks: int, seed: int = 0) -> tuple[int, int, dist.ProcessGroup]:
    """Joins rank ``local_rank`` of ``num_local_ranks`` (one node) → ``(rank, world size, the group of all)``."""
    _local_rank[:] = [local_rank]
    dist.init_process_group(
        "gloo",
        init_method="file://" + os.environ["MOE_EP_DEEPEP_RENDEZVOUS"],
        world_size=num_local_ranks,
        rank=local_rank,
        timeout=datetime.timedelta(seconds=float(os.environ.get("MOE_EP_DEEPEP_TIMEOUT_S", 300))),
    )
    nccl_like_collectives()
    torch.cuda.set_device(0)
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device("cuda")
    init_seed(seed)
    return dist.get_rank(), dist.get_world_size(), dist.new_group(list(range(num_local_ranks)))
