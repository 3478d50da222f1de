"""Progress lines of every recipe: when a step is logged, its ``step N/TOTAL | ... | ...`` line, and the token
rate, time per step and time left since the last logged step."""

from __future__ import annotations

import time
from collections.abc import Sequence


def due(step: int, total: int, interval: int, start: int | None = None) -> bool:
    """Whether 1-based ``step`` gets a line: every ``interval`` steps, the last one, and (given the step a run
    started from) its first."""
    return step % interval == 0 or step == total or (start is not None and step == start + 1)


def line(step: int, total: int, items: Sequence[str]) -> str:
    """``step   7/300 | item | item``, the step right-aligned to the width of ``total``."""
    return " | ".join([f"step {step:>{len(str(total))}}/{total}", *items])


class TokenRate:
    """Tokens per second and seconds per step between successive :meth:`mark` calls."""

    def __init__(self, tokens_per_step: int, step: int = 0) -> None:
        self.tokens_per_step, self.step, self.time = tokens_per_step, step, time.perf_counter()
        self.step_s = 0.0  # seconds per step over the last marked span

    def mark(self, step: int) -> float:
        """Tokens/s over the steps since the previous mark, ending at 1-based ``step``."""
        now = time.perf_counter()
        self.step_s = max(now - self.time, 1e-9) / max(step - self.step, 1)
        rate = self.tokens_per_step / self.step_s
        self.step, self.time = step, now
        return rate

    def pace(self, total: int) -> list[str]:
        """``["123 ms/step", "ETA 0:01:05"]``: the last marked span's time per step, and the time the steps left
        up to ``total`` take at that pace."""
        left = round(self.step_s * max(total - self.step, 0))
        return [f"{1e3 * self.step_s:,.0f} ms/step", f"ETA {left // 3600}:{left // 60 % 60:02d}:{left % 60:02d}"]
