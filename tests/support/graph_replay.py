"""One check the GPU tests of capturable dispatches share: a step (forward and backward) warmed up on a side stream,
run once eagerly under ``torch.cuda.set_sync_debug_mode("error")`` (any host sync raises), captured in one CUDA graph,
replayed on refilled inputs and compared with eager calls bit for bit, then compared with the same step on the CPU's
``torch`` transport (``local`` at one rank). Every rank of the default group calls it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from moe_ep_plugin import Buffer


def check_captured(
    step: Callable[..., tuple[torch.Tensor, ...]],
    inputs: Sequence[object],
    refill: Callable[[], None],
    names: Sequence[str],
    device: torch.device,
) -> None:
    """``step(*inputs)`` (``inputs[0]`` the Buffer) → tensors named ``names``; ``refill()`` writes new values into
    the input tensors in place. Raises naming the rank and the output that differs."""
    rank = dist.get_rank()
    refill()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            step(*inputs)
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    dist.barrier()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(*inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize(device)
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step(*inputs)
    torch.cuda.synchronize(device)
    dist.barrier()
    for _ in range(3):
        refill()
        graph.replay()
        eager = step(*inputs)
        torch.cuda.synchronize(device)
        for name, a, b in zip(names, static, eager, strict=True):
            assert torch.equal(a, b), f"rank {rank}: graph replay {name} differs from the eager call"
    cpu_inputs = [_on_cpu(item) for item in inputs]
    cpu_inputs[0] = Buffer(transport="torch")
    for name, a, b in zip(names, eager, step(*cpu_inputs), strict=True):
        assert torch.equal(a.cpu(), b), f"rank {rank}: {name} differs from the CPU transport's"
    dist.barrier()


def _on_cpu(item: object) -> object:
    """A CPU copy of a tensor (keeping whether it requires grad), of each tensor of a tuple; anything else as is."""
    if isinstance(item, tuple):
        return tuple(_on_cpu(t) for t in item)
    if isinstance(item, torch.Tensor):
        return item.detach().cpu().requires_grad_(item.requires_grad)
    return item
