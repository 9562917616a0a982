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
through). Bins are log-spaced (two per doubling of ``N``), each the mean of the middle half of
its last ``4 / ewma - 3`` steps' seconds (twice an EWMA's span, so the half kept weighs as many
steps as the EWMA did; ``ewma`` 1: the last step) and an EWMA of the ``N`` it saw. Measured
steps are noisy, and not symmetrically: on shared CPU cores a step now and then takes several
times its usual time (another process ran), and an EWMA carried such a step into
the bin for its whole memory, which moved the switch's gain across its threshold and back from
one window to the next and priced draft tokens at several times their cost; a trimmed mean
ignores them. A step never costs less for more tokens, so the curve is the bins' isotonic
(non-decreasing) fit, weighted by their samples: between bins linear, below the smallest flat,
above the largest continued by the last two bins' slope (or ``T`` proportional to ``N`` with
one bin). The price of a draft token is the slope of a weighted least-squares line through the
fitted bins within a factor 4 of ``N`` (all bins when fewer than two lie there): a local slope,
not a difference of two noisy neighbours.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


def _bin(tokens: float) -> int:
    return int(round(2 * math.log2(max(tokens, 1.0))))


@dataclass
class _Bin:
    tokens: float = 0.0
    seconds: float = 0.0
    samples: int = 0
    recent: deque | None = None  # the last steps' seconds (``seconds``: their middle half's mean)
    refused: list = field(default_factory=list)  # the steps just refused as stalls, in a row


def _middle_mean(values) -> float:
    """Mean of the middle half (a quarter dropped at each end): as steady as a mean on
    symmetric noise, deaf to a few slow outliers as a median is."""
    r = sorted(values)
    k = (len(r) + 1) // 4  # 3 values: their median; 17: the middle 9
    mid = r[k:len(r) - k]
    return sum(mid) / len(mid)


class StepCurve:
    """``T(N)``: seconds of an engine step carrying ``N`` query tokens, from observed steps."""

    def __init__(self, ewma: float = 0.2, min_samples: int = 3) -> None:
        self.ewma = ewma
        self.min_samples = min_samples
        self.span = max(1, round(4.0 / ewma - 3.0))  # a bin's last steps, whose middle half it keeps
        self.bins: dict[int, _Bin] = {}
        self._known: list[_Bin] | None = None
        self.stalls = 0  # steps refused as stalls or idle gaps (see observe)

    def observe(self, tokens: int, seconds: float) -> bool:
        """One step; False when ignored (no tokens, not a duration, or a stall or idle gap: more
        than 3x its bin's estimate, unless half a span of steps in a row are, or, in a bin with
        fewer than ``min_samples`` steps, more than twice the per-token seconds of the largest
        measured bin below it)."""
        if tokens <= 0 or not seconds > 0 or not math.isfinite(seconds):
            return False
        b = self.bins.setdefault(_bin(tokens), _Bin())
        if b.samples >= self.min_samples:
            # More than 3x the bin's estimate: a stall or an idle gap, unless it keeps happening
            # (half a span in a row: the cost itself changed, and the bin restarts from those steps).
            if seconds > 3.0 * b.seconds:
                b.refused.append(seconds)
                if len(b.refused) < max(self.span // 2, 1):
                    self.stalls += 1
                    return False
                b.recent = deque(b.refused, maxlen=self.span)
                b.refused = []
                b.seconds = _middle_mean(b.recent)
                b.samples += 1
                self._known = None
                return True
            b.refused = []
        else:
            # A young bin's first steps decide its estimate alone. A step costing more than twice
            # the per-token rate of a smaller measured bin is a stall, not the cost of its tokens
            # (a step's cost per token falls with batching); seen on CPU engines as 3-25 ms steps
            # among 1 ms ones, which made the first bin at a new batch size say drafting lost 5x.
            ref = None
            for o in self.bins.values():
                if o.samples >= self.min_samples and o.tokens <= tokens and (ref is None or o.tokens > ref.tokens):
                    ref = o
            if ref is not None and seconds > 2.0 * ref.seconds * tokens / ref.tokens:
                self.stalls += 1
                return False
        if b.samples == 0:
            b.tokens, b.recent = float(tokens), deque(maxlen=self.span)
        else:
            b.tokens += self.ewma * (tokens - b.tokens)
        b.recent.append(seconds)
        b.seconds = _middle_mean(b.recent)
        b.samples += 1
        self._known = None
        return True

    #: A bin's weight in the isotonic fit and the slope caps at this many samples (an EWMA
    #: remembers about 1 / ewma steps, so more samples are not more information).
    MAX_WEIGHT = 20

    def known(self) -> list[_Bin]:
        """Bins with enough samples, by tokens, their seconds replaced by the isotonic fit."""
        if self._known is None:
            raw = sorted((b for b in self.bins.values() if b.samples >= self.min_samples), key=lambda b: b.tokens)
            fitted = _isotonic([b.seconds for b in raw], [min(b.samples, self.MAX_WEIGHT) for b in raw])
            self._known = [_Bin(b.tokens, t, b.samples) for b, t in zip(raw, fitted)]
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
        """``dT/dN`` near ``tokens`` (>= 0): what one more query token (a draft token) costs."""
        known = self.known()
        if not known:
            return None
        if len(known) == 1:
            return known[0].seconds / known[0].tokens
        near = [b for b in known if tokens / 4 <= b.tokens <= tokens * 4]
        pts = near if len(near) >= 2 else known
        w = [min(b.samples, self.MAX_WEIGHT) for b in pts]
        sw = sum(w)
        mx = sum(wi * b.tokens for wi, b in zip(w, pts)) / sw
        my = sum(wi * b.seconds for wi, b in zip(w, pts)) / sw
        sxx = sum(wi * (b.tokens - mx) ** 2 for wi, b in zip(w, pts))
        if sxx <= 0:
            return 0.0
        return max(sum(wi * (b.tokens - mx) * (b.seconds - my) for wi, b in zip(w, pts)) / sxx, 0.0)

    def points(self) -> list[dict[str, float]]:
        """Every bin: tokens, measured seconds, samples; ``fitted``: the curve there (None: too few samples)."""
        fitted = {id(b): f.seconds for b, f in zip(
            sorted((b for b in self.bins.values() if b.samples >= self.min_samples), key=lambda b: b.tokens),
            self.known())}
        return [{"tokens": b.tokens, "seconds": b.seconds, "samples": b.samples, "fitted": fitted.get(id(b))}
                for b in sorted(self.bins.values(), key=lambda b: b.tokens)]


def _isotonic(values: list[float], weights: list[float]) -> list[float]:
    """Weighted least-squares non-decreasing fit (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values, weights):
        blocks.append([v, float(w), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, n2 = blocks.pop()
            v1, w1, n1 = blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    out: list[float] = []
    for mean, _, n in blocks:
        out.extend([mean] * n)
    return out
