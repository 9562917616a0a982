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


# ---------------------------------------------------------------- rule "model": one step curve
from war_openrlhf.engine.step_cost import StepCurve  # noqa: E402


def test_step_curve_against_brute_force_interpolation():
    """The curve equals linear interpolation between its bins' (tokens, seconds), flat below the
    smallest bin and continued by the last slope above the largest, at every point probed."""
    rng = np.random.default_rng(3)
    curve = StepCurve(ewma=1.0, min_samples=1)
    truth = {}
    for n in sorted(set(int(x) for x in rng.integers(1, 2000, size=40))):
        t = 0.002 + 0.00003 * n + (0.0 if n < 500 else 0.00001 * (n - 500))
        if curve.observe(n, t):
            b = int(round(2 * np.log2(n)))
            truth[b] = (n, t)  # ewma 1: a bin holds its last step
    pts = sorted(truth.values())
    xs, ys = np.array([p[0] for p in pts], float), np.array([p[1] for p in pts], float)
    for q in [0.5, 1, 3, 17, 250, 999, 1999, 5000]:
        if q <= xs[0]:
            want = ys[0]
        elif q >= xs[-1]:
            want = ys[-1] + max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0) * (q - xs[-1])
        else:
            want = float(np.interp(q, xs, ys))
        assert curve.seconds(q) == pytest.approx(want, rel=1e-9)
    assert curve.covers(xs[0] / 2) and not curve.covers(xs[-1] * 2.1)


def test_step_curve_slope_is_the_price_of_a_draft_token():
    cpu, gpu = StepCurve(ewma=1.0, min_samples=1), StepCurve(ewma=1.0, min_samples=1)
    for n in (1, 2, 4, 8, 16, 32, 64, 128):
        cpu.observe(n, compute_bound(n))
        gpu.observe(n, memory_bound(n))
    assert cpu.slope(10) == pytest.approx(0.0005)
    assert gpu.slope(10) == pytest.approx(0.0)
    assert gpu.slope(100) == pytest.approx(0.0002 * (128 - 64) / (128 - 64 * 2 ** 0.0), rel=0.6)


def test_cost_aware_drafts_are_short_on_a_compute_bound_engine_and_long_on_a_memory_bound_one():
    thresholds = {}
    for name, curve in (("cpu", lambda n: 0.004 + 0.0005 * n), ("gpu", memory_bound)):
        switch = SpecSwitch(SpecSwitchConfig(explore_every=4))
        for _ in range(300):
            on = switch.speculate
            drafted = 2 * 6 if on else 0
            switch.observe(2, drafted, 3 if on else 0, curve(2 + drafted), speculating=on, estimated=4.0 if on else None)
        thresholds[name] = switch.min_token_prob
    # gpu: the slope is ~0 below the roofline -> the floor; cpu: c * R / rho, well above it
    assert thresholds["gpu"] == pytest.approx(SpecSwitchConfig().min_token_prob_floor)
    rate = 2.5 * 2 / (0.004 + 0.0005 * 14)  # (1 + a) * b / T_on
    assert thresholds["cpu"] == pytest.approx(min(0.0005 * rate / 0.75, 1.0), rel=0.1)


def test_a_tail_through_falling_batches_is_not_spent_re_measuring():
    """A synchronous step's tail: the batch falls 64 -> 1 on a memory-bound engine. Priced by one
    curve, the switch spends few steps with drafting off where it pays (exploration only); a
    table per batch bucket calibrates every bucket the tail passes through."""
    def tail(rule):
        switch = SpecSwitch(SpecSwitchConfig(rule=rule))
        off_where_it_pays = steps = 0
        for batch in [64] * 200 + [b for b in (32, 24, 16, 12, 8, 6, 4, 3, 2, 1) for _ in range(40)]:
            on = switch.speculate
            drafted = batch * 8 if on else 0
            switch.observe(batch, drafted, batch * 3 if on else 0, memory_bound(batch + drafted),
                           speculating=on, estimated=batch * 4.0 if on else None)
            if batch <= 6:  # 3.5x more tokens a step for at most 1.0x the time: drafting pays
                steps += 1
                off_where_it_pays += not on
        return off_where_it_pays / steps
    model, buckets = tail("model"), tail("buckets")
    assert model <= 0.1, model
    assert model < buckets


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 10.0), st.integers(1, 20)), min_size=1, max_size=9))
def test_isotonic_fit_equals_the_min_max_formula(points):
    """Pool adjacent violators against the brute-force characterisation of the weighted isotonic
    fit: f(i) = max over j <= i of min over k >= i of the weighted mean of values j..k."""
    from war_openrlhf.engine.step_cost import _isotonic

    values, weights = [p[0] for p in points], [p[1] for p in points]
    got = _isotonic(values, weights)

    def mean(j, k):
        return sum(values[t] * weights[t] for t in range(j, k + 1)) / sum(weights[j:k + 1])

    n = len(values)
    want = [max(min(mean(j, k) for k in range(i, n)) for j in range(i + 1)) for i in range(n)]
    assert got == pytest.approx(want, abs=1e-9)


