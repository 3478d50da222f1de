"""One check the GPU tests of capturable dispatches share: a step (forward and backward) warmed up on a side stream,
run once eagerly under ``torch.cuda.set_sync_debug_mode("error")`` (any host sync raises), captured in one CUDA graph,
replayed on refilled inputs and compared with eager calls bit for bit, then compared with the same step on the CPU's
``torch`` transport (``local`` at one rank); :func:`check_replays` is the capture part alone, for steps whose
reference is not the CPU transport. Every rank of the default group calls them."""

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
    eager = check_replays(step, inputs, refill, names, device)
    cpu_inputs = [_on_cpu(item) for item in inputs]
    cpu_inputs[0] = Buffer(transport="torch")
    for name, a, b in zip(names, eager, step(*cpu_inputs), strict=True):
        assert torch.equal(a.cpu(), b), f"rank {rank}: {name} differs from the CPU transport's"
    dist.barrier()


def check_replays(
    step: Callable[..., tuple[torch.Tensor, ...]],
    inputs: Sequence[object],
    refill: Callable[[], None],
    names: Sequence[str],
    device: torch.device,
    trim: Callable[[tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]] | None = None,
) -> tuple[torch.Tensor, ...]:
    """The capture part of :func:`check_captured`: warm-up, one eager call under the sync detector, capture, three
    replays on refilled inputs each equal to an eager call bit for bit. ``trim`` (outputs → outputs, after the
    device is synchronized: it may read counts on the host) cuts what is compared to the rows that hold data, for
    outputs whose rows past a device-side count are unwritten. Returns the last eager call's outputs."""
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
        got, want = (static, eager) if trim is None else (trim(static), trim(eager))
        for name, a, b in zip(names, got, want, strict=True):
            assert torch.equal(a, b), f"rank {rank}: graph replay {name} differs from the eager call"
    return eager


def _on_cpu(item: object) -> object:
    """A CPU copy of a tensor (keeping whether it requires grad), of each tensor of a tuple; anything else as is."""
    if isinstance(item, tuple):
        return tuple(_on_cpu(t) for t in item)
    if isinstance(item, torch.Tensor):
        return item.detach().cpu().requires_grad_(item.requires_grad)
    return item
