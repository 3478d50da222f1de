"""Example MoE trainer: YAML config → DeepSeek-V3-style model → spawn/torchrun launch → training loop.

Entry points: the ``moe-ep-train`` console script (:mod:`.cli`), :func:`config.load` and :class:`trainer.Trainer`.
"""

from .config import TrainerConfig, load
from .trainer import Trainer, run

__all__ = ["TrainerConfig", "Trainer", "load", "run"]
