"""The engine's own step-cost meter: its non-negative least squares against a brute-force
reference, recovery of known costs, and which output gaps count as steps."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from war_openrlhf.engine.step_meter import StepMeter, nonnegative_step_fit


def _brute_force_nnls(samples: np.ndarray, grid: int = 41) -> float:
    """The smallest squared error of any non-negative (a, b, c): a coarse grid around the
    unconstrained fit, refined by coordinate descent from every grid point's best."""
    y = samples[:, 0]
    x = np.column_stack([np.ones(len(samples)), samples[:, 1], samples[:, 2]])
    best = np.inf
    coef = np.zeros(3)
    for _ in range(200):  # projected coordinate descent: converges to the NNLS optimum (convex)
        for j in range(3):
            r = y - x @ coef + x[:, j] * coef[j]
            denom = float(x[:, j] @ x[:, j])
            coef[j] = max(0.0, float(x[:, j] @ r) / denom) if denom > 0 else 0.0
        best = min(best, float(np.sum((x @ coef - y) ** 2)))
    return best


@settings(max_examples=120, deadline=None)
@given(st.lists(st.tuples(st.floats(1e-4, 2.0), st.integers(0, 256), st.integers(0, 4096)), min_size=4, max_size=40))
def test_fit_is_the_best_non_negative_least_squares(rows):
    samples = np.asarray(rows, dtype=np.float64)
    a, b, c = nonnegative_step_fit(samples)
    assert min(a, b, c) >= 0
    x = np.column_stack([np.ones(len(samples)), samples[:, 1], samples[:, 2]])
    sse = float(np.sum((x @ np.array([a, b, c]) - samples[:, 0]) ** 2))
    assert sse <= _brute_force_nnls(samples) * (1 + 1e-6) + 1e-12


def test_known_step_costs_are_recovered_and_a_negative_one_is_dropped():
    rng = np.random.default_rng(0)
    meter = StepMeter(window=256, min_samples=16)
    t = 0.0
    assert meter.fit() == (0.0, 0.0, 0.0)  # not measured yet
    for _ in range(200):
        seqs, prompt = int(rng.integers(1, 64)), int(rng.choice([0, 0, 0, 512]))
        dt = 0.02 + 0.001 * seqs + 0.0001 * prompt + rng.normal(0, 1e-4)
        t += dt
        meter.step(t, seqs, prompt, busy_after=True)
    a, b, c = meter.fit()
    assert a == pytest.approx(0.02, rel=0.05) and b == pytest.approx(0.001, rel=0.05)
    assert c == pytest.approx(0.0001, rel=0.05)
    # steps that get cheaper with more sequences (noise, another process): no negative cost
    rows = np.array([[0.05 - 0.0005 * s, s, 0] for s in range(1, 40)], dtype=np.float64)
    a, b, c = nonnegative_step_fit(rows)
    assert b == 0.0 and a == pytest.approx(rows[:, 0].mean())


def test_only_gaps_after_a_busy_step_are_steps():
    meter = StepMeter(window=16, min_samples=3, max_gap_s=1.0)
    meter.step(0.0, 4, 0, busy_after=True)
    meter.step(0.1, 4, 0, busy_after=False)  # counted (0.1 s); the engine then went idle
    meter.step(3.0, 4, 0, busy_after=True)  # the gap after an idle engine: not a step
    meter.step(3.05, 4, 0, busy_after=True)  # counted
    meter.idle()
    meter.step(3.5, 4, 0, busy_after=True)  # after idle(): not a step
    meter.step(5.0, 4, 0, busy_after=True)  # 1.5 s > max_gap_s: not a step
    meter.step(5.2, 0, 0, busy_after=True)  # a step that produced nothing: not counted
    assert [round(s[0], 3) for s in meter.samples] == [0.1, 0.05]
    with pytest.raises(ValueError, match="min_samples"):
        StepMeter(window=4, min_samples=8)


def _sse(rows: np.ndarray, coef) -> float:
    x = np.column_stack([np.ones(len(rows)), rows[:, 1], rows[:, 2]])
    return float(np.sum((x @ np.asarray(coef) - rows[:, 0]) ** 2))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.floats(1e-4, 2.0), st.sampled_from([1, 1, 2, 8, 64, 200]),
                          st.sampled_from([0, 0, 0, 7, 512, 4096])), min_size=3, max_size=60),
       st.integers(3, 24))
def test_the_meter_fit_from_moments_equals_least_squares_over_its_window(rows, window):
    # steps enter and leave the window (its moments are updated both ways); degenerate windows
    # (no prompt tokens at all, one batch size throughout) come up often with these draws
    meter = StepMeter(window=window, min_samples=3, max_gap_s=10.0)
    t = 0.0
    meter.step(t, 1, 0, busy_after=True)
    for dt, gen, prompt in rows:
        t += dt
        meter.step(t, gen, prompt, busy_after=True)
    fit = meter.fit()
    window_rows = np.asarray(meter.samples, dtype=np.float64)
    if len(window_rows) < 3:
        assert fit == (0.0, 0.0, 0.0)
        return
    assert min(fit) >= 0
    reference = nonnegative_step_fit(window_rows)
    assert _sse(window_rows, fit) <= _sse(window_rows, reference) * (1 + 1e-6) + 1e-12


def test_the_engine_meters_the_prompt_tokens_it_computed_not_those_the_prefix_cache_served():
    """vLLM's iteration stats count every prompt token of a finished prefill, cached ones too; the
    meter gets the computed ones, else a prefill would be priced at the cache's miss rate."""
    from vllm.v1.metrics.stats import IterationStats, PrefillStats, SchedulerStats

    from war_openrlhf.engine.engine import _SchedulerStatsLogger, computed_prompt_tokens

    logger = _SchedulerStatsLogger(None)
    busy = SchedulerStats(num_running_reqs=2)
    assert logger.meter_all_prompt is None and "all_prompt" not in logger.load()  # the ablation: unasked, off
    assert logger.load(all_prompt=True)["all_prompt"] == {"step_s": 0.0, "step_per_seq_s": 0.0, "prefill_token_s": 0.0}
    for k in range(3):
        it = IterationStats()
        it.num_generation_tokens = 2
        prefill = PrefillStats()
        prefill.set(num_prompt_tokens=1000, num_local_cached_tokens=896 - 128 * k, num_external_cached_tokens=0)
        it.prompt_token_stats.update_from_output(prefill)
        assert it.num_prompt_tokens == 1000 and computed_prompt_tokens(it) == 104 + 128 * k
        logger.record(busy, it)
    assert [row[2] for row in logger.meter.samples] == [232.0, 360.0]  # the first output opens the window
    # the fix's ablation meters the same steps on vLLM's count, cached tokens included
    assert [row[2] for row in logger.meter_all_prompt.samples] == [1000.0, 1000.0]
    assert [row[1] for row in logger.meter_all_prompt.samples] == [row[1] for row in logger.meter.samples]
    assert logger.totals["prompt_tokens"] == 3000  # the totals keep vLLM's count
