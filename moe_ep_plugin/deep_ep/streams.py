"""DeepEP V2's stream and event arguments (``previous_event``, ``previous_event_before_epilogue``,
``async_with_compute_stream``, ``allocate_on_comm_stream``) mapped onto the Buffer's, and the epilogue that runs
after a Buffer call on the stream the call ran on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..buffer import Buffer
from ..event import EventOverlap
from .arguments import check_bool
from .utils import EventHandle, as_event_overlap


def join_events(
    device: torch.device, previous_event: object, before_epilogue: object, on_comm: bool
) -> EventOverlap | None:
    """The one event the Buffer waits for: ``previous_event``, ``previous_event_before_epilogue``, or a point
    after both; with ``on_comm`` (``allocate_on_comm_stream``) and neither, the current stream's point (DeepEP
    allows that pair; the Buffer asks for the event explicitly)."""
    if on_comm and previous_event is None and before_epilogue is None:
        previous_event = EventHandle()
    first = as_event_overlap(previous_event, "previous_event")
    second = as_event_overlap(before_epilogue, "previous_event_before_epilogue")
    if second is None:
        return first
    if first is None or first.event is None or second.event is None:
        return first if first is not None and first.event is not None else second
    joiner = torch.cuda.Stream(device)
    joiner.wait_event(first.event)
    joiner.wait_event(second.event)
    joined = torch.cuda.Event()
    joined.record(joiner)
    return EventOverlap(joined)


def stream_args(
    buffer: Buffer, config: Any, previous_event: object, before_epilogue: object, async_: object, on_comm: object
) -> dict:
    """The Buffer's ``config``/stream keywords of a call."""
    on_comm = check_bool("allocate_on_comm_stream", on_comm)
    return dict(
        config=config,
        previous_event=join_events(buffer.device, previous_event, before_epilogue, on_comm),
        async_finish=check_bool("async_with_compute_stream", async_),
        allocate_on_comm_stream=on_comm,
    )


def run_prologue(buffer: Buffer, kw: dict, fn: Callable[[], Any], reads: tuple[torch.Tensor, ...]) -> Any:
    """``fn()``, an input conversion of the caller's tensors ``reads`` for a Buffer call taking ``kw``, ordered as
    the Buffer orders its own: after ``kw``'s ``previous_event``, on the communication stream the call then runs
    on. Made on the current stream instead, it would run after that event was taken, and the call could read
    its output before it is written. Without an event the call waits for the current stream's work anyway."""
    comm, event = buffer.get_comm_stream(), kw["previous_event"]
    if comm is None or event is None or event.event is None:
        return fn()
    comm.wait_event(event.event)
    with torch.cuda.stream(comm):
        out = fn()
    for t in reads:
        t.record_stream(comm)  # read there: the caller may free them once the call returns
    return out


def run_epilogue(buffer: Buffer, event: EventOverlap, fn: Callable[[], Any]) -> tuple[Any, EventOverlap]:
    """``fn()`` after the Buffer's call: on the communication stream when the call ran there asynchronously
    (the returned event then marks ``fn``'s end too), else on the current stream. Every step that reads the
    call's outputs belongs in ``fn``: on the current stream it would run before the call's kernels finish."""
    comm = buffer.get_comm_stream()
    if comm is None or event.event is None:
        return fn(), event
    current = torch.cuda.current_stream(buffer.device)
    with torch.cuda.stream(comm):
        out = fn()
        done = torch.cuda.Event()
        done.record(comm)
    _record_stream(out, current)
    return out, EventOverlap(done, event.extra_tensors)


def _record_stream(out: Any, stream: torch.cuda.Stream) -> None:
    """Marks the tensors in ``out`` (nested tuples) as used on ``stream``: they were allocated on the
    communication stream, and the caller's work on ``stream`` must finish before their memory is reused."""
    if isinstance(out, torch.Tensor):
        out.record_stream(stream)
    elif isinstance(out, (tuple, list)):
        for part in out:
            _record_stream(part, stream)


__all__ = ["join_events", "run_epilogue", "run_prologue", "stream_args"]
