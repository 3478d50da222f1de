"""``deep_ep.utils.envs`` for DeepEP's own test files run against this library on the CPU
(tests/test_deepep_own_tests_cpu.py; ``deepep_own/deep_ep`` registers it when ``MOE_EP_DEEPEP_CPU=1``): the rank
start-up of ``deepep_envs.py`` (its seeds, ``dist_print`` and NCCL-like collectives, imported) with every rank on
the CPU, and the few stand-ins for CUDA the files need where there is none:

- ``install()``: ``torch.cuda.synchronize`` a no-op (the files call it between steps; CPU work is done when its
  call returns) and DeepEP's ``torch.compile`` helpers (``math.py``) eager, as Inductor would build C++ per rank;
- ``CudaToCpu``: the files place every tensor they make with ``device='cuda'``; this mode makes that the CPU;
- ``shrink_testing()``: their timing helpers sized for the CPU (``bench``) or answered without a run
  (``bench_kineto``, whose per-kernel CUDA profile has no CPU counterpart). Only the perf parts call them.

``torch.cuda.is_available()`` stays ``False``, so the library takes its CPU paths (gloo between the ranks)."""

from __future__ import annotations

import datetime
import os
import time
from types import ModuleType

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from support import deepep_envs
from support.deepep_envs import dist_print, get_global_seed, init_seed, nccl_like_collectives

# what DeepEP's files and refs.py import from ``deep_ep.utils.envs``, and what ``deepep_own/deep_ep`` calls
__all__ = ["dist_print", "get_global_seed", "init_dist", "init_seed", "install", "shrink_testing"]


class CudaToCpu(TorchFunctionMode):
    """Turns a ``device`` argument naming CUDA into the CPU, for every torch call made while it is entered."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = dict(kwargs, device="cpu")
        return func(*args, **kwargs)


def install() -> None:
    """The CUDA stand-ins every process needs before DeepEP's utilities load (``math.py`` compiles at import)."""
    torch._dynamo.config.disable = True
    torch.cuda.synchronize = lambda device=None: None


def bench(fn, num_warmups: int = 50, num_tests: int = 50, post_fn=None, flush_l2: bool = True):
    """DeepEP's ``bench`` timed by the wall clock over 3 calls after 1 warm-up (its 50 + 50 calls, CUDA events and
    L2 flushes are for steady GPU numbers; on the CPU the numbers mean nothing and the calls only cost time) →
    ``(mean, min, max)`` seconds, like DeepEP's."""
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        if post_fn is not None:
            post_fn()
    return sum(times) / len(times), min(times), max(times)


def bench_kineto(
    fn,
    kernel_names,
    num_tests: int = 30,
    suppress_kineto_output: bool = False,
    trace_path=None,
    flush_l2: bool = True,
    barrier_comm_profiling: bool = False,
    num_kernels_per_period: int = 1,
    barrier=None,
):
    """DeepEP's ``bench_kineto`` reads each named CUDA kernel's time from a kineto profile, which cannot run
    without CUDA: ``fn`` is not run (its checks ran already in the files' correctness part; test_low_latency.py's
    profiled ``fn`` also multiplies two 8192² matrices) and each name gets 1 s, per period when there are several,
    shaped as DeepEP's answer."""
    one = 1.0 if num_kernels_per_period == 1 else [1.0] * num_kernels_per_period
    return tuple(one for _ in kernel_names) if isinstance(kernel_names, tuple) else one


def shrink_testing(testing: ModuleType) -> None:
    """Swaps DeepEP's ``deep_ep.utils.testing`` timers for the CPU ones above (the files import them by name, after
    ``deep_ep`` has loaded ``testing``)."""
    testing.bench, testing.bench_kineto = bench, bench_kineto


def init_dist(local_rank: int, num_local_ranks: int, seed: int = 0) -> tuple[int, int, dist.ProcessGroup]:
    """Joins rank ``local_rank`` of ``num_local_ranks`` on the CPU → ``(rank, world size, the group of all)``."""
    deepep_envs._local_rank[:] = [local_rank]  # dist_print's once_in_node reads it
    dist.init_process_group(
        "gloo",
        init_method="file://" + os.environ["MOE_EP_DEEPEP_RENDEZVOUS"],
        world_size=num_local_ranks,
        rank=local_rank,
        timeout=datetime.timedelta(seconds=float(os.environ.get("MOE_EP_DEEPEP_TIMEOUT_S", 300))),
    )
    nccl_like_collectives()
    torch.set_default_dtype(torch.bfloat16)
    CudaToCpu().__enter__()  # for the rest of this rank: init_dist is its first call, the rank ends with the test
    init_seed(seed)
    return dist.get_rank(), dist.get_world_size(), dist.new_group(list(range(num_local_ranks)))
