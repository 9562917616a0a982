"""Fitting the simulator's cost model to measured engine runs (simulation.fit)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from war_openrlhf.simulation.cost_model import get_preset
from war_openrlhf.simulation.fit import StepRun, _nnls, fit_cost_model


def _brute_nnls(a, b):
    """Every support set's unconstrained least squares, kept when non-negative; the best residual."""
    n = a.shape[1]
    best, best_r = np.zeros(n), float(np.sum(b ** 2))
    for k in range(1, n + 1):
        for support in itertools.combinations(range(n), k):
            x = np.zeros(n)
            x[list(support)] = np.linalg.lstsq(a[:, support], b, rcond=None)[0]
            if (x >= -1e-12).all():
                r = float(np.sum((a @ x - b) ** 2))
                if r < best_r - 1e-12:
                    best, best_r = x, r
    return best, best_r


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(5, 9), cols=st.integers(1, 5))
def test_nnls_matches_brute_force(seed, rows, cols):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(rows, cols))
    b = rng.normal(size=rows)
    x = _nnls(a, b)
    _, best_r = _brute_nnls(a, b)
    assert (x >= 0).all()
    assert float(np.sum((a @ x - b) ** 2)) == pytest.approx(best_r, rel=1e-6, abs=1e-9)


def _runs(costs, rng, noise=0.0):
    runs = []
    for length in (256, 1024, 4096, 8192, 16384):
        steps = -(-length // 4096)
        chunks = [min(4096, length - 4096 * i) for i in range(steps)]
        pairs = sum(c * (4096 * i + c / 2) for i, c in enumerate(chunks))
        runs.append(StepRun("prefill", steps, 0, length * steps, length, 0.0, pairs))
    for b in (1, 4, 16):
        for c in (64, 2048, 8192):
            runs.append(StepRun("decode", 32, 32 * b, 32 * b * c, 0, 0.0, 0.0))
    out = []
    for r in runs:
        t = float(np.dot(r.features(), costs)) * (1.0 + noise * rng.normal())
        out.append(StepRun(r.kind, r.steps, r.decode_seqs, r.context_tokens, r.prefill_tokens, t, r.prefill_pairs))
    return out


def test_fit_recovers_the_costs_that_generated_the_runs():
    truth = get_preset("cpu_tiny")
    costs = [truth.step_overhead_s, truth.decode_per_seq_s, 2e-9, 3e-5, 2e-9]
    model, report = fit_cost_model(_runs(costs, np.random.default_rng(0)), name="t", kv_capacity_tokens=10**6,
                                   max_num_seqs=256, max_num_batched_tokens=4096, block_size=128)
    fitted = [model.step_overhead_s, model.decode_per_seq_s, model.kv_read_per_token_s, model.prefill_per_token_s,
              model.prefill_attn_per_pair_s]
    assert np.allclose(fitted, costs, rtol=1e-6)
    assert report["max_relative_error"] < 1e-6 and model.block_size == 128
    # with 3% measurement noise: costs within 15%, every run within 10%
    model, report = fit_cost_model(_runs(costs, np.random.default_rng(1), noise=0.03), name="t",
                                   kv_capacity_tokens=10**6, max_num_seqs=256, max_num_batched_tokens=4096,
                                   block_size=128)
    assert model.step_overhead_s == pytest.approx(costs[0], rel=0.15)
    assert model.prefill_per_token_s == pytest.approx(costs[3], rel=0.15)
    assert report["max_relative_error"] < 0.1


def test_fit_refuses_too_few_or_empty_runs(tmp_path):
    run = StepRun("decode", 1, 1, 10, 0, 0.001)
    with pytest.raises(ValueError, match="at least 5"):
        fit_cost_model([run] * 4, name="t", kv_capacity_tokens=1024, max_num_seqs=8, max_num_batched_tokens=64,
                       block_size=16)
    with pytest.raises(ValueError, match=r"runs\[1\].seconds"):
        fit_cost_model([run, StepRun("decode", 1, 1, 10, 0, 0.0), run, run, run], name="t", kv_capacity_tokens=1024,
                       max_num_seqs=8, max_num_batched_tokens=64, block_size=16)
    # a fitted model round-trips through the JSON preset loader
    model, _ = fit_cost_model(_runs([1e-3, 4e-5, 0.0, 4e-5, 0.0], np.random.default_rng(0)), name="t",
                              kv_capacity_tokens=10**6, max_num_seqs=256, max_num_batched_tokens=4096, block_size=128)
    path = tmp_path / "cost.json"
    path.write_text(__import__("json").dumps({"cost_model": model.to_dict()}))
    assert get_preset(str(path)) == model
    path.write_text("{\"name\": 1}")
    with pytest.raises(ValueError, match="is not a cost model"):
        get_preset(str(path))


def test_spec_costs_are_fitted_on_top_of_the_plain_model():
    from war_openrlhf.simulation.fit import SpecRun, fit_spec_costs

    base, _ = fit_cost_model(_runs([1e-3, 4e-5, 1e-9, 5e-6, 3e-9], np.random.default_rng(0)), name="t",
                             kv_capacity_tokens=10**6, max_num_seqs=256, max_num_batched_tokens=4096, block_size=128)
    rng = np.random.default_rng(3)
    runs = []
    for b in (1, 2, 4, 8):
        for accepted in (0.2, 0.8):
            steps = 48 * (1 - accepted / 2)
            plain = StepRun("spec", steps, b * steps, b * steps * 2000, 0, 0.0)
            drafts, tokens = steps, b * steps * 6
            t = float(np.dot(plain.features(), [base.step_overhead_s, base.decode_per_seq_s, base.kv_read_per_token_s,
                                                base.prefill_per_token_s, base.prefill_attn_per_pair_s]))
            t += 4e-4 * drafts + 2e-5 * tokens
            runs.append(SpecRun(StepRun("spec", plain.steps, plain.decode_seqs, plain.context_tokens, 0, t), drafts,
                                tokens))
    fitted, report = fit_spec_costs(base, runs)
    assert fitted.spec_step_s == pytest.approx(4e-4, rel=1e-6)
    assert fitted.draft_token_s == pytest.approx(2e-5, rel=1e-6)
    assert fitted.draft_context_token_s == 0.0  # the runs record no draft context
    assert fitted.step_overhead_s == base.step_overhead_s  # the plain costs are kept
    assert report["max_relative_error"] < 1e-6
    # draft tokens that attend long contexts: their attention is a cost of its own
    ctx_runs = []
    for ctx in (64, 2048, 8192):
        for r in runs:
            dctx = r.draft_tokens * ctx
            p = r.plain
            ctx_runs.append(SpecRun(StepRun("spec", p.steps, p.decode_seqs, p.context_tokens, 0,
                                            p.seconds + 3e-8 * dctx), r.spec_steps, r.draft_tokens, dctx))
    fitted, report = fit_spec_costs(base, ctx_runs)
    assert fitted.draft_context_token_s == pytest.approx(3e-8, rel=1e-6)
    assert fitted.draft_token_s == pytest.approx(2e-5, rel=1e-6)
    assert report["max_relative_error"] < 1e-6
    with pytest.raises(ValueError, match="at least 2 drafting runs"):
        fit_spec_costs(base, runs[:1])
    # weights: exact runs are fitted exactly whatever their weights; a noisy run weighed heavily
    # is fitted closer than with equal weights; a weight that is not positive is refused
    weighted, _ = fit_spec_costs(base, runs, weights=[float(i + 1) for i in range(len(runs))])
    assert weighted.spec_step_s == pytest.approx(4e-4, rel=1e-6)
    noisy = [SpecRun(StepRun("spec", r.plain.steps, r.plain.decode_seqs, r.plain.context_tokens, 0,
                             r.plain.seconds * (1.3 if i == 0 else 1.0)), r.spec_steps, r.draft_tokens)
             for i, r in enumerate(runs)]
    _, even = fit_spec_costs(base, noisy)
    _, heavy = fit_spec_costs(base, noisy, weights=[50.0] + [1.0] * (len(noisy) - 1))
    assert abs(heavy["runs"][0]["ratio"] - 1.0) < abs(even["runs"][0]["ratio"] - 1.0)
    with pytest.raises(ValueError, match="weights"):
        fit_spec_costs(base, runs, weights=[1.0, -1.0] + [1.0] * (len(runs) - 2))


def test_both_cost_fits_price_a_shape_the_same_way():
    """tools/bench_engine.py --fit-costs and tools/fit_serving_costs.py measure the same shapes and
    turn each into the same work (one helper): a decode shape's steps, sequences and context."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import bench_engine

    shapes = bench_engine.fit_shapes(16384)
    assert (1, 256, 0) in shapes and (16, 2048, 48) in shapes and (1, 16384, 0) not in shapes
    r = bench_engine.step_run(2, 2048, 48, 4096, 1.0)
    assert (r.kind, r.steps, r.decode_seqs, r.prefill_tokens) == ("decode", 49, 96, 4096)
    assert r.context_tokens == 2 * 2048 + sum(2 * (2048 + k) for k in range(1, 49))  # prefill, then 48 decode reads


def test_a_runs_weight_pulls_the_fit_toward_it_and_bad_weights_are_refused():
    """Weights multiply each run's squared relative error: equal weights change nothing, a heavy
    run is fitted closer than with equal weights, and a weight that is not positive is refused."""
    truth = get_preset("cpu_tiny")
    costs = [truth.step_overhead_s, truth.decode_per_seq_s, 2e-9, 3e-5, 2e-9]
    runs = _runs(costs, np.random.default_rng(2), noise=0.1)
    kw = dict(name="t", kv_capacity_tokens=10**6, max_num_seqs=256, max_num_batched_tokens=4096, block_size=128)
    plain, rep = fit_cost_model(runs, **kw)
    same, _ = fit_cost_model(runs, weights=[2.0] * len(runs), **kw)
    numeric = [k for k, v in plain.to_dict().items() if isinstance(v, float)]
    assert [getattr(same, k) for k in numeric] == pytest.approx([getattr(plain, k) for k in numeric], rel=1e-9)
    errors = [abs(r["ratio"] - 1.0) for r in rep["runs"]]
    worst = int(np.argmax(errors))
    heavy, rep_heavy = fit_cost_model(runs, weights=[100.0 if i == worst else 1.0 for i in range(len(runs))], **kw)
    assert abs(rep_heavy["runs"][worst]["ratio"] - 1.0) < errors[worst]
    with pytest.raises(ValueError, match="weights"):
        fit_cost_model(runs, weights=[1.0] * (len(runs) - 1), **kw)
    with pytest.raises(ValueError, match="weights"):
        fit_cost_model(runs, weights=[0.0] + [1.0] * (len(runs) - 1), **kw)
