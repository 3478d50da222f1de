"""EventOverlap: DeepEP's handle on asynchronous communication (a CUDA event, or nothing on CPU)."""
from __future__ import annotations

from typing import Optional

import torch


class EventOverlap:
    """Wraps the CUDA event recorded after a communication kernel; on CPU it holds none and waits are no-ops.

    ``extra_tensors`` are kept alive until the event is waited on (tensors still used by the comm stream).
    """

    def __init__(self, event: Optional["torch.cuda.Event"] = None, extra_tensors: Optional[tuple] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Make the current CUDA stream wait for the communication to finish."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self) -> "EventOverlap":
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