def test_a_noisy_curve_is_fitted_monotone_and_its_slope_is_not_a_neighbour_difference():
    curve = StepCurve(ewma=1.0, min_samples=1)
    truth = lambda n: 0.010 + 0.0003 * n  # noqa: E731
    noise = {1: 1.3, 2: 0.8, 3: 1.0, 4: 1.4, 6: 0.8, 8: 1.1, 11: 0.85, 16: 1.2, 23: 0.9, 32: 1.0}
    for n, f in noise.items():
        curve.observe(n, truth(n) * f)
    fitted = [b.seconds for b in curve.known()]
    assert fitted == sorted(fitted)
    assert 0.0 <= curve.slope(8) <= 0.002  # raw neighbours differ by up to 0.004 s per token


def drive_noisy(switch: SpecSwitch, steps: int, seed: int) -> tuple[float, int]:
    """Low load as an agentic rollout's tail sees it: batch 1-4, each request-step drafting 0-4
    tokens and accepting 0-2 of them (mean 0.83), step times +-50% around a slow CPU step: drafting
    pays ~1.4x on average, a single step says little. Returns (drafting fraction, explorations)."""
    rng = np.random.default_rng(seed)
    on_steps = 0
    for _ in range(steps):
        b = int(rng.choice([1, 1, 2, 2, 3, 4]))
        on = switch.speculate
        drafted = int(rng.integers(0, 5, size=b).sum()) if on else 0
        accepted = min(drafted, int(np.minimum(2, rng.choice([0, 0, 0, 1, 2, 3], size=b)).sum())) if on else 0
        seconds = (0.010 + 0.0008 * (b + drafted)) * float(rng.uniform(0.6, 1.8))
        switch.observe(b, drafted, accepted, seconds, speculating=on)
        on_steps += on
    explorations = sum(n for reason, n in switch.reasons.items() if reason.endswith("+explore"))
    return on_steps / steps, explorations


@pytest.mark.parametrize("seed", range(4))
def test_noisy_low_load_keeps_drafting_on(seed):
    # an EWMA of per-step acceptance (the earlier estimate) let single bad steps turn drafting off
    # for whole exploration intervals: 81-88% of steps drafted on this workload
    fraction, _ = drive_noisy(SpecSwitch(), 3000, seed)
    assert fraction > 0.95


def test_exploration_backs_off_while_it_confirms_and_resets_when_it_does_not():
    switch = SpecSwitch()
    _, explored = drive_noisy(switch, 3000, seed=0)  # 375 windows: every 16th would be 23
    assert 1 <= explored <= 6
    assert switch._explore_interval > switch.config.explore_every
    # the workload turns against drafting (high batch, compute-bound): the decision flips by
    # measurement, and the flipped decision is re-checked at the configured rate, not backed off
    # (while drafting is off, exploring is the only measure of what drafts would be accepted)
    flipped_at = None
    on_late = 0
    for step in range(1500):
        on = switch.speculate
        drafted = 64 if on else 0
        switch.observe(32, drafted, 2 if on else 0, 0.0005 * (32 + drafted), speculating=on)
        if flipped_at is None and not switch.speculate and switch.last_reason == "measured":
            flipped_at = step
            assert switch._explore_interval == switch.config.explore_every
        on_late += on and step >= 500
    assert flipped_at is not None and flipped_at < 100
    assert switch._explore_interval == switch.config.explore_every
    assert on_late / 1000 < 0.15  # exploration windows only


def test_exploring_text_nothing_drafts_from_backs_off_and_draftable_text_is_rechecked_as_configured():
    """Drafts never accepted (a model whose text the index cannot draft): an exploration that
    confirms drafting off backs off, since no step cost could make 1 + 0 tokens pay; drafts accepted
    but too costly (a compute-bound batch) keep the configured rate: a smaller batch could pay."""
    def explorations(accepted_per_request: float) -> tuple[int, int]:
        switch = SpecSwitch()
        for _ in range(4000):
            on = switch.speculate
            drafted = 4 * 3 if on else 0
            accepted = int(round(4 * accepted_per_request)) if on else 0
            switch.observe(4, drafted, accepted, 0.0005 * (4 + drafted), speculating=on)
        assert not switch.speculate or switch.last_reason.endswith("+explore")
        return sum(n for reason, n in switch.reasons.items() if reason.endswith("+explore")), switch._explore_interval

    windows = 4000 // SpecSwitchConfig().window_steps
    nothing, interval = explorations(0.0)
    assert nothing <= 8 and interval == 8 * SpecSwitchConfig().explore_every
    costly, interval = explorations(0.5)  # 1.5 tokens for 4x the step: off, but not hopeless
    assert costly >= windows // (SpecSwitchConfig().explore_every + 1) - 2
    assert interval == SpecSwitchConfig().explore_every


