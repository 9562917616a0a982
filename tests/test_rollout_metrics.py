"""The rollout's TensorBoard scalars (training.samples_generator.rollout_metrics): pure logic
over engine reports, so engines and the pool are stand-ins here."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from war_openrlhf.engine.stats import EngineStats
from war_openrlhf.training.samples_generator import rollout_metrics


def _result():
    turn = SimpleNamespace(engine=0, start=4, generate_s=0.3, tool_s=0.1, attempts=1, queue_s=0.05, prefill_s=0.02)
    traj = SimpleNamespace(turns=[turn], token_ids=[1, 2, 3, 4, 5, 6], reward=1.0, end_reason="done",
                           finished_s=0.9, wall_s=0.9)
    return SimpleNamespace(tokens_per_s=10.0, wall_s=1.0, generated_tokens=2, turns=1, prefix_hit_rate=0.5,
                           redispatched_turns=0, deferrals=0, trajectories=[traj], engine_turns=[1, 0])


def _pool():
    policy = SimpleNamespace(estimated_cached_tokens=lambda engine, ctx: None, metrics=dict)
    return SimpleNamespace(policy=policy, engines=[SimpleNamespace(sync_errors=0, healthy=True),
                                                   SimpleNamespace(sync_errors=1, healthy=False)],
                           log=[1, 2, 3], shipper=SimpleNamespace(archive=[1, 2]))


def _stats(engine, drafter_p50, drafter_p99, pending, steps=10):
    war = {"step_trace": {"steps": steps, "drafter_us": {"p50": drafter_p50, "p99": drafter_p99}},
           "index": {"pending_entries": pending}}
    return EngineStats(engine=engine, generation_tokens=20, steps=steps, war=war)


def test_drafter_step_cost_and_log_backlog_are_reported_per_batch():
    before = [EngineStats(engine=0), EngineStats(engine=1)]
    after = [_stats(0, 40.0, 90.0, 3), _stats(1, 55.0, 70.0, 0)]
    m = rollout_metrics(_result(), _pool(), before, after)
    assert m["war/drafter_step_us_p50"] == 55.0  # the slowest engine's
    assert m["war/drafter_step_us_p99"] == 90.0
    assert m["war/index_pending_entries"] == 3.0
    assert m["war/index_sync_errors"] == 1.0
    assert m["war/tokens_per_engine_step"] == pytest.approx(2.0)
    assert m["war/turn_queue_s_mean"] == m["war/turn_queue_s_max"] == 0.05  # inside the engine
    assert m["war/turn_prefill_s_mean"] == 0.02
    assert m["war/engines_healthy"] == 1.0 and m["war/engines_recovered"] == 0.0
    assert m["war/log_entries"] == 3.0 and m["war/archive_records"] == 2.0  # what the pool holds
    # engines without a replica (vLLM's own suffix, or no speculation) report neither
    plain = rollout_metrics(_result(), _pool(), before, [EngineStats(engine=0), EngineStats(engine=1)])
    assert "war/drafter_step_us_p50" not in plain and "war/index_pending_entries" not in plain


def test_the_dispatchers_measurements_are_reported():
    """war's own policy object: its moves, deferrals and fitted rates become war/dispatch_*."""
    import numpy as np

    from war_openrlhf.dispatch import EngineState, TurnRequest, make_policy

    pol = make_policy("war", 2)
    sts = [EngineState(i, 0, 0, 0, 1 << 20, step_s=5e-3, step_per_seq_s=1e-4,
                       prefill_token_s=4e-5) for i in range(2)]
    pol.choose(TurnRequest("t", "g", np.arange(50, dtype=np.int32), 0, 0), sts)
    pool = _pool()
    pool.policy = SimpleNamespace(estimated_cached_tokens=lambda engine, ctx: None,
                                  metrics=pol.metrics)
    m = rollout_metrics(_result(), pool, [EngineStats(engine=0)], [_stats(0, 1.0, 2.0, 0)])
    assert m["war/dispatch_step_ms"] == pytest.approx(5.0)
    assert m["war/dispatch_prefill_us_per_token"] == pytest.approx(40.0)
    assert m["war/dispatch_moves"] == 0.0 and m["war/dispatch_deferrals"] == 0.0


