"""The load-aware speculation switch, driven by synthetic step-latency curves."""

from __future__ import annotations

import numpy as np
import pytest

from war_openrlhf.engine.spec_switch import LatencyTable, SpecSwitch, SpecSwitchConfig


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
        switch.observe(batch, drafted, accepted, seconds, speculating=on)
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
    # a fallback rule (batch <= 8) would say "speculate" at batch 1; measurements overrule it
    switch = SpecSwitch()
    assert drive(switch, compute_bound, batch=1, steps=800) < 0.15
    assert switch.last_gain is not None and switch.last_gain < 1.0
    assert switch.stats()["threshold_batch"] == 1.0


def test_load_change_flips_the_decision_both_ways():
    switch = SpecSwitch()
    assert drive(switch, memory_bound, batch=2, steps=600) > 0.85
    assert drive(switch, memory_bound, batch=64, steps=600, seed=1) < 0.15
    assert drive(switch, memory_bound, batch=2, steps=600, seed=2) > 0.85


def test_hysteresis_holds_the_state_near_the_threshold():
    """gain ~ 1.1 lies inside [0.8, 1.2]: whichever state the switch is in, it stays."""
    curve = lambda n: 0.01 if n <= 4 else 0.01 * (1 + 0.1 * 2 / 32 * n)  # noqa: E731
    for start in (True, False):
        switch = SpecSwitch(SpecSwitchConfig(hysteresis=0.2, explore_every=0))
        for on in (True, False):  # calibrate both sides at batch 4
            for _ in range(5):
                switch.observe(4, 32 if on else 0, 4 if on else 0, 0.0191 if on else 0.01, speculating=on)
        switch._decided = switch.speculate = start
        for _ in range(40):
            on = switch.speculate
            switch.observe(4, 32 if on else 0, 4 if on else 0, 0.0191 if on else 0.01, speculating=on)
        assert 0.8 < switch.last_gain < 1.2
        assert switch.speculate is start


def test_fallback_rule_without_calibration_and_exploration_afterwards():
    cfg = SpecSwitchConfig(fallback_max_batch=8, explore_every=4, window_steps=4, calibrate=False)
    switch = SpecSwitch(cfg)
    for _ in range(8):
        switch.observe(32, 0, 0, 0.01, speculating=False)  # high load, nothing measured with drafts
    assert not switch.speculate and switch.stats()["decision_reason"].startswith("fallback")
    seen_on = False
    for _ in range(64):
        on = switch.speculate
        seen_on |= on
        switch.observe(32, 256 if on else 0, 32 if on else 0, 0.01, speculating=on)
    assert seen_on  # exploration windows measured the other side
    point = [p for p in switch.table.points() if p["batch"] == 32][0]
    assert point["drafted_per_request_step"] == pytest.approx(8.0) and point["samples_on"] > 0


def test_calibration_measures_both_sides_before_deciding():
    switch = SpecSwitch(SpecSwitchConfig(window_steps=2, min_samples=2, explore_every=0))
    reasons = []
    for _ in range(40):
        on = switch.speculate
        switch.observe(2, 16 if on else 0, 3 if on else 0, memory_bound(2 + (16 if on else 0)), speculating=on)
        reasons.append(switch.last_reason)
    assert "calibrating" in reasons and reasons[-1] == "measured"
    # 3 accepted over 2 requests: 1.5 per request-step
    assert switch.expected_gain(2) == pytest.approx(2.5 * memory_bound(2) / memory_bound(18))


def test_disabled_switch_never_speculates():
    switch = SpecSwitch(SpecSwitchConfig(enabled=False))
    assert drive(switch, memory_bound, batch=1, steps=200) == 0.0


def test_latency_table_ignores_idle_gaps_and_needs_both_sides():
    table = LatencyTable(ewma=1.0, min_samples=1)
    table.observe(4, False, 1.0)
    assert table.gain(4) is None
    table.observe(4, True, 2.0, accepted=3.0, drafted=8.0)
    assert table.gain(4) == pytest.approx(4.0 * 1.0 / 2.0)
    table.observe(4, False, 100.0)  # a 100x outlier is an idle gap
    assert table.gain(4) == pytest.approx(2.0)
    assert table.gain(64) is None


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