def _spiky(rng, seconds: float) -> float:
    """A step as a shared CPU core times it: +-10% jitter, and now and then (3% of steps) 5-10x
    (another process ran; seen on the CPU engines as 6-12 ms steps among 1 ms ones)."""
    slow = float(rng.uniform(5, 10)) if rng.random() < 0.03 else 1.0
    return seconds * float(rng.uniform(0.9, 1.1)) * slow


@pytest.mark.parametrize("seed", range(4))
def test_rare_slow_steps_move_neither_the_curve_nor_the_price_of_a_draft_token(seed):
    rng = np.random.default_rng(seed)
    curve = StepCurve()
    truth = lambda n: 0.0008 + 0.00005 * n  # noqa: E731  (CPU-like: every token costs)
    for _ in range(3000):
        n = int(rng.choice([1, 2, 3, 4, 6, 8, 12, 16, 24, 32]))
        curve.observe(n, _spiky(rng, truth(n)))
    for b in curve.known():
        assert b.seconds == pytest.approx(truth(b.tokens), rel=0.1), b
    assert curve.slope(8) == pytest.approx(0.00005, rel=0.3)


@pytest.mark.parametrize("seed", range(4))
def test_rare_slow_steps_do_not_turn_paying_drafts_off(seed):
    # batch 4, drafting 2 tokens per request and accepting 1: (1 + 1) * T(4) / T(12) = 1.7x
    rng = np.random.default_rng(seed)
    switch = SpecSwitch()
    on_steps = 0
    for _ in range(3000):
        on = switch.speculate
        drafted = 8 if on else 0
        switch.observe(4, drafted, 4 if on else 0, _spiky(rng, 0.0008 + 0.00005 * (4 + drafted)), speculating=on)
        on_steps += on
    assert on_steps / 3000 > 0.97


def test_a_stall_is_refused_but_a_lasting_change_of_cost_is_followed():
    curve = StepCurve(ewma=0.2, min_samples=3)
    for _ in range(20):
        curve.observe(8, 0.001)
    # a young bin (16 tokens) refuses a first step costing over 2x the per-token rate of the
    # 8-token bin (a stall), and takes one that costs what 16 tokens cost
    assert not curve.observe(16, 0.005) and curve.stalls == 1
    assert curve.observe(16, 0.0018)
    # a measured bin refuses a 5x step ...
    assert not curve.observe(8, 0.005)
    assert curve.bins[_bin_of(8)].seconds == pytest.approx(0.001)
    # ... but a cost that stays 5x (longer contexts, another tenant) is taken after half a span
    taken = [curve.observe(8, 0.005) for _ in range(curve.span)]
    half = curve.span // 2
    # the half-th outlier in a row (one came before the loop) restarts the bin at the new cost
    assert taken[: half - 2] == [False] * (half - 2) and all(taken[half - 2:])
    assert curve.bins[_bin_of(8)].seconds == pytest.approx(0.005)


def _bin_of(tokens):
    from war_openrlhf.engine.step_cost import _bin

    return _bin(tokens)


def test_the_drafters_own_time_is_priced_per_request_not_per_token():
    """A memory-bound step curve where the verified tokens ride almost free, but proposing the
    drafts costs 0.4 ms per request: at batch 32 that makes a drafting step 12.8 ms longer, and
    drafting 2 tokens to get 1 no longer pays ((1 + 1) * T(32) / (T(96) + 12.8 ms) = 0.8). Told the
    drafter's time, the switch turns drafting off; at batch 2 (0.8 ms of drafter) it keeps it on."""
    def step(n):
        return 0.010 + 0.0001 * n

    def run(batch, told):
        switch = SpecSwitch()
        on_steps = 0
        for _ in range(2000):
            on = switch.speculate
            drafted = 2 * batch if on else 0
            drafter = 0.0004 * batch if on else 0.0
            switch.observe(batch, drafted, batch if on else 0, step(batch + drafted) + drafter, speculating=on,
                           drafter_seconds=drafter if told else 0.0)
            on_steps += on
        return on_steps / 2000, switch

    off_fraction, switch = run(32, told=True)
    assert off_fraction < 0.15, switch.stats()
    assert switch.stats()["drafter_seconds_per_request_step"] == pytest.approx(0.0004, rel=0.01)
    # the curve keeps the forward pass alone, so a batch of 96 without drafts is priced right
    assert switch.curve.seconds(96) == pytest.approx(step(96), rel=0.05)
    assert run(32, told=False)[1].curve.seconds(96) > 1.5 * step(96)  # the drafter read as token cost
    assert run(2, told=True)[0] > 0.9
