"""Wait for a Buffer's kernels and raise what they recorded: a kernel that timed out records the error and traps, so
the wait fails with a bare CUDA error, and one that found ranks disagreeing leaves its outputs unwritten; a check must
fail as the recorded error (naming the rank), not as either."""

from __future__ import annotations

import torch

from moe_ep_plugin import Buffer


def settle(*buffers: Buffer) -> None:
    """Wait for each live buffer's device, then raise the error a kernel of its transport recorded, if any. Call it
    after comparing outputs that a stream mode orders: a device-wide wait first would hide a missing dependency."""
    for buffer in buffers:
        if buffer.destroyed:
            continue
        if buffer.device.type == "cuda":
            try:
                torch.cuda.synchronize(buffer.device)
            except RuntimeError:
                buffer.transport.check_error()
                raise
        buffer.transport.check_error()
