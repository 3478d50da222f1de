"""``deep_ep.utils``: ``EventOverlap`` (this library's) and ``EventHandle`` (a point on the current stream), plus
the deferred result DeepEP 2.5's ``defer_epilogue=True`` returns."""

from __future__ import annotations

from typing import Any

import torch

from ..event import EventOverlap


class EventHandle:
    """DeepEP's ``EventHandle``: a CUDA event recorded on the current stream when made (nothing on the CPU).

    ``current_stream_wait()`` makes the current stream wait for it."""

    def __init__(self) -> None:
        self.event: torch.cuda.Event | None = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream())

    def current_stream_wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


def as_event_overlap(event: object, name: str) -> EventOverlap | None:
    """``event`` (an ``EventHandle``, an ``EventOverlap`` or None) as the ``EventOverlap`` ``moe_ep_plugin.Buffer``
    takes; anything else is a ``TypeError`` naming ``name``."""
    if event is None or isinstance(event, EventOverlap):
        return event
    if isinstance(event, EventHandle):
        return EventOverlap(event.event)
    raise TypeError(f"{name}: expected an EventHandle (buffer.capture()) or EventOverlap, got {type(event).__name__}")


class DeferredEpilogue(EventOverlap):
    """What ``EPBuffer.dispatch``/``combine`` return with ``defer_epilogue=True``: an ``EventOverlap`` whose
    ``current_stream_wait()`` waits for the call and returns its results (dispatch: ``(recv_x, recv_topk_idx,
    recv_topk_weights, handle)``; combine: ``(combined_x, combined_topk_weights)``).

    This library's dispatch and combine have no separate epilogue kernel: the whole call was issued when it was
    made, and the wait only joins its stream."""

    def __init__(self, event: EventOverlap, results: tuple[Any, ...]) -> None:
        super().__init__(event.event, event.extra_tensors)
        self._results = results

    def current_stream_wait(self) -> tuple[Any, ...]:  # type: ignore[override]
        super().current_stream_wait()
        return self._results


__all__ = ["EventHandle", "EventOverlap", "DeferredEpilogue", "as_event_overlap"]
