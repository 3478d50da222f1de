"""EventOverlap: DeepEP's handle on asynchronous communication (a CUDA event, or nothing on CPU); the current
stream's raw handle for kernel launches."""

from __future__ import annotations

from collections.abc import Callable

import torch

# CUDA builds of torch have it; it returns the cudaStream_t without building a torch.cuda.Stream.
_raw_stream: Callable[[int], int] | None = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream_handle(device_index: int) -> int:
    """The ``cudaStream_t`` (as an int) of the current stream of CUDA device ``device_index``, for a kernel launch.
    The raw call skips building a ``torch.cuda.Stream`` object, which ``torch.cuda.current_stream()`` does on
    every call."""
    if _raw_stream is not None:
        return _raw_stream(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


class EventOverlap:
    """Wraps the CUDA event recorded after a communication kernel; on CPU it holds none and waits are no-ops.

    ``extra_tensors`` are kept alive until the event is waited on (tensors still used by the comm stream).
    """

    def __init__(self, event: torch.cuda.Event | None = None, extra_tensors: tuple | None = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Make the current CUDA stream wait for the communication to finish."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.current_stream_wait()


def capture() -> EventOverlap:
    """An EventOverlap marking the current point of the current stream (CPU: empty)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return EventOverlap()
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream())
    return EventOverlap(event)
