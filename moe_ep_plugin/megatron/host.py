"""Run Megatron-Core modules on a machine without CUDA.

Several Megatron-Core modules place tensors on ``torch.cuda.current_device()`` unconditionally (the router's
weights and expert-bias buffers, the rotary embedding's frequencies). Megatron's math itself runs on any device,
so for CPU runs (tests, the launcher's smoke configuration) the plugin executes those modules inside
:func:`cuda_device_is_host`, where that call answers ``cpu``. With CUDA available it changes nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def cuda_device_is_host() -> Iterator[None]:
    """Where CUDA is unavailable, make ``torch.cuda.current_device()`` answer ``cpu`` inside the block (Megatron
    modules that place tensors there unconditionally then build on the host); with CUDA, do nothing."""
    if torch.cuda.is_available():
        yield
        return
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")
    try:
        yield
    finally:
        torch.cuda.current_device = original


def seed_model_parallel_rng(seed: int) -> None:
    """Seed Megatron's model-parallel RNG tracker (dropout, expert init). Without CUDA the CUDA tracker cannot
    exist, so Megatron's own no-op tracker is installed and dropout draws from torch's host RNG."""
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
