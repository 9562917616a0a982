"""What the drafter costs each engine step: the time between sampling and the next forward.

vLLM calls the drafter once per step, after sampling; whatever it does there (the log
slice the replica applies, then the drafts) is time the accelerator idles. The trace keeps
the last ``keep`` steps so a user can check the budget (a few percent of a step) from
``war_index_stats()["step_trace"]``.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

__all__ = ["StepTrace"]


def _quantiles(values: deque) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p99": 0.0, "max": 0.0, "mean": 0.0}
    a = np.fromiter(values, dtype=np.float64, count=len(values))
    return {
        "p50": round(float(np.percentile(a, 50)), 2),
        "p99": round(float(np.percentile(a, 99)), 2),
        "max": round(float(a.max()), 2),
        "mean": round(float(a.mean()), 2),
    }


class StepTrace:
    """Per-step drafter time (µs): all of it (``drafter_us``) and the log-application part (``apply_us``)."""

    def __init__(self, keep: int = 4096) -> None:
        self._drafter: deque[float] = deque(maxlen=keep)
        self._apply: deque[float] = deque(maxlen=keep)
        self._pending_apply = 0.0
        self.steps = 0
        self.apply_steps = 0  # steps that applied some of the log

    def applied(self, seconds: float) -> None:
        """Log application done within the step being recorded."""
        self._pending_apply += seconds

    def record(self, start: float, end: float) -> None:
        """One step's drafter call ran from ``start`` to ``end`` (perf_counter seconds)."""
        self._drafter.append((end - start) * 1e6)
        self._apply.append(self._pending_apply * 1e6)
        self.apply_steps += self._pending_apply > 0
        self._pending_apply = 0.0
        self.steps += 1

    def summary(self, reset: bool = False) -> dict[str, Any]:
        out = {
            "steps": self.steps,
            "apply_steps": self.apply_steps,
            "drafter_us": _quantiles(self._drafter),
            "apply_us": _quantiles(self._apply),
        }
        if reset:
            self._drafter.clear()
            self._apply.clear()
            self.steps = self.apply_steps = 0
        return out
