"""Megatron-Core's CUDA-only calls made runnable on CPU gloo ranks (tests only): the CUDA streams of its
``alltoall`` dispatcher and recompute, its uneven TP collectives, and the streams, events, NVTX ranges and
``record_stream`` of its 1F1B EP-overlap schedule; and its TP collectives of CUDA tensors for gloo ranks sharing
one GPU. Each double replaces only that dependency."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist


class HostStream:
    """Stands in for ``torch.cuda.Stream``/``current_stream``: on CPU every copy is already complete."""

    def wait_stream(self, stream: object) -> None:
        pass

    def record_event(self) -> HostStream:
        return self

    def synchronize(self) -> None:
        pass


def _uneven_all_gather(all_gather):
    """gloo's all_gather wants equal shapes; Megatron's TP gather of the received tokens has per-rank sizes (as
    NCCL allows): gather zero-padded rows and keep each rank's own."""

    def gather(tensor_list, tensor, group=None, async_op=False):
        rows = max(t.shape[0] for t in tensor_list)
        if all(t.shape[0] == rows for t in tensor_list) and tensor.shape[0] == rows:
            return all_gather(tensor_list, tensor, group=group, async_op=async_op)
        padded = [torch.zeros((rows, *tensor.shape[1:]), dtype=tensor.dtype) for _ in tensor_list]
        all_gather(padded, torch.cat([tensor, padded[0][tensor.shape[0] :]]), group=group)
        for out, full in zip(tensor_list, padded, strict=True):
            out.copy_(full[: out.shape[0]])

    return gather


def _reduce_scatter(output, input_list, group=None, async_op=False) -> None:
    """Megatron's TP reduce-scatter of expert outputs (gloo has none): all-reduce the rows, keep this rank's."""
    full = torch.cat(input_list)
    dist.all_reduce(full, group=group)
    start = sum(t.shape[0] for t in input_list[: dist.get_rank(group)])
    output.copy_(full[start : start + output.shape[0]])


def _gather_into_tensor(output, input, group=None, async_op=False) -> None:
    """``all_gather_into_tensor`` as gloo's list ``all_gather`` (equal slices of ``output``)."""
    dist.all_gather(list(output.chunk(dist.get_world_size(group))), input.contiguous(), group=group)


def _reduce_scatter_tensor(output, input, group=None, async_op=False) -> None:
    """``reduce_scatter_tensor`` as an all-reduce of ``input`` keeping this rank's equal slice."""
    full = input.clone()
    dist.all_reduce(full, group=group)
    output.copy_(full.chunk(dist.get_world_size(group))[dist.get_rank(group)])


@contextlib.contextmanager
def _patched(*replacements: tuple[object, str, object]) -> Iterator[None]:
    """Set each ``(owner, name, value)`` for the block, restoring the originals after it."""
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in replacements]
    for owner, name, value in replacements:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def _through_host(collective):
    """``collective(output, input, group=)`` of CUDA tensors (one tensor or a list each) on host copies, the result
    copied back: gloo ranks sharing one GPU, where gloo takes few collectives of CUDA tensors."""

    def listed(t):
        return t if isinstance(t, (list, tuple)) else [t]

    def run(output, input, group=None, async_op=False):
        if not listed(output)[0].is_cuda:
            return collective(output, input, group=group, async_op=async_op)
        if async_op:
            raise ValueError("the host-copy collectives of the tests are synchronous")

        def host(t):
            return [x.cpu() for x in t] if isinstance(t, (list, tuple)) else t.cpu()

        host_out = host(output)
        collective(host_out, host(input), group=group)
        for dst, src in zip(listed(output), listed(host_out), strict=True):
            dst.copy_(src)

    return run


