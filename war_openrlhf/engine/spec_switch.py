"""Load-aware speculation switch: speculate only while it pays, decided from measurements;
and, from the same measurements, how sure a drafted token must be to be worth verifying.

Why: a draft of ``k`` tokens is verified in the same forward pass as the real token.
At low load decode is memory-bound and the extra tokens ride along almost free; at
high load (or on a CPU, where the forward pass is compute-bound) each verified token
costs real time and speculation slows the engine down. Which regime an engine is in
depends on the model, the hardware, the batch and the contexts, so it is measured,
not configured.

Model. Speculation emits ``1 + a`` tokens per request-step instead of 1 (``a``: accepted
draft tokens per request-step), so the expected gain at batch ``b`` is

    gain(b) = (1 + a) * T_off(b) / T_on(b)

``rule: model`` (default) prices both sides with one :class:`~.step_cost.StepCurve`, step
seconds over the query tokens a step carries, less the drafter's own time: ``T_off(b) = T(b)``,
``T_on(b) = T(b + d*b) + b * g`` (``d``: draft tokens per request-step, ``a``: ratios of decayed
sums over drafting steps, ``g``: the drafter's seconds per request-step, likewise; the drafter's
work grows with the requests, not the tokens, and at batch 32 on a CPU it is a real share of a
step, which a curve of tokens alone priced as free), fed by steps of
both sides, so a batch the engine has not run at is priced from its neighbours. Outside the
measured range the curve gives bounds (a step costs no more for fewer tokens and no less per
token for more); only when the bounds straddle the threshold is the missing side measured. ``rule: buckets`` keeps an EWMA of ``T_on``,
``T_off`` and ``a`` per batch bucket (log-spaced, two per doubling), each bucket
calibrated on both sides before it decides.

Draft length (``cost_aware_drafts``). A drafted token whose chain the index estimates at
probability ``p`` (arctic's ``prob``: the product of count ratios along the path, so ``p`` is
the chance that it and every token before it are accepted) adds ``rho * p`` expected tokens
(``rho``: measured accepted / estimated, over recent drafts) for ``c`` seconds, while the
step produces ``R = (1 + a) * b / T_on`` tokens a second. It pays iff
``rho * p / c > R``, so drafts stop at ``min_token_prob = c * R / rho`` (at least
``min_token_prob_floor``): short on a compute-bound CPU, long on a memory-bound GPU,
derived from measurements rather than set per device.

Speculation stays on while ``gain > threshold + hysteresis`` and goes off when
``gain < threshold - hysteresis``. A bucket missing one side is calibrated by running
that side for a window (``calibrate``), or, with calibration off, decided by the
fallback rule: speculate iff the batch is at most ``fallback_max_batch`` (same
hysteresis, in requests). After ``explore_every`` windows the other side runs for one
window, so estimates follow the workload; each exploration that confirms a decision to draft
doubles the interval (up to 8x); while drafting is off (exploring is then the only measure of
acceptance), after one that changes the decision, or a change by measurement, it is the
configured one, except while the measured acceptance per request-step stays within the
hysteresis (``1 + a <= threshold + hysteresis``: no step cost could make drafting pay, text
the index cannot draft), when confirmations double it as well (each exploration restarts the
requests' drafter state: on text nothing drafts, that was the switch's whole cost).
Acceptance per request-step is a ratio of decayed sums over drafting steps, not an EWMA of
per-step ratios (one step at batch 1 accepts 0..K tokens: such an EWMA swung the gain across
the threshold on noise, and drafting stayed off until the next exploration). Decisions are taken once per
``window_steps`` steps, from the window's mean batch. The first ``settle_steps`` steps
after a change of side are not measured: they still carry the other side's state
(requests restarting their draft trees, drafts proposed before the change).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ..config_checks import check_int, check_number
from .step_cost import StepCurve

RULES = ("model", "buckets")


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
    calibrate: bool = True
    settle_steps: int = 2
    enabled: bool = True  # False: never speculate (a kill switch, not a load rule)
    rule: str = "model"
    cost_aware_drafts: bool = True
    min_token_prob_floor: float = 0.05

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"SpecSwitchConfig.rule: must be one of {', '.join(RULES)}, got {self.rule!r}")
        check_number("SpecSwitchConfig", "min_token_prob_floor", self.min_token_prob_floor, ge=0, le=1)
        for name in ("window_steps", "min_samples"):
            check_int("SpecSwitchConfig", name, getattr(self, name), 1)
        for name in ("fallback_max_batch", "fallback_hysteresis_requests", "explore_every", "settle_steps"):
            check_int("SpecSwitchConfig", name, getattr(self, name), 0)
        check_number("SpecSwitchConfig", "threshold", self.threshold, gt=0)
        check_number("SpecSwitchConfig", "hysteresis", self.hysteresis, ge=0)
        if self.hysteresis >= self.threshold:
            raise ValueError(f"SpecSwitchConfig.hysteresis: must be below threshold ({self.threshold}), "
                             f"got {self.hysteresis!r}")
        check_number("SpecSwitchConfig", "ewma", self.ewma, gt=0, le=1)


def _bucket(batch: float) -> int:
    """Two buckets per doubling of the batch: 1, 1.4, 2, 2.8, 4, ..."""
    return int(round(2 * math.log2(max(batch, 1.0))))


def _bucket_batch(b: int) -> float:
    return 2.0 ** (b / 2)


@dataclass
class _Arm:
    """EWMA of one side (speculating or not) in one batch bucket."""

    seconds: float = 0.0
    accepted: float = 0.0  # accepted draft tokens per request-step
    drafted: float = 0.0  # draft tokens per request-step
    samples: int = 0

    def add(self, seconds: float, accepted: float, drafted: float, ewma: float) -> None:
        if self.samples == 0:
            self.seconds, self.accepted, self.drafted = seconds, accepted, drafted
        else:
            self.seconds += ewma * (seconds - self.seconds)
            self.accepted += ewma * (accepted - self.accepted)
            self.drafted += ewma * (drafted - self.drafted)
        self.samples += 1


@dataclass
class LatencyTable:
    """Step latency per (batch bucket, speculating) and acceptance while speculating."""

    ewma: float = 0.2
    min_samples: int = 3
    arms: dict[tuple[int, bool], _Arm] = field(default_factory=dict)

    def observe(self, batch: int, speculating: bool, seconds: float, accepted: float = 0.0,
                drafted: float = 0.0) -> None:
        if batch <= 0 or not seconds > 0 or not math.isfinite(seconds):
            return
        arm = self.arms.setdefault((_bucket(batch), speculating), _Arm())
        if arm.samples >= self.min_samples and seconds > 10 * arm.seconds:
            return  # an idle gap or a hiccup, not a step
        arm.add(seconds, accepted, drafted, self.ewma)

    def ready(self, batch: float, speculating: bool) -> bool:
        arm = self.arms.get((_bucket(batch), speculating))
        return arm is not None and arm.samples >= self.min_samples

    def gain(self, batch: float) -> float | None:
        b = _bucket(batch)
        on, off = self.arms.get((b, True)), self.arms.get((b, False))
        if on is None or off is None or min(on.samples, off.samples) < self.min_samples:
            return None
        return (1.0 + on.accepted) * off.seconds / on.seconds

    def points(self) -> list[dict[str, float]]:
        """Per bucket: batch, seconds off/on, accepted and drafted per request-step, gain."""
        out = []
        for b in sorted({k[0] for k in self.arms}):
            on, off = self.arms.get((b, True)), self.arms.get((b, False))
            out.append({
                "batch": _bucket_batch(b),
                "seconds_off": off.seconds if off else None,
                "seconds_on": on.seconds if on else None,
                "accepted_per_request_step": on.accepted if on else None,
                "drafted_per_request_step": on.drafted if on else None,
                "samples_off": off.samples if off else 0,
                "samples_on": on.samples if on else 0,
                "gain": self.gain(_bucket_batch(b)),
            })
        return out


class SpecSwitch:
    """Per-engine run-time decision: speculate on the next steps or not.

    Feed it every engine step with :meth:`observe`; read :attr:`speculate`.
    """

    def __init__(self, config: SpecSwitchConfig | None = None) -> None:
        self.config = config or SpecSwitchConfig()
        self.table = LatencyTable(self.config.ewma, self.config.min_samples)
        self.curve = StepCurve(self.config.ewma, self.config.min_samples)
        # decayed sums over drafting steps (see observe): accepted and drafted tokens, request-steps
        self._acc_sum = self._draft_sum = self._req_sum = 0.0
        self._drafter_sum = 0.0  # decayed seconds the drafter itself took in drafting steps
        self._drafter_per_req = 0.0  # ... per request-step: what drafting adds beyond the forward pass
        self._accepted_per_req: float | None = None  # their ratios: per request-step
        self._drafted_per_req = 0.0
        self._explore_interval = self.config.explore_every  # windows; doubles while exploring confirms
        self._next_explore = self.config.explore_every
        self._exploring: bool | None = None  # the decision an exploration window is checking
        self._estimated = 0.0  # decayed sums: tokens the index expected to be accepted / accepted
        self._accepted = 0.0
        self.min_token_prob: float | None = None  # None: the index's own min_token_prob
        self.speculate = self.config.enabled
        self._window_batch = 0.0
        self._steps_in_window = 0
        self._windows = 0
        self._override: bool | None = None  # calibration / exploration window in progress
        self._decided = self.speculate  # the rule's decision, outside those windows
        self._last_side: bool | None = None
        self._settling = 0
        self.last_gain: float | None = None
        self.last_reason = "start"
        self.steps = 0
        self.spec_steps = 0
        self.decisions = 0
        self.reasons: dict[str, int] = {}  # decisions by reason (measured, bounded, calibrating, ...+explore)

    # ------------------------------------------------------------------ inputs
    def observe(self, requests: int, drafted: int, accepted: int, seconds: float,
                speculating: bool | None = None, estimated: float | None = None,
                drafter_seconds: float = 0.0) -> None:
        """One engine step: ``requests`` decoded, ``drafted`` draft tokens verified
        (summed over requests), ``accepted`` of them accepted, in ``seconds``.
        ``speculating``: whether drafting was on for this step (default: drafted > 0);
        a step with drafting on that found no draft still counts as speculating.
        ``estimated``: the accepted tokens the index expected of those drafts (the sum of
        their chain probabilities), which calibrates the draft rule. ``drafter_seconds``: the part
        of ``seconds`` the drafter itself took (proposing the drafts): the step curve prices query
        tokens, and the drafter's cost grows with the requests, not the tokens, so it is kept
        apart and added back per request when a drafting step is priced."""
        if requests <= 0:
            return
        self.steps += 1
        if speculating is None:
            speculating = drafted > 0
        if drafted > 0:
            self.spec_steps += 1
        if speculating != self._last_side:
            self._last_side, self._settling = speculating, self.config.settle_steps
        if self._settling > 0:
            self._settling -= 1  # the first steps after a change carry the other side's state
        else:
            self.table.observe(requests, speculating, seconds, accepted / requests, drafted / requests)
            self.curve.observe(requests + drafted, max(seconds - drafter_seconds, 1e-9))
        if speculating:
            w = self.config.ewma
            # Ratios of decayed sums, not an EWMA of per-step ratios: one step at batch 1 accepts
            # 0..K tokens, and an EWMA of that swings the gain across the threshold on noise alone
            # (drafting then stays off until the next exploration, since off-steps teach nothing
            # about acceptance). Memory ~4/ewma steps, each weighted by its requests.
            keep = 1.0 - w / 4
            self._acc_sum = self._acc_sum * keep + accepted
            self._draft_sum = self._draft_sum * keep + drafted
            self._req_sum = self._req_sum * keep + requests
            self._drafter_sum = self._drafter_sum * keep + max(drafter_seconds, 0.0)
            self._accepted_per_req = self._acc_sum / self._req_sum
            self._drafted_per_req = self._draft_sum / self._req_sum
            self._drafter_per_req = self._drafter_sum / self._req_sum
            if estimated is not None and drafted > 0:
                self._estimated = self._estimated * keep + float(estimated)
                self._accepted = self._accepted * keep + float(accepted)
        self._window_batch += requests
        self._steps_in_window += 1
        if self._steps_in_window >= self.config.window_steps:
            self._decide(self._window_batch / self._steps_in_window)
            self._window_batch = 0.0
            self._steps_in_window = 0

    # ------------------------------------------------------------------ decision
    def expected_gain(self, batch: float) -> float | None:
        """Throughput with speculation / without, at ``batch`` requests; None if unknown."""
        if self.config.rule == "buckets":
            return self.table.gain(batch)
        bounds = self.gain_bounds(batch)
        return None if bounds is None or bounds[0] != bounds[1] else bounds[0]

    def gain_bounds(self, batch: float) -> tuple[float, float] | None:
        """Rule model: ``(low, high)`` bounds on the gain at ``batch``; equal where the step curve
        covers both token counts, apart where one lies outside the measured range (the
        decision then needs measuring only if the bounds straddle the threshold)."""
        if self._accepted_per_req is None:
            return None
        off = self.curve.bounds(batch)
        on = self.curve.bounds(batch * (1.0 + self._drafted_per_req))
        drafter = batch * self._drafter_per_req
        if off is None or on is None or not (off[0] > 0 and on[0] > 0):
            return None
        emitted = 1.0 + self._accepted_per_req
        return emitted * off[0] / (on[1] + drafter), emitted * off[1] / (on[0] + drafter)

    @property
    def calibration(self) -> float | None:
        """Accepted draft tokens / the tokens the index expected (recent drafts); None: none yet."""
        if self._estimated < 1.0:
            return None
        return self._accepted / self._estimated

    def draft_threshold(self, batch: float) -> float | None:
        """``min_token_prob`` at which one more draft token stops paying at ``batch`` (see module
        docstring); None until the drafting side is measured."""
        cfg = self.config
        if not cfg.cost_aware_drafts or self._accepted_per_req is None:
            return None
        on_tokens = batch * (1.0 + self._drafted_per_req)
        t_on, cost = self.curve.seconds(on_tokens), self.curve.slope(on_tokens)
        if t_on is not None:
            t_on += batch * self._drafter_per_req
        if t_on is None or cost is None or not t_on > 0:
            return None
        rate = (1.0 + self._accepted_per_req) * batch / t_on  # tokens a second
        rho = self.calibration
        rho = 1.0 if rho is None else min(max(rho, 0.05), 1.0)
        return min(max(cost * rate / rho, cfg.min_token_prob_floor), 1.0)

    def _decide(self, batch: float) -> None:
        cfg = self.config
        decided_before = self._decided
        self.decisions += 1
        self._windows += 1
        self._override = None
        if not cfg.enabled:
            self.speculate = self._decided = False
            self.last_reason = "disabled"
            return
        gain = self.expected_gain(batch)
        self.last_gain = gain
        self.min_token_prob = self.draft_threshold(batch)
        bounds = self.gain_bounds(batch) if cfg.rule == "model" and gain is None else None
        if bounds is not None and (bounds[0] > cfg.threshold + cfg.hysteresis
                                   or bounds[1] < cfg.threshold - cfg.hysteresis):
            # outside the measured range, but the decision does not depend on where
            self._decided = bounds[0] > cfg.threshold + cfg.hysteresis
            self.last_reason = "bounded"
        elif gain is not None:
            if self._decided and gain < cfg.threshold - cfg.hysteresis:
                self._decided = False
            elif not self._decided and gain > cfg.threshold + cfg.hysteresis:
                self._decided = True
            self.last_reason = "measured"
        elif cfg.calibrate:
            # run the side not measured yet (rule buckets: in this batch bucket)
            if cfg.rule == "buckets":
                self._override = not self.table.ready(batch, True)
            else:  # drafting first (it measures d and a), then the batch without drafts
                self._override = self._accepted_per_req is None or self.curve.covers(batch)
            self.last_reason = "calibrating"
            # a calibration window measures a side as an exploration would: the next one waits
            self._next_explore = max(self._next_explore, self._windows + self._explore_interval)
        else:
            if self._decided and batch > cfg.fallback_max_batch + cfg.fallback_hysteresis_requests:
                self._decided = False
            elif not self._decided and batch < cfg.fallback_max_batch - cfg.fallback_hysteresis_requests:
                self._decided = True
            self.last_reason = "fallback"
        if self._override is None and cfg.explore_every:
            if self._decided != decided_before and self._exploring is None:
                # the regime changed by measurement: check the new decision at the configured rate
                self._explore_interval = cfg.explore_every
                self._next_explore = self._windows + cfg.explore_every
            if self._exploring is not None:
                # the window after an exploration: a confirmed decision to draft is re-checked half
                # as often (up to 8x explore_every); a decision not to draft, or a changed one, as
                # often as configured: while off, exploring is the only measure of what drafts
                # would be accepted now (a workload that turned draftable shows nowhere else)
                confirmed = self._decided == self._exploring
                # ... except a decision not to draft that no cost could reverse: drafting emits
                # 1 + a tokens for a step no shorter than one without drafts, so while the measured
                # acceptance a stays within the hysteresis no batch makes drafting pay (text the
                # index cannot draft); re-checking it as often as configured is pure cost
                hopeless = (not self._decided and self._accepted_per_req is not None
                            and 1.0 + self._accepted_per_req <= cfg.threshold + cfg.hysteresis)
                self._explore_interval = (min(2 * self._explore_interval, 8 * cfg.explore_every)
                                          if confirmed and (self._decided or hopeless) else cfg.explore_every)
                self._next_explore = self._windows + self._explore_interval
                self._exploring = None
            if self._windows >= self._next_explore:
                self._override = not self._decided
                self._exploring = self._decided
                self.last_reason += "+explore"
        self.speculate = self._decided if self._override is None else self._override
        self.reasons[self.last_reason] = self.reasons.get(self.last_reason, 0) + 1

    # ------------------------------------------------------------------ reporting
    @property
    def current_threshold_batch(self) -> float | None:
        """Smallest batch at which speculation stops paying (None: never seen). Rule buckets: of
        the measured buckets; rule model: of 1, 2, 4, ... 1024, priced by the model."""
        if self.config.rule == "model":
            for b in (2.0 ** i for i in range(11)):
                gain = self.expected_gain(b)
                if gain is None:
                    return None
                if gain <= self.config.threshold:
                    return b
            return None
        for p in self.table.points():
            if p["gain"] is not None and p["gain"] <= self.config.threshold:
                return p["batch"]
        return None

    def stats(self) -> dict[str, Any]:
        return {
            "speculating": self.speculate,
            "spec_step_fraction": self.spec_steps / self.steps if self.steps else 0.0,
            "expected_gain": self.last_gain,
            "decision_reason": self.last_reason,
            "threshold": self.config.threshold,
            "threshold_batch": self.current_threshold_batch,
            "decisions": self.decisions,
            "rule": self.config.rule,
            "decisions_by_reason": dict(self.reasons),
            "min_token_prob": self.min_token_prob,
            "draft_calibration": self.calibration,
            "accepted_per_request_step": self._accepted_per_req,
            "drafted_per_request_step": self._drafted_per_req,
            "drafter_seconds_per_request_step": self._drafter_per_req,
            "step_curve": self.curve.points(),
            "steps": self.steps,
            "spec_steps": self.spec_steps,
            "config": asdict(self.config),
        }
