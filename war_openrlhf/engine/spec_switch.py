"""Load-aware speculation switch: speculate only while it pays, decided from measurements.

Why: a draft of ``k`` tokens is verified in the same forward pass as the real token.
At low load decode is memory-bound and the extra tokens ride along almost free; at
high load (or on a CPU, where the forward pass is compute-bound) each verified token
costs real time and speculation slows the engine down. Which regime an engine is in
depends on the model, the hardware, the batch and the contexts, so it is measured,
not configured.

Model. One engine step's latency is a function of the tokens it processes,
``T(n)`` with ``n = requests + draft tokens`` (a forward pass over ``n`` query
tokens). The curve is learnt online from every step, speculating or not, as an EWMA
per log-spaced bucket of ``n`` with linear interpolation. Speculation emits
``1 + a`` tokens per request-step, with ``a`` the mean accepted draft tokens per
request-step (measured while speculating). For a batch of ``b`` requests drafting
``d`` tokens each on average, the expected gain is

    gain(b) = (1 + a) * T(b) / T(b + b * d)

Speculation stays on while ``gain > threshold + hysteresis`` and goes off when
``gain < threshold - hysteresis``. Until both points of the curve are measured for
the current batch, the fallback rule applies: speculate iff the batch is at most
``fallback_max_batch`` (same hysteresis, in requests). Every ``explore_every``
windows the switch flips for one window so that both sides of the curve, and the
acceptance, stay fresh. Decisions are taken once per ``window_steps`` steps.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class SpecSwitchConfig:
    """Switch settings (defaults documented in configs/engine.yaml)."""

    window_steps: int = 8
    threshold: float = 1.0
    hysteresis: float = 0.05
    fallback_max_batch: int = 8
    fallback_hysteresis_requests: int = 2
    explore_every: int = 16
    ewma: float = 0.2
    min_samples: int = 3
    enabled: bool = True  # False: never speculate (a kill switch, not a load rule)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SpecSwitchConfig.{name}: {why}, got {getattr(self, name)!r}")

        for name in ("window_steps", "min_samples"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise bad(name, "must be an int >= 1")
        for name in ("fallback_max_batch", "fallback_hysteresis_requests", "explore_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise bad(name, "must be an int >= 0")
        if not self.threshold > 0:
            raise bad("threshold", "must be > 0")
        if not 0 <= self.hysteresis < self.threshold:
            raise bad("hysteresis", "must be in [0, threshold)")
        if not 0 < self.ewma <= 1:
            raise bad("ewma", "must be in (0, 1]")


def _bucket(n: float) -> int:
    """Log-spaced buckets, 4 per doubling: fine enough to interpolate a knee."""
    return int(round(4 * math.log2(max(n, 1.0))))


def _bucket_center(b: int) -> float:
    return 2.0 ** (b / 4)


@dataclass
class LatencyCurve:
    """EWMA step latency per bucket of tokens processed, interpolated between buckets."""

    ewma: float = 0.2
    min_samples: int = 3
    _mean: dict[int, float] = field(default_factory=dict)
    _count: dict[int, int] = field(default_factory=dict)

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or not seconds > 0 or not math.isfinite(seconds):
            return
        b = _bucket(tokens)
        n = self._count.get(b, 0)
        mean = self._mean.get(b)
        if mean is not None and n >= self.min_samples and seconds > 10 * mean:
            return  # an idle gap or a hiccup, not a step
        self._mean[b] = seconds if mean is None else (1 - self.ewma) * mean + self.ewma * seconds
        self._count[b] = n + 1

    def known(self, tokens: float) -> bool:
        """A measured bucket at or around ``tokens`` (interpolation needs both sides)."""
        b = _bucket(tokens)
        if self._count.get(b, 0) >= self.min_samples:
            return True
        ready = [k for k, c in self._count.items() if c >= self.min_samples]
        return any(k < b for k in ready) and any(k > b for k in ready)

    def __call__(self, tokens: float) -> float:
        ready = sorted(k for k, c in self._count.items() if c >= self.min_samples)
        if not ready:
            raise LookupError("no measured step latency yet")
        b = 4 * math.log2(max(tokens, 1.0))
        lo = max((k for k in ready if k <= b), default=None)
        hi = min((k for k in ready if k >= b), default=None)
        if lo is None:
            return self._mean[hi]
        if hi is None or hi == lo:
            return self._mean[lo]
        w = (b - lo) / (hi - lo)
        return (1 - w) * self._mean[lo] + w * self._mean[hi]

    def points(self) -> list[tuple[float, float, int]]:
        """(tokens, seconds, samples) per bucket, for reports and plots."""
        return [(_bucket_center(k), self._mean[k], self._count[k]) for k in sorted(self._mean)]


class SpecSwitch:
    """Per-engine run-time decision: speculate on the next steps or not.

    Feed it every engine step with :meth:`observe`; read :attr:`speculate`.
    """

    def __init__(self, config: SpecSwitchConfig | None = None) -> None:
        self.config = config or SpecSwitchConfig()
        self.curve = LatencyCurve(self.config.ewma, self.config.min_samples)
        self.speculate = self.config.enabled
        self._accepted_per_req = None  # EWMA accepted draft tokens per request-step
        self._drafted_per_req = None  # EWMA draft tokens per request-step (while speculating)
        self._batch = 0.0  # EWMA running requests
        self._steps_in_window = 0
        self._windows = 0
        self._exploring = False
        self._explore_from = self.speculate
        self.last_gain: float | None = None
        self.last_reason = "start"
        self.steps = 0
        self.spec_steps = 0
        self.decisions = 0

    # ------------------------------------------------------------------ inputs
    def observe(self, requests: int, drafted: int, accepted: int, seconds: float) -> None:
        """One engine step: ``requests`` decoded, ``drafted`` draft tokens verified
        (summed over requests), ``accepted`` of them accepted, in ``seconds``."""
        if requests <= 0:
            return
        a = self.config.ewma
        self.steps += 1
        self.curve.observe(requests + drafted, seconds)
        self._batch = requests if self._batch == 0 else (1 - a) * self._batch + a * requests
        if drafted > 0:
            self.spec_steps += 1
            acc, dr = accepted / requests, drafted / requests
            self._accepted_per_req = acc if self._accepted_per_req is None else (1 - a) * self._accepted_per_req + a * acc
            self._drafted_per_req = dr if self._drafted_per_req is None else (1 - a) * self._drafted_per_req + a * dr
        self._steps_in_window += 1
        if self._steps_in_window >= self.config.window_steps:
            self._steps_in_window = 0
            self._decide()

    # ------------------------------------------------------------------ decision
    def expected_gain(self, batch: float) -> float | None:
        """Throughput with speculation / without, at ``batch`` requests; None if unknown."""
        if self._accepted_per_req is None or self._drafted_per_req is None:
            return None
        n_off, n_on = batch, batch * (1 + self._drafted_per_req)
        if not (self.curve.known(n_off) and self.curve.known(n_on)):
            return None
        return (1 + self._accepted_per_req) * self.curve(n_off) / self.curve(n_on)

    def _decide(self) -> None:
        cfg = self.config
        self.decisions += 1
        self._windows += 1
        if not cfg.enabled:
            self.speculate, self.last_reason = False, "disabled"
            return
        if self._exploring:  # an exploration window ends: back to the decision rule
            self._exploring = False
            self.speculate = self._explore_from
        gain = self.expected_gain(self._batch)
        self.last_gain = gain
        if gain is not None:
            if self.speculate and gain < cfg.threshold - cfg.hysteresis:
                self.speculate = False
            elif not self.speculate and gain > cfg.threshold + cfg.hysteresis:
                self.speculate = True
            self.last_reason = "measured"
        else:
            if self.speculate and self._batch > cfg.fallback_max_batch + cfg.fallback_hysteresis_requests:
                self.speculate = False
            elif not self.speculate and self._batch < cfg.fallback_max_batch - cfg.fallback_hysteresis_requests:
                self.speculate = True
            self.last_reason = "fallback"
        if cfg.explore_every and self._windows % cfg.explore_every == 0:
            self._exploring = True
            self._explore_from = self.speculate
            self.speculate = not self.speculate
            self.last_reason += "+explore"

    # ------------------------------------------------------------------ reporting
    @property
    def current_threshold_batch(self) -> float | None:
        """The batch size above which speculation stops paying, from the curve (or None)."""
        if self.expected_gain(1) is None:
            return None
        lo_gain = self.expected_gain(1)
        if lo_gain is None or lo_gain <= self.config.threshold:
            return 0.0
        b = 1.0
        while b < 4096:
            g = self.expected_gain(b * 2)
            if g is None:
                return None
            if g <= self.config.threshold:
                return b * 2
            b *= 2
        return math.inf

    def stats(self) -> dict[str, Any]:
        return {
            "speculating": self.speculate,
            "spec_step_fraction": self.spec_steps / self.steps if self.steps else 0.0,
            "expected_gain": self.last_gain,
            "decision_reason": self.last_reason,
            "batch_ewma": self._batch,
            "accepted_per_request_step": self._accepted_per_req,
            "drafted_per_request_step": self._drafted_per_req,
            "threshold": self.config.threshold,
            "threshold_batch": self.current_threshold_batch,
            "decisions": self.decisions,
            "steps": self.steps,
            "config": asdict(self.config),
        }
