"""Tests of war_openrlhf.simulation.workloads: the parametric agent-workload generator."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from war_openrlhf.simulation.cluster import SimConfig, simulate
from war_openrlhf.simulation.workloads import (NAMED_SPECS, GeneratedTrajectory, LatencyDist,
                                               LengthDist, WorkloadSpec, generate_workload,
                                               group_sizes, scaled, workload_stats)
from war_openrlhf.traces import TokenizedTrajectory

SMALL = WorkloadSpec(n_groups=3, group_size=4, system_prompt_tokens=300,
                     task_prompt_tokens=LengthDist.lognormal(80, 0.5, cap=256),
                     turns=LengthDist.uniform(2, 6),
                     response_tokens=LengthDist.lognormal(40, 0.5, cap=200),
                     observation_tokens=LengthDist.pareto(30, 1.2, cap=400),
                     tool_latency_s=LatencyDist.lognormal(0.5, 0.5, cap_s=5.0),
                     max_context_tokens=4096, seed=7)

ALL_SPECS = [pytest.param(SMALL, id="small")] + [
    pytest.param(spec, id=name) for name, spec in NAMED_SPECS.items()]


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    neq = np.flatnonzero(a[:n] != b[:n])
    return int(neq[0]) if len(neq) else n


def _fingerprint(trajs):
    return [(t.trajectory_id, t.group_id, t.tool_delays_s,
             [(u.context_token_ids.tobytes(), u.response_token_ids.tobytes(), u.env_token_count)
              for u in t.turns]) for t in trajs]


@pytest.fixture(scope="module")
def workloads():
    return {name: generate_workload(spec) for name, spec in NAMED_SPECS.items()}


# ---- structure ------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ALL_SPECS)
def test_prefix_property_arrays_and_caps(spec):
    trajs = generate_workload(spec)
    assert len(trajs) == sum(group_sizes(spec))
    assert len({t.trajectory_id for t in trajs}) == len(trajs)
    for t in trajs:
        assert isinstance(t, GeneratedTrajectory) and isinstance(t, TokenizedTrajectory)
        assert t.turns, t.trajectory_id
        assert len(t.tool_delays_s) == len(t.turns) - 1
        assert all(d >= 0 for d in t.tool_delays_s)
        assert t.turns[-1].env_token_count == 0
        base = t.turns[-1].context_token_ids.base
        for i, u in enumerate(t.turns):
            c, r = u.context_token_ids, u.response_token_ids
            for a in (c, r):
                assert a.dtype == np.int32 and not a.flags.writeable
                assert a.base is base and base is not None  # views of one array
                if len(a):
                    assert a.min() >= spec.vocab_low and a.max() < spec.vocab_high
            assert len(c) + len(r) <= spec.max_context_tokens
            assert 1 <= len(r) <= spec.response_tokens.cap
            if i + 1 < len(t.turns):
                assert 1 <= u.env_token_count <= spec.observation_tokens.cap
                nxt = t.turns[i + 1].context_token_ids
                assert len(nxt) == len(c) + len(r) + u.env_token_count
                np.testing.assert_array_equal(nxt[:len(c)], c)
                np.testing.assert_array_equal(nxt[len(c):len(c) + len(r)], r)
        assert len(t.turns) <= spec.turns.cap


def test_context_cap_ends_trajectories_early():
    spec = dataclasses.replace(SMALL, turns=LengthDist.fixed(40), max_context_tokens=1200)
    trajs = generate_workload(spec)
    # 40 turns of ~100 tokens each cannot fit in 1200 tokens: the cap ended them.
    assert all(len(t.turns) < 40 for t in trajs)
    for t in trajs:
        last = t.turns[-1]
        assert len(last.context_token_ids) + len(last.response_token_ids) <= 1200
        assert last.env_token_count == 0
    # A first response that would not fit is truncated to fit.
    tight = dataclasses.replace(SMALL, response_tokens=LengthDist.fixed(5000),
                                max_context_tokens=1000)
    for t in generate_workload(tight):
        assert len(t.turns) == 1
        assert len(t.turns[0].context_token_ids) + len(t.turns[0].response_token_ids) == 1000


def test_groups_share_exactly_the_prompt_and_all_share_the_system_prompt():
    spec = dataclasses.replace(SMALL, n_groups=5, group_size=8)
    trajs = generate_workload(spec)
    S = spec.system_prompt_tokens
    by_group = {}
    for t in trajs:
        by_group.setdefault(t.group_id, []).append(t)
    assert len(by_group) == 5 and all(len(m) == 8 for m in by_group.values())
    system = trajs[0].turns[0].context_token_ids[:S]
    prompts = []
    for members in by_group.values():
        prompt = members[0].turns[0].context_token_ids
        assert len(prompt) > S
        prompts.append(prompt)
        for a in members:
            np.testing.assert_array_equal(a.turns[0].context_token_ids, prompt)
            np.testing.assert_array_equal(a.turns[0].context_token_ids[:S], system)
        firsts = [int(a.turns[0].response_token_ids[0]) for a in members]
        assert len(set(firsts)) == len(firsts)  # diverge at the first response token
        for i, a in enumerate(members):
            for b in members[i + 1:]:
                sa = np.concatenate([a.turns[-1].context_token_ids, a.turns[-1].response_token_ids])
                sb = np.concatenate([b.turns[-1].context_token_ids, b.turns[-1].response_token_ids])
                assert _common_prefix(sa, sb) == len(prompt)
    # Across groups: the system prompt is shared, the task prompt is not.
    for i, p in enumerate(prompts):
        for q in prompts[i + 1:]:
            assert S <= _common_prefix(p, q) < min(len(p), len(q))


def test_group_members_diverge_even_with_a_tiny_vocabulary():
    # 16 samples drawing from 64 token ids would collide by chance; the generator
    # makes first response tokens distinct within each group.
    spec = dataclasses.replace(SMALL, n_groups=6, group_size=16, vocab_low=5, vocab_high=69)
    trajs = generate_workload(spec)
    for g in {t.group_id for t in trajs}:
        firsts = [int(t.turns[0].response_token_ids[0]) for t in trajs if t.group_id == g]
        assert len(firsts) == 16 and len(set(firsts)) == 16
        assert min(firsts) >= 5 and max(firsts) < 69


def test_group_size_distribution_and_turn_counts_vary_within_groups():
    spec = dataclasses.replace(SMALL, n_groups=40, group_size=LengthDist.uniform(1, 3))
    sizes = group_sizes(spec)
    assert set(sizes) == {1, 2, 3}
    trajs = generate_workload(spec)
    assert len(trajs) == sum(sizes)
    varied = 0
    for g in {t.group_id for t in trajs}:
        counts = {len(t.turns) for t in trajs if t.group_id == g}
        varied += len(counts) > 1
    assert varied > 0


# ---- determinism ----------------------------------------------------------------------------
def test_deterministic_for_a_seed_and_different_for_another():
    a, b = generate_workload(SMALL), generate_workload(SMALL)
    assert _fingerprint(a) == _fingerprint(b)
    c = generate_workload(dataclasses.replace(SMALL, seed=8))
    assert _fingerprint(a) != _fingerprint(c)
    assert not np.array_equal(a[0].turns[0].context_token_ids[:100],
                              c[0].turns[0].context_token_ids[:100])
    assert a[0].tool_delays_s != c[0].tool_delays_s


def test_scaling_extends_and_latency_change_keeps_tokens():
    small = generate_workload(SMALL)
    big = generate_workload(scaled(SMALL, 6))
    assert len({t.group_id for t in big}) == 6
    assert _fingerprint(big[:len(small)]) == _fingerprint(small)
    spec = scaled(NAMED_SPECS["swe_like"], n_trajectories=20)
    sizes = group_sizes(spec)
    assert sum(sizes) >= 20 and sum(sizes[:-1]) < 20
    assert len(generate_workload(spec)) == sum(sizes)
    with pytest.raises(ValueError, match="exactly one"):
        scaled(SMALL)
    # Another latency distribution: same tokens, other delays.
    slow = generate_workload(dataclasses.replace(SMALL, tool_latency_s=LatencyDist.fixed(3.0)))
    strip = lambda ts: [f[:2] + f[3:] for f in _fingerprint(ts)]  # noqa: E731
    assert strip(slow) == strip(small)
    assert all(d == 3.0 for t in slow for d in t.tool_delays_s)


def test_env_token_delay_adds_per_observation_token():
    spec = dataclasses.replace(SMALL, tool_latency_s=LatencyDist.fixed(0.25),
                               env_token_delay_s=0.01)
    for t in generate_workload(spec):
        for u, d in zip(t.turns, t.tool_delays_s):
            assert d == pytest.approx(0.25 + 0.01 * u.env_token_count)


# ---- distributions --------------------------------------------------------------------------
def test_length_distributions():
    rng = np.random.default_rng(0)
    x = LengthDist.lognormal(300, 0.8, cap=100_000).sample(rng, 40_000)
    assert x.dtype == np.int64
    assert np.median(x) == pytest.approx(300, rel=0.04)
    assert np.std(np.log(x)) == pytest.approx(0.8, rel=0.05)
    capped = LengthDist.lognormal(300, 1.5, cap=500).sample(rng, 10_000)
    assert capped.min() >= 1 and capped.max() == 500
    p = LengthDist.pareto(200, 0.9, cap=4000).sample(rng, 40_000)
    assert p.min() == 200 and p.max() == 4000
    assert np.mean(p == 4000) == pytest.approx((200 / 4000) ** 0.9, rel=0.1)  # capped tail mass
    assert np.median(p) == pytest.approx(200 * 2 ** (1 / 0.9), rel=0.05)
    u = LengthDist.uniform(3, 7).sample(rng, 10_000)
    assert set(np.unique(u)) == {3, 4, 5, 6, 7}
    geo = LengthDist.geometric(5, cap=1000).sample(rng, 40_000)
    assert geo.min() == 1 and geo.mean() == pytest.approx(5, rel=0.03)
    assert set(LengthDist.fixed(9).sample(rng, 5)) == {9}
    assert LengthDist.uniform(2, 4).mean() == pytest.approx(3, abs=0.05)


def test_latency_distributions_and_stragglers():
    rng = np.random.default_rng(1)
    lat = LatencyDist.lognormal(0.8, 0.6, cap_s=100.0).sample(rng, 40_000)
    assert np.median(lat) == pytest.approx(0.8, rel=0.04)
    s = LatencyDist("fixed", 1.0, straggler_p=0.1, straggler_mult=8.0).sample(rng, 40_000)
    assert set(np.unique(s)) == {1.0, 8.0}
    assert np.mean(s == 8.0) == pytest.approx(0.1, abs=0.006)
    capped = LatencyDist.pareto(0.5, 1.0, cap_s=2.0).sample(rng, 10_000)
    assert capped.min() >= 0.5 and capped.max() == 2.0
    # In a generated workload: the straggler fraction of the delays is near p.
    spec = dataclasses.replace(SMALL, n_groups=30, turns=LengthDist.fixed(12),
                               tool_latency_s=LatencyDist("fixed", 0.2, straggler_p=0.2,
                                                          straggler_mult=10.0))
    delays = np.array([d for t in generate_workload(spec) for d in t.tool_delays_s])
    assert len(delays) > 1000
    assert np.mean(np.isclose(delays, 2.0)) == pytest.approx(0.2, abs=0.03)
    assert LatencyDist.lognormal(1.0, 0.5).scaled(3.0).value == 3.0


def test_named_specs_have_their_character(workloads):
    assert len(NAMED_SPECS) >= 5
    st = {name: workload_stats(trajs) for name, trajs in workloads.items()}
    assert st["tau_like"]["prompt_tokens_mean"] > 4000
    assert 10 <= st["tau_like"]["turns_mean"] <= 18
    assert st["swe_like"]["final_context_max"] > 32768
    assert st["swe_like"]["turns_mean"] > 25
    assert st["math_tool"]["turns_mean"] < 4
    assert st["math_tool"]["tool_delay_mean_s"] < 0.5
    assert st["search_agent"]["tool_delay_p99_s"] > 3 * st["search_agent"]["tool_delay_mean_s"]
    assert st["chatty_long_responses"]["response_tokens_mean"] > 500
    assert {len(t.turns) for t in workloads["chatty_long_responses"]} <= {1, 2, 3}
    for name, trajs in workloads.items():
        spec = NAMED_SPECS[name]
        if isinstance(spec.group_size, int):
            assert len(trajs) == spec.n_groups * spec.group_size, name


# ---- validation -----------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("n_groups", 0),
    ("n_groups", 2.5),
    ("group_size", 0),
    ("group_size", 65),
    ("group_size", LengthDist.uniform(1, 100)),
    ("system_prompt_tokens", -1),
    ("task_prompt_tokens", 100),
    ("turns", "many"),
    ("response_tokens", None),
    ("observation_tokens", LatencyDist.fixed(1.0)),
    ("tool_latency_s", LengthDist.fixed(1)),
    ("env_token_delay_s", -0.1),
    ("max_context_tokens", 1000),  # < system 1024 + task cap 2048 + 1
    ("vocab_low", -5),
    ("vocab_high", 500),
    ("vocab_high", 2 ** 31),
    ("seed", -1),
])
def test_spec_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=rf"WorkloadSpec\.{field}\b"):
        WorkloadSpec(**{field: value})


@pytest.mark.parametrize("make, field", [
    (lambda: LengthDist("zipf", 3), "kind"),
    (lambda: LengthDist.lognormal(100, 0.0), "sigma"),
    (lambda: LengthDist.lognormal(-1, 0.5), "value"),
    (lambda: LengthDist.pareto(100, 0), "alpha"),
    (lambda: LengthDist.uniform(5, 2), "high"),
    (lambda: LengthDist.lognormal(100, 0.5, cap=0), "cap"),
    (lambda: LengthDist("fixed", 3, floor=0), "floor"),
    (lambda: LengthDist.geometric(0.5), "value"),
    (lambda: LatencyDist("geometric", 1.0), "kind"),
    (lambda: LatencyDist.fixed(-1.0), "value"),
    (lambda: LatencyDist.lognormal(1.0, 0.5, straggler_p=1.5), "straggler_p"),
    (lambda: LatencyDist.lognormal(1.0, 0.5, straggler_mult=0.5), "straggler_mult"),
    (lambda: LatencyDist.lognormal(1.0, 0.5, cap_s=-1), "cap_s"),
])
def test_dist_validation_names_the_field(make, field):
    with pytest.raises(ValueError, match=rf"\.{field}\b"):
        make()


# ---- the simulator replays generated workloads ----------------------------------------------
def _sim(trajs, engines=2, **kw):
    return simulate(trajs, "least_loaded",
                    SimConfig(num_engines=engines, kv_capacity_tokens=200_000, **kw))


def test_simulator_runs_and_uses_the_generated_tool_delays():
    trajs = generate_workload(SMALL)
    res = _sim(trajs)
    assert res.trajectories == len(trajs)
    assert res.turns == sum(len(t.turns) for t in trajs)
    assert res.generated_tokens == sum(len(u.response_token_ids) for t in trajs for u in t.turns)
    assert res.hit_rate > 0  # shared system prompt and growing contexts hit the prefix cache
    # The generated delays replace the simulator's own delay model ...
    assert _sim(trajs, tool_delay_s=50.0, per_env_token_s=1.0).makespan_s == res.makespan_s
    # ... and scaling them up lengthens the run.
    slow_spec = dataclasses.replace(SMALL, tool_latency_s=SMALL.tool_latency_s.scaled(10.0))
    slow = _sim(generate_workload(slow_spec))
    assert slow.makespan_s > res.makespan_s + 5.0
    # One trajectory alone on one engine: makespan grows by exactly the added delay.
    one = [t for t in trajs if len(t.turns) >= 3][0]
    base = _sim([one], engines=1).makespan_s
    longer = dataclasses.replace(one, tool_delays_s=tuple(d + 2.0 for d in one.tool_delays_s))
    assert base > sum(one.tool_delays_s)
    assert _sim([longer], engines=1).makespan_s == pytest.approx(
        base + 2.0 * len(one.tool_delays_s), rel=1e-9)


def test_simulator_runs_every_named_family(workloads):
    for name, trajs in workloads.items():
        sub = trajs[:8]
        res = _sim(sub)
        assert res.turns == sum(len(t.turns) for t in sub), name
        assert res.makespan_s >= max(sum(t.tool_delays_s) for t in sub), name
