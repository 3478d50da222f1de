"""Wait for a Buffer's kernels and raise what they recorded: a kernel wait that timed out records the error for
the next call and leaves its outputs unwritten, so a check must fail as that timeout (naming the rank), not as
differing data."""
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
            torch.cuda.synchronize(buffer.device)
        check = getattr(buffer.transport, "check_error", None)  # the torch transport records nothing
        if check is not None:
            check()
