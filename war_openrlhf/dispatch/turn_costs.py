"""What a turn costs on an engine, fitted online from the turns the pool has seen.

A dispatcher that weighs a cache hit against a queue needs both in one unit. WAR's uses
seconds, from a least-squares fit of every finished turn's dispatch-to-last-token latency::

    latency ~ prefill_s * uncached_prompt_tokens
            + step_s * response_tokens
            + step_per_seq_s * response_tokens * batch

``batch`` being the engine's requests in flight when the turn was dispatched. ``prefill_s`` is
the engine's measured prefill rate, ``step_s + step_per_seq_s * b`` its decode step time at
batch ``b`` (a decode step reads the weights once, ``step_s``, plus each sequence's KV and
compute, ``step_per_seq_s``). Queueing time is not a feature: it is the residual, so a
congested engine shows up as a larger intercept-free error, not as a wrong rate. The fit is a
non-negative least squares over the accumulated normal equations (three unknowns: every
subset of the active set is tried, which is exact for three variables), refreshed at most once
per observation and never inside ``choose()``.

Before three turns have finished there is nothing to fit: the rates are the ratios of a
memory-bound decoder, in units of one decode step (``step_s = 1``): a prefilled token costs
1/64 of a step (the H100/7B preset's 38 us per token against a 4.6 ms step is 1/120, the CPU
preset's 45 us against 1.4 ms is 1/31; 1/64 is their geometric middle) and a sequence adds
1/32 of a step (a 7B step with 32 sequences of 8k tokens reads about twice the weights' bytes).
Only the first decisions of a cold pool use them; decisions compare costs, so their unit
does not matter.
"""

from __future__ import annotations

import math
from itertools import combinations
from typing import Tuple

import numpy as np

__all__ = ["TurnCosts", "PRIOR_RATES"]

PRIOR_RATES = (1.0 / 64, 1.0, 1.0 / 32)  # prefill_s, step_s, step_per_seq_s (in decode steps)


class TurnCosts:
    """Online fit of the turn-latency model above; also the mean response length and turns."""

    __slots__ = ("_xtx", "_xty", "n", "prefill_s", "step_s", "step_per_seq_s", "_dirty",
                 "response_sum", "latency_sum")

    def __init__(self) -> None:
        self._xtx = np.zeros((3, 3))
        self._xty = np.zeros(3)
        self.n = 0
        self.prefill_s, self.step_s, self.step_per_seq_s = PRIOR_RATES
        self._dirty = False
        self.response_sum = 0
        self.latency_sum = 0.0

    def observe(self, uncached: int, response: int, batch: int, latency_s: float) -> None:
        if not (latency_s >= 0 and np.isfinite(latency_s)) or response <= 0:
            return
        x = np.array([float(max(uncached, 0)), float(response), float(response) * max(batch, 0)])
        self._xtx += np.outer(x, x)
        self._xty += x * latency_s
        self.n += 1
        self.response_sum += response
        self.latency_sum += latency_s
        self._dirty = True

    def state_dict(self) -> dict:
        return {"xtx": self._xtx.tolist(), "xty": self._xty.tolist(), "n": self.n,
                "rates": [self.prefill_s, self.step_s, self.step_per_seq_s],
                "response_sum": self.response_sum, "latency_sum": self.latency_sum}

    def load_state_dict(self, state: dict) -> None:
        self._xtx = np.asarray(state["xtx"], dtype=np.float64).reshape(3, 3)
        self._xty = np.asarray(state["xty"], dtype=np.float64).reshape(3)
        self.n = int(state["n"])
        self.prefill_s, self.step_s, self.step_per_seq_s = (float(v) for v in state["rates"])
        self.response_sum = state["response_sum"]
        self.latency_sum = float(state["latency_sum"])
        self._dirty = False

    @property
    def mean_response(self) -> float:
        """Mean response tokens of the observed turns (128 before any: a short tool call)."""
        return self.response_sum / self.n if self.n else 128.0

    @property
    def mean_latency(self) -> float:
        """Mean dispatch-to-last-token seconds of the observed turns (0 before any)."""
        return self.latency_sum / self.n if self.n else 0.0

    def rates(self) -> Tuple[float, float, float]:
        """(prefill_s, step_s, step_per_seq_s): the fit once three turns were seen."""
        if self._dirty and self.n >= 3:
            self._solve()
        return self.prefill_s, self.step_s, self.step_per_seq_s

    def _solve(self) -> None:
        """Non-negative least squares over every subset of the three unknowns (the full set
        first), each solved exactly by Cramer's rule in plain floats: a turn's refresh costs a
        few microseconds instead of a dozen small LAPACK calls (the fit is refreshed after
        almost every turn)."""
        self._dirty = False
        a = self._xtx.tolist()
        b = self._xty.tolist()
        best, best_err = None, math.inf
        for k in (3, 2, 1):
            for idx in _SUBSETS[k]:
                coef = _solve_small([[a[i][j] for j in idx] for i in idx], [b[i] for i in idx])
                if coef is None or min(coef) < 0:
                    continue
                full = [0.0, 0.0, 0.0]
                for i, c in zip(idx, coef):
                    full[i] = c
                err = (sum(full[i] * a[i][j] * full[j] for i in range(3) for j in range(3))
                       - 2.0 * sum(full[i] * b[i] for i in range(3)))  # residual up to a constant
                if err < best_err:
                    best, best_err = full, err
            if best is not None and k == 3:
                break
        if best is None:  # every subset singular (all observations alike): keep the last rates
            return
        self.prefill_s, self.step_s, self.step_per_seq_s = (float(v) for v in best)


_SUBSETS = {k: [list(c) for c in combinations(range(3), k)] for k in (1, 2, 3)}


def _det(m: list) -> float:
    if len(m) == 1:
        return m[0][0]
    if len(m) == 2:
        return m[0][0] * m[1][1] - m[0][1] * m[1][0]
    return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
            - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
            + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))


def _solve_small(m: list, rhs: list):
    """``m x = rhs`` for a 1x1-3x3 system by Cramer's rule; None when ``m`` is (near) singular
    (|det| below 1e-12 x its largest entry to the k-th power, as before)."""
    k = len(m)
    d = _det(m)
    scale = max(1.0, max(abs(v) for row in m for v in row))
    if abs(d) < 1e-12 * scale ** k:
        return None
    out = []
    for c in range(k):
        mc = [[rhs[i] if j == c else m[i][j] for j in range(k)] for i in range(k)]
        out.append(_det(mc) / d)
    return out
