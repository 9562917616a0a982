"""Remaining-work predictors: the truncated normal mean against numerical integration, the
variance fit on data with known group effects, and the sibling predictor's use of its
siblings (direction, and error against the survival curve where groups differ)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from war_openrlhf.dispatch.remaining_work import SiblingPredictor, SiblingRecords, SurvivalPrior, truncated_normal_mean


@settings(max_examples=80, deadline=None)
@given(st.floats(-20, 20), st.floats(0.1, 10), st.floats(-25, 25))
def test_truncated_normal_mean_matches_numerical_integration(mu, sd, lower):
    if (lower - mu) / sd > 7:  # the tail holds < 1e-12 of the mass: integration is meaningless there
        assert truncated_normal_mean(mu, sd, lower) >= lower
        return
    x = np.linspace(lower, max(lower, mu) + 12 * sd, 200_001)
    w = np.exp(-0.5 * ((x - mu) / sd) ** 2)
    assert truncated_normal_mean(mu, sd, lower) == pytest.approx(float((x * w).sum() / w.sum()), abs=2e-3 * sd)


def _groups(rng, n_groups, size, var_b, var_w, mean=12.0):
    out = {}
    for g in range(n_groups):
        mu = mean + rng.normal(0, math.sqrt(var_b))
        out[f"g{g}"] = [max(1, int(round(mu + rng.normal(0, math.sqrt(var_w))))) for _ in range(size)]
    return out


def test_fit_recovers_between_and_within_group_variance():
    rng = np.random.default_rng(0)
    fit = SiblingPredictor.fit(_groups(rng, 3000, 4, var_b=25.0, var_w=9.0))
    assert fit.var_b == pytest.approx(25.0, rel=0.1) and fit.var_w == pytest.approx(9.0 + 1 / 12, rel=0.1)
    assert fit.mean == pytest.approx(12.0, abs=0.3)
    with pytest.raises(ValueError, match="at least two"):
        SiblingPredictor.fit({"a": [3]})


def test_siblings_move_the_prediction_the_way_their_lengths_point():
    p = SiblingPredictor(mean=12.0, var_between=25.0, var_within=9.0)
    base = p.remaining(4)
    assert p.remaining(4, finished=[3, 4]) < base  # short finished siblings: a short task
    assert p.remaining(10, running=3) > p.remaining(10, finished=[6, 7, 8])  # still-running siblings: long
    assert p.remaining(4) == pytest.approx(p.remaining(4, finished=[], running=0))
    assert all(p.remaining(k) >= 1.0 for k in range(60))
    # no group effect: siblings carry no information
    flat = SiblingPredictor(mean=12.0, var_between=0.0, var_within=9.0)
    assert flat.remaining(4, finished=[1, 1, 1]) == pytest.approx(flat.remaining(4))


def test_with_group_effects_siblings_beat_the_survival_curve():
    rng = np.random.default_rng(1)
    train, test = _groups(rng, 400, 4, 25.0, 4.0), _groups(rng, 200, 4, 25.0, 4.0)
    prior = SurvivalPrior([t for g in train.values() for t in g])
    sib = SiblingPredictor.fit(train)
    err_p, err_s = [], []
    for totals in test.values():
        for k in range(max(totals)):
            finished = [t for t in totals if t <= k]
            alive = [t for t in totals if t > k]
            for t in alive:
                err_p.append(abs(prior.remaining(k) - (t - k)))
                err_s.append(abs(sib.remaining(k, finished, len(alive) - 1) - (t - k)))
    # in a turn-synchronous replay siblings inform only once the shorter ones finish; then the
    # gain is large, before it nothing is known (12% overall on this data, 25% after round 12)
    assert np.mean(err_s) < 0.92 * np.mean(err_p)
    assert SurvivalPrior([2, 4, 6]).remaining(3) == pytest.approx(2.0)  # alive after 3: 4 or 6 -> mean 5
    assert SurvivalPrior([2]).remaining(9) == 1.0


def test_sibling_records_predict_from_the_groups_of_this_step_and_the_fit_of_earlier_ones():
    rec = SiblingRecords()
    assert rec.remaining("a0", "A", 0) is None  # nothing finished anywhere yet
    rng = np.random.default_rng(3)
    rec.seed(_groups(rng, 40, 4, var_b=16.0, var_w=1.0).values())
    for g in ("long", "short"):
        for i in range(4):
            rec.running(f"{g}{i}", g, 0)
    before = rec.remaining("long3", "long", 0)
    assert before == pytest.approx(rec.remaining("short3", "short", 0))  # no sibling info yet
    for i in range(3):  # three siblings of each group finished, far apart
        rec.finished(f"long{i}", "long", 25)
        rec.finished(f"short{i}", "short", 4)
    assert rec.remaining("long3", "long", 0) > before > rec.remaining("short3", "short", 0)
    # a new batch: this step's groups become fit data, the step's records start empty
    rec.start_batch()
    assert rec.remaining("long3", "long", 0) == pytest.approx(rec.remaining("x", "new", 0))
