"""The load-aware speculation switch, driven by synthetic step-latency curves."""

from __future__ import annotations

import numpy as np
import pytest

from war_openrlhf.engine.spec_switch import LatencyCurve, SpecSwitch, SpecSwitchConfig


def memory_bound(n: float) -> float:
    """GPU-like: flat while memory-bound (<= 64 tokens per step), then compute-bound."""
    return 0.010 + 0.0002 * max(0.0, n - 64)


def compute_bound(n: float) -> float:
    """CPU-like: every token costs the same."""
    return 0.0005 * n


def drive(switch: SpecSwitch, curve, batch: int, steps: int, drafted_per_req=8.0, accepted_per_req=1.5, seed=0):
    """Run an engine at a fixed batch; returns the fraction of the last half spent speculating."""
    rng = np.random.default_rng(seed)
    spec = []
    for _ in range(steps):
        on = switch.speculate
        drafted = int(batch * drafted_per_req) if on else 0
        accepted = int(batch * accepted_per_req) if on else 0
        seconds = curve(batch + drafted) * float(rng.uniform(0.95, 1.05))
        switch.observe(batch, drafted, accepted, seconds)
        spec.append(on)
    tail = spec[len(spec) // 2 :]
    return sum(tail) / len(tail)


def test_memory_bound_engine_speculates_at_low_load_and_stops_at_high_load():
    low = SpecSwitch()
    assert drive(low, memory_bound, batch=2, steps=800) > 0.85
    assert low.stats()["decision_reason"].startswith("measured")
    assert low.last_gain > 2.0
    high = SpecSwitch()
    assert drive(high, memory_bound, batch=48, steps=800) < 0.15
    assert high.last_gain < 1.0


def test_compute_bound_engine_learns_that_speculation_never_pays():
    # the fallback rule (batch <= 8) says "speculate" at batch 1; measurements overrule it
    switch = SpecSwitch()
    assert drive(switch, compute_bound, batch=1, steps=800) < 0.15
    assert switch.last_gain is not None and switch.last_gain < 1.0
    assert switch.stats()["threshold_batch"] == 0.0


def test_load_change_flips_the_decision_both_ways():
    switch = SpecSwitch()
    assert drive(switch, memory_bound, batch=2, steps=600) > 0.85
    assert drive(switch, memory_bound, batch=64, steps=600, seed=1) < 0.15
    assert drive(switch, memory_bound, batch=2, steps=600, seed=2) > 0.85


def test_hysteresis_holds_the_state_near_the_threshold():
    cfg = SpecSwitchConfig(hysteresis=0.2, explore_every=0)
    switch = SpecSwitch(cfg)
    switch.speculate = True
    # gain ~ 1.1: inside [0.8, 1.2] -> stays on
    curve = LatencyCurve()
    switch.curve = curve
    for n, t in ((4, 0.01), (36, 0.0191)):
        for _ in range(5):
            curve.observe(n, t)
    for _ in range(50):
        switch.observe(4, 32, 4, 0.0191)
    assert 0.8 < switch.last_gain < 1.2 and switch.speculate
    switch.speculate = False
    for _ in range(50):
        switch.observe(4, 0, 0, 0.01)
    assert not switch.speculate


def test_fallback_rule_before_measurements_and_exploration_afterwards():
    cfg = SpecSwitchConfig(fallback_max_batch=8, explore_every=4, window_steps=4)
    switch = SpecSwitch(cfg)
    for _ in range(8):
        switch.observe(32, 0, 0, 0.01)  # high load, no speculation data yet
    assert not switch.speculate and switch.stats()["decision_reason"].startswith("fallback")
    seen_on = False
    for _ in range(64):
        seen_on |= switch.speculate
        switch.observe(32, 256 if switch.speculate else 0, 32 if switch.speculate else 0, 0.01)
    assert seen_on  # exploration windows measured the other side
    assert switch.stats()["drafted_per_request_step"] == pytest.approx(8.0)


def test_disabled_switch_never_speculates():
    switch = SpecSwitch(SpecSwitchConfig(enabled=False))
    assert drive(switch, memory_bound, batch=1, steps=200) == 0.0


def test_latency_curve_interpolates_and_ignores_idle_gaps():
    curve = LatencyCurve(ewma=1.0, min_samples=1)
    curve.observe(4, 1.0)
    curve.observe(16, 3.0)
    assert curve(4) == 1.0 and curve(16) == 3.0
    assert 1.0 < curve(8) < 3.0
    curve.observe(4, 100.0)  # a 100x outlier is an idle gap
    assert curve(4) == 1.0
    with pytest.raises(LookupError):
        LatencyCurve()(5)


@pytest.mark.parametrize("kw, name", [
    (dict(window_steps=0), "window_steps"),
    (dict(threshold=0), "threshold"),
    (dict(hysteresis=1.5), "hysteresis"),
    (dict(ewma=0), "ewma"),
    (dict(fallback_max_batch=-1), "fallback_max_batch"),
])
def test_bad_switch_config_is_named(kw, name):
    with pytest.raises(ValueError, match=f"SpecSwitchConfig.{name}"):
        SpecSwitchConfig(**kw)
