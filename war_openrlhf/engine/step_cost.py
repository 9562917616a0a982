"""What an engine step costs, as a curve over the query tokens it carries: the switch's model.

Why: whether drafting pays, and how long a draft should be, both come down to what a step
costs as it carries more tokens. A decode step of ``B`` requests carries ``B`` query tokens;
with ``D`` draft tokens to verify it carries ``B + D``. One curve ``T(N)`` of step seconds
over query tokens ``N`` answers both: drafting pays at batch ``b`` iff
``(1 + a) * T(b) / T(b + D) > 1``, and one more draft token costs the curve's slope
``dT/dN`` there: about ``T/N`` on a compute-bound CPU, about zero on a memory-bound GPU below
its roofline, so draft lengths derived from it differ by device without a per-device constant.

Steps with and without drafting feed the same curve, and a synchronous RL step visits large
``N`` during its high-load phase before the tail needs the curve at small ``N``, so a batch
the engine has not run at is priced from its neighbours instead of measured on both sides
first (a table per batch bucket and side had to calibrate each bucket the tail passed
through). Bins are log-spaced (two per doubling of ``N``), each an EWMA of seconds and of the
``N`` it saw; between bins the curve is linear, below the smallest it is flat, above the
largest it follows the last two bins' slope (or ``T`` proportional to ``N`` with one bin).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def _bin(tokens: float) -> int:
    return int(round(2 * math.log2(max(tokens, 1.0))))


@dataclass
class _Bin:
    tokens: float = 0.0
    seconds: float = 0.0
    samples: int = 0


class StepCurve:
    """``T(N)``: seconds of an engine step carrying ``N`` query tokens, from observed steps."""

    def __init__(self, ewma: float = 0.2, min_samples: int = 3) -> None:
        self.ewma = ewma
        self.min_samples = min_samples
        self.bins: dict[int, _Bin] = {}
        self._known: list[_Bin] | None = None

    def observe(self, tokens: int, seconds: float) -> bool:
        """One step; False when ignored (no tokens, not a duration, or an idle gap: more than
        10x its bin's estimate)."""
        if tokens <= 0 or not seconds > 0 or not math.isfinite(seconds):
            return False
        b = self.bins.setdefault(_bin(tokens), _Bin())
        if b.samples >= self.min_samples and seconds > 10 * b.seconds:
            return False
        if b.samples == 0:
            b.tokens, b.seconds = float(tokens), seconds
        else:
            b.tokens += self.ewma * (tokens - b.tokens)
            b.seconds += self.ewma * (seconds - b.seconds)
        b.samples += 1
        self._known = None
        return True

    def known(self) -> list[_Bin]:
        """Bins with enough samples, by tokens."""
        if self._known is None:
            self._known = sorted((b for b in self.bins.values() if b.samples >= self.min_samples),
                                 key=lambda b: b.tokens)
        return self._known

    def covers(self, tokens: float) -> bool:
        """Whether ``tokens`` lies within a factor 2 of the measured range (else: measure it)."""
        known = self.known()
        return bool(known) and known[0].tokens / 2 <= tokens <= known[-1].tokens * 2

    def bounds(self, tokens: float) -> tuple[float, float] | None:
        """``(low, high)`` bounds on ``T(tokens)``: the estimate twice where the curve covers it;
        below the range ``T(N) * tokens / N`` and ``T(N)`` of the smallest bin (a step costs no more
        for fewer tokens, and its cost per token falls with batching); above it ``T`` of the
        largest bin and infinity. None before any bin is measured."""
        known = self.known()
        if not known:
            return None
        if self.covers(tokens):
            t = self.seconds(tokens)
            return t, t
        if tokens < known[0].tokens:
            return known[0].seconds * tokens / known[0].tokens, known[0].seconds
        return known[-1].seconds, math.inf

    def _bracket(self, tokens: float) -> tuple[_Bin, _Bin] | None:
        known = self.known()
        if len(known) < 2:
            return None
        if tokens >= known[-1].tokens:
            return known[-2], known[-1]
        for lo, hi in zip(known, known[1:]):
            if tokens <= hi.tokens:
                return lo, hi
        return known[-2], known[-1]

    def seconds(self, tokens: float) -> float | None:
        """``T(tokens)``; None before any bin is measured."""
        known = self.known()
        if not known:
            return None
        if tokens <= known[0].tokens:
            return known[0].seconds
        if len(known) == 1:
            return known[0].seconds * tokens / known[0].tokens
        lo, hi = self._bracket(tokens)
        slope = max((hi.seconds - lo.seconds) / max(hi.tokens - lo.tokens, 1e-9), 0.0)
        return lo.seconds + slope * (tokens - lo.tokens) if tokens < hi.tokens else hi.seconds + slope * (tokens - hi.tokens)

    def slope(self, tokens: float) -> float | None:
        """``dT/dN`` at ``tokens`` (>= 0): what one more query token (a draft token) costs."""
        known = self.known()
        if not known:
            return None
        if len(known) == 1:
            return known[0].seconds / known[0].tokens
        lo, hi = self._bracket(max(tokens, known[0].tokens))
        return max((hi.seconds - lo.seconds) / max(hi.tokens - lo.tokens, 1e-9), 0.0)

    def points(self) -> list[dict[str, float]]:
        return [{"tokens": b.tokens, "seconds": b.seconds, "samples": b.samples}
                for b in sorted(self.bins.values(), key=lambda b: b.tokens)]