def test_running_counters_are_reported_per_batch_not_since_start():
    """The switch's step counters and the dispatcher's moves run since engine / policy start:
    each batch reports its own share (a cumulative fraction would hide a switch that just flipped)."""
    def with_switch(engine, steps, spec_steps, decisions, gain, inflight=0, request=0, cut=None):
        return EngineStats(engine=engine, war={"switch": {"steps": steps, "spec_steps": spec_steps,
                                                          "decisions": decisions, "expected_gain": gain,
                                                          "speculating": spec_steps > 0, "min_token_prob": cut},
                                               "drafts": {"inflight": inflight, "request": request}})

    before = [with_switch(0, 100, 100, 5, 1.4, inflight=10, request=10), with_switch(1, 100, 0, 5, 0.8)]
    after = [with_switch(0, 110, 100, 6, 0.9, inflight=16, request=14, cut=0.3), with_switch(1, 130, 30, 7, 1.3)]
    pool = _pool()
    pool.policy = SimpleNamespace(estimated_cached_tokens=lambda e, c: None,
                                  metrics=lambda: {"moves": 7.0, "deferrals": 2.0, "step_ms": 5.0})
    m = rollout_metrics(_result(), pool, before, after, policy_before={"moves": 4.0, "deferrals": 2.0})
    assert m["war/engine0_speculating_fraction"] == 0.0  # no drafting step in this batch (100 before)
    assert m["war/engine1_speculating_fraction"] == pytest.approx(1.0)
    assert m["war/speculating_fraction"] == pytest.approx(30 / 40)
    assert m["war/engine1_switch_expected_gain"] == pytest.approx(1.3)
    assert m["war/engine0_switch_decisions"] == 1.0 and m["war/engine1_switch_decisions"] == 2.0
    assert m["war/drafts_inflight_share"] == pytest.approx(6 / 10)  # this batch's drafts, not since start
    assert m["war/engine0_draft_min_token_prob"] == pytest.approx(0.3) and "war/engine1_draft_min_token_prob" not in m
    assert m["war/dispatch_moves"] == 3.0 and m["war/dispatch_deferrals"] == 0.0
    assert m["war/dispatch_step_ms"] == 5.0  # a measurement, not a counter: as it is
    assert m["war/turn_generate_s_mean"] == pytest.approx(0.3) and m["war/turn_tool_s_mean"] == pytest.approx(0.1)
    deferred = _result()
    deferred.deferrals, deferred.deferred_wait_s = 4, 2.0
    assert rollout_metrics(deferred, pool, before, after)["war/deferred_wait_s_mean"] == pytest.approx(0.5)


def test_tail_figures_are_the_share_after_ninety_percent_finished_and_p99():
    """The last 10% of trajectories (at least one): the step's time after the k-th finish,
    k = floor(0.9 n), over the step; a brute-force reading of the same definition."""
    import math

    import numpy as np

    from war_openrlhf.metrics.tail import tail_figures

    rng = np.random.default_rng(0)
    for n in (1, 2, 9, 10, 11, 37, 100):
        f = rng.exponential(5.0, size=n) + 0.1
        w = f * rng.uniform(0.5, 1.0, size=n)
        got = tail_figures(f.tolist(), w.tolist())
        order = sorted(f)
        k = max(1, math.floor(0.9 * n))
        assert got["tail10_share"] == pytest.approx((order[-1] - order[k - 1]) / order[-1])
        assert 0.0 <= got["tail10_share"] < 1.0
        assert got["trajectory_p99_s"] == pytest.approx(np.percentile(w, 99))
    # one straggler: 10 trajectories done at 1 s, one at 10 s -> 90% of the step is its alone
    assert tail_figures([1.0] * 10 + [10.0], [1.0] * 10 + [10.0])["tail10_share"] == pytest.approx(0.9)
    assert tail_figures([], []) == {"tail10_share": 0.0, "trajectory_p99_s": 0.0, "trajectory_p50_s": 0.0}
    m = rollout_metrics(_result(), _pool(), [EngineStats(engine=0)], [EngineStats(engine=0)])
    assert m["war/tail10_share"] == 0.0 and m["war/trajectory_p99_s"] == pytest.approx(0.9)


def test_group_engines_counts_each_groups_distinct_first_turn_engines():
    """Property check against a direct count: the mean over groups of the distinct engines their
    first turns went to (later turns and turnless trajectories ignored), and its ceiling."""
    import random

    from war_openrlhf.metrics.placement import group_engines

    NS = SimpleNamespace

    rng = random.Random(7)
    for _ in range(50):
        E = rng.randint(1, 5)
        trajs, want = [], {}
        for g in range(rng.randint(1, 6)):
            for _ in range(rng.randint(1, 6)):
                if rng.random() < 0.1:
                    trajs.append(NS(group_id=f"g{g}", turns=[]))
                    continue
                e0 = rng.randrange(E)
                later = [NS(engine=rng.randrange(E)) for _ in range(rng.randint(0, 3))]
                trajs.append(NS(group_id=f"g{g}", turns=[NS(engine=e0), *later]))
                want.setdefault(f"g{g}", []).append(e0)
        got = group_engines(trajs, E)
        if not want:
            assert got == {"group_engines": 0.0, "group_engines_max": 0.0}
            continue
        assert got["group_engines"] == pytest.approx(sum(len(set(v)) for v in want.values()) / len(want))
        assert got["group_engines_max"] == pytest.approx(sum(min(len(v), E) for v in want.values()) / len(want))
        assert 1.0 <= got["group_engines"] <= got["group_engines_max"] <= E
    with pytest.raises(ValueError, match="num_engines"):
        group_engines([], 0)
