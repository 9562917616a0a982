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

The fit runs in the engine actor whenever the pool polls its load (ten times a second), beside
the engine's own processes: it works on the window's sufficient statistics (``X'X``, ``X'y``,
``y'y``, kept as steps enter and leave the window), a few 3x3 solves, instead of least squares
over the 512 rows (which took a sixth of the actor's CPU in a profiled rollout).
:func:`nonnegative_step_fit` (rows in, the same solver on their moments) is what tests hold
against a brute-force non-negative least squares and the incremental moments against.
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
        self._gram = np.zeros((3, 3))  # X'X over the window, rows (1, generated, prompt)
        self._xy = np.zeros(3)  # X'y
        self._yy = 0.0  # y'y
        self._since_rebuild = 0

    def step(self, now: float, generated_tokens: int, prompt_tokens: int, busy_after: bool) -> None:
        """One step's output at time ``now``: ``generated_tokens`` / ``prompt_tokens`` it
        produced / prefilled; ``busy_after``: the engine still had requests (the next step
        starts at once, so the gap to the next output is that step's duration)."""
        if self._prev_t is not None and self._prev_busy:
            dt = now - self._prev_t
            if 0.0 < dt <= self.max_gap_s and (generated_tokens > 0 or prompt_tokens > 0):
                row = (dt, float(generated_tokens), float(prompt_tokens))
                if len(self.samples) == self.samples.maxlen:
                    self._account(self.samples[0], -1.0)
                self.samples.append(row)
                self._account(row, 1.0)
                self._since_rebuild += 1
                if self._since_rebuild >= self.samples.maxlen:  # bound the rounding drift of +/- updates
                    self._rebuild()
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
            mean_y = self._xy[0] / self._gram[0, 0]
            self._fit = nonnegative_fit_from_moments(self._gram, self._xy, self._yy, mean_y)
        return self._fit

    def _account(self, row: tuple[float, float, float], sign: float) -> None:
        x = np.array((1.0, row[1], row[2]))
        self._gram += sign * np.outer(x, x)
        self._xy += sign * row[0] * x
        self._yy += sign * row[0] * row[0]

    def _rebuild(self) -> None:
        self._gram, self._xy, self._yy = _moments(np.asarray(self.samples, dtype=np.float64))
        self._since_rebuild = 0


def _moments(samples: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """``(X'X, X'y, y'y)`` of rows (dt, generated, prompt), ``X`` = (1, generated, prompt)."""
    y = samples[:, 0]
    x = np.column_stack([np.ones(len(samples)), samples[:, 1], samples[:, 2]])
    return x.T @ x, x.T @ y, float(y @ y)


def nonnegative_step_fit(samples: np.ndarray) -> tuple[float, float, float]:
    """Least squares of ``dt ~ a + b * generated + c * prompt`` (rows of ``samples``: dt,
    generated, prompt) with every coefficient >= 0: the best fit over the subsets of features
    whose unconstrained fit is non-negative (three features: every subset is tried)."""
    gram, xy, yy = _moments(samples)
    return nonnegative_fit_from_moments(gram, xy, yy, float(samples[:, 0].mean()))


def nonnegative_fit_from_moments(gram: np.ndarray, xy: np.ndarray, yy: float,
                                 mean_y: float) -> tuple[float, float, float]:
    """:func:`nonnegative_step_fit` from the window's moments (``gram`` = X'X, ``xy`` = X'y,
    ``yy`` = y'y; ``mean_y`` for the all-negative case): the same subsets, each solved by its
    normal equations, its squared error ``y'y - 2 c'X'y + c'X'X c``. A subset whose Gram matrix
    is singular (a feature constant zero, or a multiple of another) is skipped, as a
    rank-deficient design is there."""
    best: tuple[float, np.ndarray] | None = None
    scale = max(float(np.max(np.abs(np.diag(gram)))), 1e-300)
    for k in (3, 2, 1):
        for cols in combinations(range(3), k):
            g = gram[np.ix_(cols, cols)]
            sv = np.linalg.svd(g, compute_uv=False)
            if sv[-1] <= sv[0] * 1e-10 or sv[0] <= scale * 1e-14:
                continue
            coef = np.linalg.solve(g, xy[list(cols)])
            if np.any(coef < 0):
                continue
            sse = float(yy - 2.0 * coef @ xy[list(cols)] + coef @ g @ coef)
            if best is None or sse < best[0] - 1e-12 * max(yy, 1e-300):
                full = np.zeros(3)
                full[list(cols)] = coef
                best = (sse, full)
    if best is None:
        return float(max(mean_y, 0.0)), 0.0, 0.0
    a, b, c = (float(v) for v in best[1])
    return a, b, c
