"""Tests of war_openrlhf.dispatch.verl_kv_aware: verl's KV-cache-aware router (PR #7115)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

from war_openrlhf.dispatch import EngineState, NoHealthyEngineError, TurnRequest
from war_openrlhf.dispatch.block_index import BLOCK_SIZE, chain_hashes
from war_openrlhf.dispatch.verl_kv_aware import VerlKvAwarePolicy

BIG = 1 << 20  # KV capacity (tokens) large enough that kv_usage stays ~0


def states(n, cap=BIG, running=None, waiting=None, healthy=None, bs=16):
    caps = cap if isinstance(cap, (list, tuple)) else [cap] * n
    running = running or [0] * n
    waiting = waiting or [0] * n
    healthy = healthy or [True] * n
    return [EngineState(i, running[i], waiting[i], 0, caps[i], 0, healthy[i], bs) for i in range(n)]


def only(n, i, **kw):
    """States where only engine ``i`` is healthy: forces a dispatch there."""
    return states(n, healthy=[j == i for j in range(n)], **kw)


def req(tid, ctx, turn=0):
    return TurnRequest(tid, "g", np.asarray(ctx, dtype=np.int32), turn, 0)


def tokens(n, seed):
    return np.random.default_rng(seed).integers(0, 50_000, n, dtype=np.int32)


def occupy(pol, n, engine, count, prefix="busy", **kw):
    """Put ``count`` short (sub-block, so cache-neutral) turns in flight on ``engine``."""
    for k in range(count):
        pol.choose(req(f"{prefix}{engine}_{k}", [1, 2, 3]), only(n, engine, **kw))


# ---------------------------------------------------------------- configuration
def test_name_and_defaults_are_the_shipped_config():
    p = VerlKvAwarePolicy(3)
    assert p.name == "verl_kv_aware"
    assert (p.alpha, p.load_threshold) == (0.3, 0.6)  # kvcaware.yaml:19,21
    assert p.layer_weights == {"gpu": 0.7, "cpu": 0.2, "ssd": 0.1}
    assert p.load_weights == (0.5, 0.0, 0.0, 0.5)
    assert (p.max_num_seqs, p.lru_capacity) == (1024, 10000)
    assert (p.slow_cut, p.overload_mode, p.do_shortcut) == ("prefix-load-aware", "kv_load", True)


@pytest.mark.parametrize("kwargs, arg", [
    (dict(alpha=-0.1), "alpha"),
    (dict(alpha=1.5), "alpha"),
    (dict(alpha=float("nan")), "alpha"),
    (dict(load_threshold=0.0), "load_threshold"),
    (dict(load_threshold=1.0), "load_threshold"),
    (dict(layer_weights={"gpu": 1.0}), "layer_weights"),
    (dict(layer_weights={"gpu": 0.5, "cpu": 0.5, "ssd": 0.5}), "layer_weights"),
    (dict(layer_weights={"gpu": 1.2, "cpu": -0.2, "ssd": 0.0}), "layer_weights"),
    (dict(load_weights=(0.5, 0.5)), "load_weights"),
    (dict(load_weights=(0.5, 0.0, 0.0, 0.6)), "load_weights"),
    (dict(load_weights=(1.5, -0.5, 0.0, 0.0)), "load_weights"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_seqs=2.5), "max_num_seqs"),
    (dict(slow_cut="round-robin"), "slow_cut"),
    (dict(overload_mode="skew"), "overload_mode"),
    (dict(do_shortcut=1), "do_shortcut"),
    (dict(lru_capacity=0), "lru_capacity"),
])
def test_bad_arguments_raise_value_error_naming_them(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        VerlKvAwarePolicy(2, **kwargs)


def test_bad_engine_count():
    with pytest.raises(ValueError, match="num_engines"):
        VerlKvAwarePolicy(0)


# ---------------------------------------------------------------- sticky shortcut
def _bound_to_engine0(pol, n=2):
    """Trajectory A runs turn 0 on engine 0 (cold, tie -> first in the pool) and finishes it."""
    ctx = tokens(256, 1)
    assert pol.choose(req("A", ctx), states(n)) == 0
    resp = tokens(32, 2)
    pol.on_turn_finished(req("A", ctx), 0, resp)
    return np.concatenate([ctx, resp, tokens(40, 3)])


def test_sticky_shortcut_keeps_trajectory_on_its_engine():
    # engine 0 is busier (3 of max 4 in flight): the slow cut alone would move A to engine 1 ...
    free = VerlKvAwarePolicy(2, max_num_seqs=4, do_shortcut=False)
    ctx1 = _bound_to_engine0(free)
    occupy(free, 2, 0, 3)
    assert free.choose(req("A", ctx1, 1), states(2)) == 1
    # ... but the shortcut keeps it: load(0) = 0.5*kv + 0.5*3/4 < 0.6
    pol = VerlKvAwarePolicy(2, max_num_seqs=4)
    ctx1 = _bound_to_engine0(pol)
    occupy(pol, 2, 0, 3)
    assert pol.load(states(2)[0]) < pol.load_threshold
    assert pol.choose(req("A", ctx1, 1), states(2)) == 0
    assert pol.last_path == "sticky"
    assert pol.engine_of("A") == 0


def test_sticky_shortcut_skipped_when_bound_engine_overloaded():
    pol = VerlKvAwarePolicy(2, max_num_seqs=4, load_threshold=0.4)
    ctx1 = _bound_to_engine0(pol)
    occupy(pol, 2, 0, 4)  # load(0) = 0.5*kv + 0.5*1 > 0.4
    assert pol.is_overloaded(states(2)[0])
    assert pol.choose(req("A", ctx1, 1), states(2)) == 1
    assert pol.last_path == "prefix-load-aware"
    assert pol.engine_of("A") == 1  # on_acquire rebinds


def test_overload_threshold_is_strict():
    """``load > load_threshold`` (kvc_aware.py:193): equal is not overloaded."""
    for busy, expected in ((2, 0), (3, 1)):
        pol = VerlKvAwarePolicy(2, max_num_seqs=4, load_threshold=0.5, load_weights=(0, 0, 0, 1))
        ctx1 = _bound_to_engine0(pol)
        occupy(pol, 2, 0, busy)  # load(0) = busy / 4
        assert pol.choose(req("A", ctx1, 1), states(2)) == expected


def test_overload_mode_none_never_breaks_stickiness():
    pol = VerlKvAwarePolicy(2, max_num_seqs=1, load_threshold=0.01, overload_mode="None")
    ctx1 = _bound_to_engine0(pol)
    occupy(pol, 2, 0, 5)
    assert pol.choose(req("A", ctx1, 1), states(2)) == 0


def test_overload_mode_kv_cache_usage_perc_counts_in_flight_blocks():
    cap = 20 * BLOCK_SIZE  # 20 blocks per engine
    pol = VerlKvAwarePolicy(2, overload_mode="kv_cache_usage_perc", alpha=0.0)
    ctx = tokens(32, 7)
    assert pol.choose(req("A", ctx), states(2, cap=cap)) == 0
    pol.on_turn_finished(req("A", ctx), 0, tokens(4, 8))
    ctx1 = np.concatenate([ctx, tokens(40, 9)])
    # 1 in-flight turn of 10 blocks: 0.5 <= 0.6, stays
    pol.choose(req("B", tokens(160, 10)), only(2, 0, cap=cap))
    assert pol.kv_cache_usage_perc(0) == pytest.approx(0.5)
    assert pol.choose(req("A", ctx1, 1), states(2, cap=cap)) == 0
    assert pol.last_path == "sticky"
    pol.on_turn_finished(req("A", ctx1, 1), 0, tokens(4, 11))
    # 2 in-flight turns of 10 distinct blocks each: 1.0 > 0.6, falls through to scoring
    pol.choose(req("C", tokens(160, 12)), only(2, 0, cap=cap))
    assert pol.kv_cache_usage_perc(0) == pytest.approx(1.0)
    ctx2 = np.concatenate([ctx1, tokens(4, 11), tokens(40, 13)])
    assert pol.choose(req("A", ctx2, 2), states(2, cap=cap)) == 1
    assert pol.last_path == "prefix-load-aware"


def test_do_shortcut_false_rescores_every_turn():
    pol = VerlKvAwarePolicy(2, do_shortcut=False, alpha=0.0)
    ctx1 = _bound_to_engine0(pol)
    occupy(pol, 2, 0, 1)
    assert pol.choose(req("A", ctx1, 1), states(2)) == 1


def test_sticky_lru_is_bounded():
    pol = VerlKvAwarePolicy(3, lru_capacity=2)
    for t in ("a", "b", "c"):
        pol.choose(req(t, [1]), states(3))
    assert pol.engine_of("a") is None
    assert pol.engine_of("b") is not None and pol.engine_of("c") is not None


def test_binding_survives_trajectory_end_and_cache_reset():
    pol = VerlKvAwarePolicy(2)
    ctx = tokens(64, 1)
    e = pol.choose(req("A", ctx), states(2))
    pol.on_turn_finished(req("A", ctx), e, tokens(8, 2))
    assert pol.estimated_cached_tokens(e, ctx) == 64
    pol.on_prefix_cache_reset()
    assert pol.estimated_cached_tokens(e, ctx) == 0
    assert pol.kv_usage(e) == 0.0
    pol.on_trajectory_finished("A")
    assert pol.engine_of("A") == e


# ---------------------------------------------------------------- the slow cut
def test_no_cache_least_loaded_wins():
    pol = VerlKvAwarePolicy(3, max_num_seqs=8)
    occupy(pol, 3, 0, 2)
    occupy(pol, 3, 2, 1)
    assert pol.choose(req("new", tokens(128, 5)), states(3)) == 1


def test_running_and_waiting_weights_use_the_snapshot():
    pol = VerlKvAwarePolicy(3, max_num_seqs=8, load_weights=(0.0, 0.5, 0.5, 0.0))
    assert pol.choose(req("x", tokens(64, 1)), states(3, running=[5, 1, 3], waiting=[0, 2, 0])) == 1
    # the in-flight term has weight 0 here: x in flight on engine 1 changes nothing
    assert pol.choose(req("y", tokens(64, 2)), states(3, running=[5, 1, 3], waiting=[0, 2, 0])) == 1


def test_ties_go_to_the_first_engine_in_the_pool():
    pol = VerlKvAwarePolicy(4, load_weights=(0.0, 1.0, 0.0, 0.0))
    assert pol.choose(req("t", [1, 2]), states(4, running=[3, 1, 1, 1])) == 1
    sick0 = states(4, running=[1, 1, 1, 1], healthy=[False, True, True, True])
    assert pol.choose(req("u", [1, 2]), sick0) == 1


def _cached_on_engine0(pol):
    prefix = tokens(512, 21)
    pol.choose(req("X", prefix), only(2, 0))
    pol.on_turn_finished(req("X", prefix), 0, np.zeros(0, dtype=np.int32))
    occupy(pol, 2, 0, 1)  # engine 0 slightly busier: 1 in flight
    return np.concatenate([prefix, tokens(32, 22)])


def test_cached_prefix_wins_on_slightly_busier_engine_when_alpha_favours_cache():
    pol = VerlKvAwarePolicy(2, max_num_seqs=8, alpha=0.7)
    ctx = _cached_on_engine0(pol)
    assert pol.gpu_hits(states(2), chain_hashes(ctx), len(ctx))[0] == pytest.approx(32 / 34)
    assert pol.choose(req("Y", ctx), states(2)) == 0
    # alpha = 0: pure load balancing sends it to the idle engine
    pol0 = VerlKvAwarePolicy(2, max_num_seqs=8, alpha=0.0)
    ctx0 = _cached_on_engine0(pol0)
    assert pol0.choose(req("Y", ctx0), states(2)) == 1


def test_cache_score_is_scaled_by_the_gpu_layer_weight():
    """S_cache = 0.7 * gpu_hit (cpu/ssd hits are 0): at alpha = 1 a full hit scores 0.7."""
    pol = VerlKvAwarePolicy(2, alpha=1.0)
    ctx = _cached_on_engine0(pol)[:512]
    pol.choose(req("Y", ctx), states(2))
    assert pol.last_scores == {0: pytest.approx(0.7), 1: pytest.approx(0.0)}
    pol = VerlKvAwarePolicy(2, alpha=1.0, layer_weights={"gpu": 0.0, "cpu": 0.5, "ssd": 0.5})
    ctx = _cached_on_engine0(pol)[:512]
    assert pol.choose(req("Y", ctx), states(2)) == 0  # all zero: tie -> first engine
    assert pol.last_scores == {0: 0.0, 1: 0.0}


def test_gpu_hit_counts_whole_engine_blocks():
    pol = VerlKvAwarePolicy(2)
    ctx = tokens(300, 1)
    pol.on_turn_finished(req("X", ctx[:200]), 0, np.zeros(0, dtype=np.int32))
    big = states(2, bs=128)
    pol.choose(req("warm", [1]), big)  # learn the 128-token blocks
    hits = pol.gpu_hits(big, chain_hashes(ctx), len(ctx))
    assert hits == {0: pytest.approx(1 / 2), 1: 0.0}  # 128 of 200 cached tokens reusable; 2 blocks
    assert pol.estimated_cached_tokens(0, ctx) == 128


def test_kv_usage_is_modelled_blocks_over_capacity():
    cap = 64 * BLOCK_SIZE
    pol = VerlKvAwarePolicy(2)
    pol.choose(req("warm", [1]), states(2, cap=cap))
    pol.on_turn_finished(req("X", tokens(16 * 16, 3)), 1, np.zeros(0, dtype=np.int32))
    assert pol.kv_usage(1) == pytest.approx(16 / 64)
    pol.on_turn_finished(req("Y", tokens(100 * 16, 4)), 1, np.zeros(0, dtype=np.int32))
    assert pol.kv_usage(1) == 1.0  # capped, LRU evicts beyond capacity
    assert pol.kv_usage(0) == 0.0


def test_least_inflight_slow_cut():
    pol = VerlKvAwarePolicy(3, slow_cut="least-inflight")
    occupy(pol, 3, 0, 1)
    occupy(pol, 3, 1, 1)
    pol.on_turn_finished(req("X", tokens(512, 1)), 0, np.zeros(0, dtype=np.int32))
    assert pol.choose(req("Y", tokens(512, 1)), states(3)) == 2  # cache ignored


def test_capacity_token_aware_slow_cut():
    cap = 100 * BLOCK_SIZE
    pol = VerlKvAwarePolicy(3, slow_cut="capacity-token-aware", overload_mode="None")
    # cold start: fewest in-flight prompt tokens
    pol.choose(req("a", tokens(300, 1)), only(3, 0, cap=cap))
    pol.choose(req("b", tokens(100, 2)), only(3, 1, cap=cap))
    assert pol.choose(req("c", tokens(50, 3)), states(3, cap=cap)) == 2
    pol.on_turn_finished(req("c", tokens(50, 3)), 2, tokens(2, 4))
    # bound (shortcut off via do_shortcut=False below): the largest remaining KV among
    # engines with avail >= cap * (1 - load_threshold)
    pol2 = VerlKvAwarePolicy(3, slow_cut="capacity-token-aware", do_shortcut=False, load_threshold=0.5)
    ctx = tokens(320, 5)
    pol2.choose(req("d", ctx), only(3, 2, cap=cap))
    pol2.on_turn_finished(req("d", ctx), 2, tokens(2, 6))  # d's prefix cached on engine 2
    pol2.choose(req("e", tokens(60 * 16, 7)), only(3, 0, cap=cap))  # engine 0: 60% in use
    pol2.choose(req("f", tokens(10 * 16, 8)), only(3, 1, cap=cap))  # engine 1: 10% in use
    pol2.choose(req("g", tokens(15 * 16, 9)), only(3, 2, cap=cap))  # engine 2: 15% in use
    ctx1 = np.concatenate([ctx, tokens(2, 6), tokens(30, 10)])
    # remaining: e0 ineligible (avail 640 < 800); e1 1440 - 352 = 1088; e2 1360 - 32 = 1328
    assert pol2.choose(req("d", ctx1, 1), states(3, cap=cap)) == 2


# ---------------------------------------------------------------- health and bookkeeping
def test_unhealthy_engines_are_never_chosen():
    rng = np.random.default_rng(0)
    pol = VerlKvAwarePolicy(4, max_num_seqs=4)
    for t in range(200):
        healthy = [bool(b) for b in rng.integers(0, 2, 4)]
        if not any(healthy):
            healthy[int(rng.integers(4))] = True
        tid = f"t{t % 7}"
        ctx = tokens(int(rng.integers(1, 200)), t)
        e = pol.choose(req(tid, ctx), states(4, healthy=healthy))
        assert healthy[e]
        if rng.random() < 0.7:
            pol.on_turn_finished(req(tid, ctx), e, tokens(5, t + 1000))
    with pytest.raises(NoHealthyEngineError):
        pol.choose(req("z", [1]), states(4, healthy=[False] * 4))


def test_bound_engine_unhealthy_rebinds():
    pol = VerlKvAwarePolicy(2)
    ctx1 = _bound_to_engine0(pol)
    assert pol.choose(req("A", ctx1, 1), states(2, healthy=[False, True])) == 1
    assert pol.engine_of("A") == 1


def test_inflight_counts_are_released():
    pol = VerlKvAwarePolicy(2)
    ctx = tokens(100, 1)
    e = pol.choose(req("A", ctx), states(2))
    assert pol.inflight[e] == 1 and pol.inflight_tokens[e] == 100
    pol.on_turn_finished(req("A", ctx), e, tokens(3, 2))
    assert pol.inflight == [0, 0] and pol.inflight_tokens == [0, 0]
    e = pol.choose(req("B", ctx), states(2))
    pol.on_trajectory_finished("B")  # a turn abandoned in flight is released too
    assert pol.inflight == [0, 0] and not any(pol._active_blocks)


# ---------------------------------------------------------------- brute-force reference
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_choose_matches_bruteforce_score(data):
    n = data.draw(st.integers(1, 5), label="engines")
    alpha = data.draw(st.floats(0.0, 1.0), label="alpha")
    thr = data.draw(st.floats(0.05, 0.95), label="load_threshold")
    raw = data.draw(st.lists(st.integers(0, 4), min_size=4, max_size=4).filter(any), label="load_w")
    lw = tuple(x / sum(raw) for x in raw)
    assume(abs(sum(lw) - 1.0) <= 1e-9)
    m = data.draw(st.integers(1, 8), label="max_num_seqs")
    caps = [data.draw(st.integers(4, 64)) for _ in range(n)]  # blocks
    cached = [data.draw(st.integers(0, c)) for c in caps]  # leading blocks of `base` cached
    infl = [data.draw(st.integers(0, 9)) for _ in range(n)]
    running = [data.draw(st.integers(0, 10)) for _ in range(n)]
    waiting = [data.draw(st.integers(0, 10)) for _ in range(n)]
    healthy = data.draw(st.lists(st.booleans(), min_size=n, max_size=n).filter(any), label="healthy")
    q_blocks = data.draw(st.integers(0, 64), label="query_blocks")
    tail = data.draw(st.integers(0, BLOCK_SIZE - 1), label="tail")
    bound = data.draw(st.one_of(st.none(), st.integers(0, n - 1)), label="bound")
    seed = data.draw(st.integers(0, 2 ** 31), label="seed")

    base = tokens(64 * BLOCK_SIZE, seed)
    caps_tok = [c * BLOCK_SIZE for c in caps]
    kw = dict(cap=caps_tok, running=running, waiting=waiting)
    pol = VerlKvAwarePolicy(n, alpha=alpha, load_threshold=thr, load_weights=lw, max_num_seqs=m)
    for i in range(n):
        if cached[i]:
            pol.on_turn_finished(req(f"seed{i}", base[:cached[i] * BLOCK_SIZE]), i, np.zeros(0, np.int32))
    if bound is not None:  # bind Q to `bound` with a cache-neutral turn, then finish it
        pol.choose(req("Q", [7, 7, 7, 7]), only(n, bound, **kw))
        pol.on_turn_finished(req("Q", [7, 7, 7, 7]), bound, np.array([9, 9], np.int32))
    for i in range(n):
        occupy(pol, n, i, infl[i], **kw)
    ctx = np.concatenate([base[:q_blocks * BLOCK_SIZE], tokens(tail, seed + 1)])
    chosen = pol.choose(req("Q", ctx, 1), states(n, healthy=healthy, **kw))

    def load(i):
        kv = min(1.0, cached[i] / caps[i])
        return (lw[0] * kv + lw[1] * min(1.0, running[i] / m) + lw[2] * min(1.0, waiting[i] / m)
                + lw[3] * min(1.0, infl[i] / m))

    assert healthy[chosen]
    if bound is not None and healthy[bound]:
        assume(abs(load(bound) - thr) > 1e-9)
        if load(bound) <= thr:
            assert chosen == bound
            return
    score = {}
    for i in range(n):
        if healthy[i]:
            hit = min(cached[i], q_blocks) / q_blocks if q_blocks else 0.0
            score[i] = alpha * 0.7 * hit + (1 - alpha) * (1 - load(i))
    best = max(score.values())
    assert score[chosen] >= best - 1e-9
    assert all(score[j] <= score[chosen] + 1e-9 for j in score if j < chosen)  # ties: first engine


# ---------------------------------------------------------------- simulator
def _workload(groups=3, trials=2, turns=3, prompt_len=200, resp=24, env=30):
    from war_openrlhf.traces import TokenizedTrajectory, Turn
    rng = np.random.default_rng(0)
    out = []
    for g in range(groups):
        prompt = rng.integers(0, 50_000, prompt_len, dtype=np.int32)
        for k in range(trials):
            parts, spans, n = [prompt], [], prompt_len
            for t in range(turns):
                r = rng.integers(0, 50_000, resp, dtype=np.int32)
                e = rng.integers(0, 50_000, env if t + 1 < turns else 0, dtype=np.int32)
                spans.append((n, resp, len(e)))
                parts += [r, e]
                n += resp + len(e)
            s = np.concatenate(parts)
            turns_ = [Turn(s[:c], s[c:c + r], e) for c, r, e in spans]
            out.append(TokenizedTrajectory(f"g{g}t{k}", f"g{g}", turns_))
    return out


def test_runs_in_the_cluster_simulator():
    from war_openrlhf.simulation.cluster import SimConfig, simulate
    trajs = _workload()
    pol = VerlKvAwarePolicy(2, max_num_seqs=4)
    res = simulate(trajs, pol, SimConfig(num_engines=2, tool_delay_s=0.05, per_env_token_s=1e-4,
                                         kv_capacity_tokens=4096, max_num_seqs=4, steps=2))
    assert res.policy == "verl_kv_aware"
    assert res.turns == sum(len(t.turns) for t in trajs)
    assert 0.0 < res.hit_rate <= 1.0
    assert pol.inflight == [0, 0] and pol.inflight_tokens == [0, 0]
