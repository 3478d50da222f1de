"""The learning-rate schedule of every recipe (the trainer, the Megatron-Core launcher, the DeepSpeed example)."""

from __future__ import annotations

import math


def lr_at(step: int, lr: float, min_lr: float, warmup_steps: int, steps: int) -> float:
    """LR of 0-based ``step``: linear warm-up to ``lr`` over ``warmup_steps``, then cosine decay to ``min_lr`` at
    ``steps`` (held there after). ``min_lr == lr`` and ``warmup_steps == 0`` give a constant ``lr``."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, steps - warmup_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * min(1.0, progress)))


def set_lr(optimizer, value: float) -> None:
    """Write ``value`` into every parameter group of ``optimizer`` (a torch optimizer or DeepSpeed's wrapper)."""
    for group in optimizer.param_groups:
        group["lr"] = value
