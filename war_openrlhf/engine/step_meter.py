"""An engine's own step cost, measured from its steps: what the dispatcher prices turns with.

A step that decodes ``s`` sequences and prefills ``p`` prompt tokens takes about
``step_s + step_per_seq_s * s + prefill_token_s * p`` seconds (the weights read once per step,
each sequence's KV and compute, each prefilled token's compute). :class:`StepMeter` fits that
by least squares over the engine's recent busy steps: the time between two consecutive step
outputs while the engine had work queued (an idle gap is not a step), against the step's
generated and prompt tokens as vLLM's iteration stats count them. Coefficients are kept
non-negative (a step never costs less for more work: a feature whose fitted cost comes out
negative is dropped and the rest refitted). Before ``min_samples`` busy steps it reports
nothing (zeros: "not measured"), so the dispatcher falls back on its own estimate.
"""

from __future__ import annotations

from collections import deque
from itertools import combinations

import numpy as np

__all__ = ["StepMeter"]


class StepMeter:
    """Recent busy steps of one engine and the step-cost regression over them."""

    def __init__(self, window: int = 512, min_samples: int = 16, max_gap_s: float = 5.0) -> None:
        if window < 3 or min_samples < 3 or min_samples > window:
            raise ValueError(f"StepMeter: need 3 <= min_samples <= window, got window={window}, "
                             f"min_samples={min_samples}")
        self.samples: deque[tuple[float, float, float]] = deque(maxlen=window)
        self.min_samples = min_samples
        self.max_gap_s = max_gap_s
        self._prev_t: float | None = None
        self._prev_busy = False
        self._fit: tuple[float, float, float] | None = None

    def step(self, now: float, generated_tokens: int, prompt_tokens: int, busy_after: bool) -> None:
        """One step's output at time ``now``: ``generated_tokens`` / ``prompt_tokens`` it
        produced / prefilled; ``busy_after``: the engine still had requests (the next step
        starts at once, so the gap to the next output is that step's duration)."""
        if self._prev_t is not None and self._prev_busy:
            dt = now - self._prev_t
            if 0.0 < dt <= self.max_gap_s and (generated_tokens > 0 or prompt_tokens > 0):
                self.samples.append((dt, float(generated_tokens), float(prompt_tokens)))
                self._fit = None
        self._prev_t = now
        self._prev_busy = bool(busy_after)

    def idle(self) -> None:
        """The engine went idle (or was reset): the next output's gap is not a step."""
        self._prev_busy = False

    def fit(self) -> tuple[float, float, float]:
        """``(step_s, step_per_seq_s, prefill_token_s)``, all >= 0; zeros before ``min_samples``."""
        if len(self.samples) < self.min_samples:
            return 0.0, 0.0, 0.0
        if self._fit is None:
            self._fit = nonnegative_step_fit(np.asarray(self.samples, dtype=np.float64))
        return self._fit


def nonnegative_step_fit(samples: np.ndarray) -> tuple[float, float, float]:
    """Least squares of ``dt ~ a + b * generated + c * prompt`` (rows of ``samples``: dt,
    generated, prompt) with every coefficient >= 0: the best fit over the subsets of features
    whose unconstrained fit is non-negative (three features: every subset is tried)."""
    y = samples[:, 0]
    features = np.column_stack([np.ones(len(samples)), samples[:, 1], samples[:, 2]])
    best: tuple[float, np.ndarray] | None = None
    for k in (3, 2, 1):
        for cols in combinations(range(3), k):
            x = features[:, cols]
            if np.linalg.matrix_rank(x) < k:
                continue
            coef, *_ = np.linalg.lstsq(x, y, rcond=None)
            if np.any(coef < 0):
                continue
            sse = float(np.sum((x @ coef - y) ** 2))
            if best is None or sse < best[0] - 1e-15:
                full = np.zeros(3)
                full[list(cols)] = coef
                best = (sse, full)
    if best is None:  # only an all-negative fit: the mean step, no per-token cost
        return float(max(y.mean(), 0.0)), 0.0, 0.0
    a, b, c = (float(v) for v in best[1])
    return a, b, c