@contextlib.contextmanager
def tp_collectives_through_host() -> Iterator[None]:
    """Ranks sharing one GPU over gloo with tensor parallelism: Megatron's TP gathers (uneven ones included) and
    reduce-scatters of CUDA tensors run on host copies with gloo's collectives."""
    from megatron.core.tensor_parallel import mappings

    with _patched(
        (dist, "all_gather", _through_host(_uneven_all_gather(dist.all_gather))),
        (dist, "reduce_scatter", _through_host(_reduce_scatter)),
        (mappings, "dist_all_gather_func", _through_host(_gather_into_tensor)),
        (mappings, "dist_reduce_scatter_func", _through_host(_reduce_scatter_tensor)),
    ):
        yield


@contextlib.contextmanager
def cuda_streams_are_host() -> Iterator[None]:
    """Without CUDA: the CUDA stream calls of Megatron's alltoall (token-count copies) and of recompute's RNG
    bookkeeping become no-ops, and its uneven TP gather / reduce-scatter run on gloo; with CUDA nothing changes."""
    if torch.cuda.is_available():
        yield
        return
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import token_dispatcher
    from megatron.core.transformer.moe.token_dispatcher import (
        MoEAlltoAllTokenDispatcher,
    )

    stream = HostStream()
    to_cpu = token_dispatcher.maybe_move_tensor_to_cpu

    def to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        # what the CUDA path returns (split sizes as numpy arrays, which all_to_all_single takes) for host tensors
        return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else to_cpu(tensor, as_numpy, record_stream)

    with _patched(
        (token_dispatcher, "maybe_move_tensor_to_cpu", to_host),
        (dist, "all_gather", _uneven_all_gather(dist.all_gather)),
        (dist, "reduce_scatter", _reduce_scatter),
        (torch.cuda, "current_stream", lambda *args: stream),
        (torch.cuda, "stream", lambda s: contextlib.nullcontext()),
        (mrandom, "_get_cuda_rng_state", lambda *args, **kwargs: None),
        (mrandom, "_set_cuda_rng_state", lambda *args, **kwargs: None),
        (MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", stream),
    ):
        yield


class HostEvent:
    """Stands in for the ``torch.cuda.Event`` the overlap schedule's nodes wait on and record: on CPU every node's
    work is complete when it returns."""

    def wait(self, stream: object) -> None:
        pass

    def record(self, stream: object) -> None:
        pass


@contextlib.contextmanager
def overlap_schedule_is_host() -> Iterator[HostStream]:
    """Without CUDA: what Megatron's 1F1B EP-overlap schedule (``ScheduleNode``, the fine-grained callables) asks of
    CUDA — NVTX ranges, ``Tensor.record_stream``, the current stream — becomes a no-op, on top of
    :func:`cuda_streams_are_host`; yields the stream to give the schedule plan as its compute and communication
    stream. With CUDA: a fresh communication stream, the rest unchanged."""
    if torch.cuda.is_available():
        yield torch.cuda.Stream()
        return
    nvtx = torch.cuda.nvtx
    torch.Tensor.record_stream = lambda self, stream: None  # shadows torch._C.TensorBase's until deleted
    try:
        with (
            _patched(
                (nvtx, "range_push", lambda *args, **kwargs: None), (nvtx, "range_pop", lambda *args, **kwargs: None)
            ),
            cuda_streams_are_host(),
        ):
            yield HostStream()
    finally:
        del torch.Tensor.record_stream


def flex_backends_on_host(backends: tuple[str, ...]) -> tuple[str, ...]:
    """``backends`` less those whose Megatron manager cannot be built here: megatron-core >= 0.19's
    ``_HybridEPManager`` allocates its overflow flag on ``device='cuda'`` when it is built, so without CUDA
    ``hybridep`` runs on megatron-core 0.16-0.18 only."""
    import megatron.core

    major, minor = (int(part) for part in megatron.core.__version__.split(".")[:2])
    if torch.cuda.is_available() or (major, minor) < (0, 19):
        return backends
    return tuple(b for b in backends if b != "hybridep")
