"""Tests of war_openrlhf.dispatch: the peer dispatch policies and the block-hash index (WAR's
own policy: tests/test_war_dispatch.py)."""

from __future__ import annotations

import random
from collections import Counter, OrderedDict

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
def test_registry_has_seven_policies():
    assert set(POLICIES) == {"round_robin", "least_loaded", "sticky", "sglang_cache_aware",
                             "dynamo_kv", "verl_kv_aware", "war"}
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
def test_each_policy_declares_typed_options_matching_its_constructor(name):
    import dataclasses
    import inspect

    from war_openrlhf.dispatch import PolicyOptions

    cls = POLICIES[name]
    assert issubclass(cls.Options, PolicyOptions) and cls.Options.__module__ == cls.__module__
    params = {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()
              if k not in ("self", "num_engines")}
    assert {f.name: f.default for f in dataclasses.fields(cls.Options)} == params
    options = cls.Options()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.x = 1
    assert make_policy(name, 2, options).name == name  # built from the typed options


def test_make_policy_takes_typed_options_or_keywords_not_both():
    from war_openrlhf.dispatch.sticky import StickyOptions

    assert make_policy("sticky", 2, StickyOptions(lru_capacity=3)).lru_capacity == 3
    with pytest.raises(ValueError, match="bad configuration for 'war': pass a WarOptions"):
        make_policy("war", 2, StickyOptions())
    with pytest.raises(ValueError, match="pass a StickyOptions or keyword options"):
        make_policy("sticky", 2, StickyOptions(), lru_capacity=3)
    with pytest.raises(ValueError, match="kv_capacity_tokens has 3 entries for 2 engines"):
        make_policy("war", 2, kv_capacity_tokens=[1, 2, 3])


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


def test_sticky_ties_to_lower_id_and_replaces_unhealthy_for_good():
    pol = make_policy("sticky", 3)
    assert pol.lru_capacity == 10000  # verl DEFAULT_ROUTING_CACHE_SIZE
    assert pol.choose(req("t1", [1]), states([2, 1, 1])) == 1  # tie 1 == 1: lower id
    # verl: a stale entry (server removed) is deleted and the request re-placed; the new
    # binding stays when the old engine comes back.
    assert pol.choose(req("t1", [1, 2]), states([5, 0, 1], healthy=[True, False, True])) == 2
    assert pol.choose(req("t1", [1, 2, 3]), states([0, 0, 9])) == 2
    pol.on_trajectory_finished("t1")  # verl never deletes entries: only the LRU ages them out
    assert pol.engine_of("t1") == 2


class _VerlLoadBalancer:
    """verl v0.9.0 ``GlobalRequestLoadBalancer`` (verl/workers/rollout/llm_server.py:46-121),
    transcribed: cachetools LRUCache request_id -> server, in-flight counts incremented at
    acquire and decremented at release, ties to the first server in dict order."""

    def __init__(self, n, max_cache_size):
        import cachetools

        self._inflight = {sid: 0 for sid in range(n)}
        self._cache = cachetools.LRUCache(maxsize=max_cache_size)

    def acquire(self, request_id):
        if request_id in self._cache:
            sid = self._cache[request_id]
            if sid in self._inflight:
                self._inflight[sid] += 1
                return sid
            del self._cache[request_id]
        m = min(self._inflight.values())
        sid = [s for s, c in self._inflight.items() if c == m][0]
        self._cache[request_id] = sid
        self._inflight[sid] += 1
        return sid

    def release(self, sid):
        if sid in self._inflight and self._inflight[sid] > 0:
            self._inflight[sid] -= 1

    def remove(self, sid):
        self._inflight.pop(sid, None)


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 4), cap=st.integers(1, 6),
       ops=st.lists(st.tuples(st.sampled_from(["acq", "acq", "acq", "rel", "rm"]), st.integers(0, 9)),
                    max_size=60))
def test_sticky_is_verls_load_balancer(n, cap, ops):
    """Fed the in-flight counts as ``running`` (what the simulator and the pool report), the
    policy picks what verl's load balancer picks, on any sequence of turns, completions and
    server removals."""
    ref, pol = _VerlLoadBalancer(n, cap), make_policy("sticky", n, lru_capacity=cap)
    inflight, healthy = [0] * n, [True] * n
    for op, k in ops:
        if op == "acq" and any(healthy):
            got = pol.choose(req(f"t{k}", [k]), states(inflight, healthy=list(healthy)))
            assert got == ref.acquire(f"t{k}")
            inflight[got] += 1
        elif op == "rel" and any(inflight):
            sid = [i for i in range(n) if inflight[i]][k % sum(1 for x in inflight if x)]
            inflight[sid] -= 1
            ref.release(sid)
        elif op == "rm" and sum(healthy) > 1:
            sid = k % n
            healthy[sid] = False
            ref.remove(sid)
        assert len(pol) == len(ref._cache)


# ---------------------------------------------------------------- SGLang cache-aware
PROMPT = np.arange(1000, 1200)


def test_sglang_imbalanced_picks_shortest_queue_and_still_inserts():
    pol = make_policy("sglang_cache_aware", 2)
    assert pol.choose(req("x", PROMPT), states([0, 0])) == 0  # empty tree: a miss, min load
    assert pol.last_decision == "min_load"
    # 100 vs 10: diff 90 > 64 and 100 > 1.5*10 -> shortest queue despite engine 0's prefix.
    assert pol.choose(req("y", toks(PROMPT, [1, 2, 3])), states([100, 10])) == 1
    assert pol.last_decision == "shortest_queue"
    assert pol.size_of(1) == len(PROMPT) + 3
    # 70 vs 10 (diff 60 <= 64): balanced, a hit. Both engines hold PROMPT; the router takes
    # the node's creator (engine 0), not the less loaded holder.
    assert pol.choose(req("z", toks(PROMPT, [7])), states([70, 10])) == 0
    assert pol.last_decision == "cache_match"


def test_sglang_imbalance_is_strict_on_both_thresholds_over_healthy_engines():
    pol = make_policy("sglang_cache_aware", 3)
    assert pol.choose(req("a", PROMPT), states([0, 0, 0])) == 0
    assert pol.choose(req("b", PROMPT), states([74, 10, 74])) == 0  # diff 64: not > 64
    assert pol.last_decision == "cache_match"
    assert pol.choose(req("c", PROMPT), states([75, 10, 75])) == 1  # diff 65, 75 > 15
    assert pol.last_decision == "shortest_queue"
    assert pol.choose(req("d", PROMPT), states([195, 130, 195])) == 0  # 195 = 1.5*130: not >
    assert pol.last_decision == "cache_match"
    assert pol.choose(req("e", PROMPT), states([196, 130, 196])) == 1
    assert pol.last_decision == "shortest_queue"
    # An unhealthy engine's load is not part of the spread (the router gathers healthy workers).
    assert pol.choose(req("f", PROMPT), states([100, 90, 0], healthy=[True, True, False])) == 0
    assert pol.last_decision == "cache_match"


def test_sglang_miss_goes_to_min_load_with_processed_then_id_ties():
    pol = make_policy("sglang_cache_aware", 3)
    assert pol.choose(req("a", np.arange(0, 500)), states([0, 0, 0])) == 0
    assert pol.choose(req("b", np.arange(600, 700)), states([0, 0, 0])) == 1  # processed 1,0,0
    assert pol.choose(req("c", np.arange(800, 1100)), states([0, 0, 0])) == 2
    assert [pol.size_of(i) for i in range(3)] == [500, 100, 300]
    # 50 of 500 tokens match engine 0 (rate 0.1 <= 0.3): a miss goes to the least loaded
    # engine (2), not the smallest tree (1) as the router did before sglang PR #14650.
    assert pol.choose(req("d", toks(np.arange(0, 50), np.arange(20000, 20450))),
                      states([5, 3, 1])) == 2
    assert pol.last_decision == "min_load"
    assert pol.processed == [1, 1, 2]
    assert pol.choose(req("e", np.arange(30000, 30100)), states([2, 2, 2])) == 0  # processed 1 (id 0)
    assert pol.choose(req("f", np.arange(40000, 40100)), states([2, 2, 2])) == 1


def test_sglang_match_rate_threshold_is_strict():
    pol = make_policy("sglang_cache_aware", 2)
    assert pol.choose(req("a", np.arange(0, 100)), states([0, 0])) == 0
    # 30 of 100 tokens match: rate 0.3 is not > 0.3 (in f32 too): a miss, min load.
    assert pol.choose(req("b", toks(np.arange(0, 30), np.arange(500, 570))), states([5, 0])) == 1
    assert pol.last_decision == "min_load"
    # 31 of 100: the walk ends inside a's leaf, whose creator is engine 0.
    assert pol.choose(req("c", toks(np.arange(0, 31), np.arange(600, 669))), states([5, 0])) == 0
    assert pol.last_decision == "cache_match" and pol.last_match_rate == pytest.approx(0.31)


def test_sglang_unhealthy_matched_engine_falls_back_to_first_healthy_without_insert():
    pol = make_policy("sglang_cache_aware", 3)
    assert pol.choose(req("a", PROMPT), states([0, 0, 0])) == 0
    got = pol.choose(req("b", toks(PROMPT, [1])), states([0, 5, 0], healthy=[False, True, True]))
    assert got == 1 and pol.last_decision == "first_healthy"  # not min load (2)
    assert pol.size_of(1) == 0 and pol.processed == [1, 0, 0]


def test_sglang_page_size_matches_whole_pages_only():
    a, q = np.arange(0, 100), toks(np.arange(0, 31), np.arange(1000, 1069))  # 31 of 100 shared
    tok = make_policy("sglang_cache_aware", 2)
    page = make_policy("sglang_cache_aware", 2, page_size=16)
    for pol in (tok, page):
        assert pol.choose(req("a", a), states([0, 0])) == 0
    assert page.size_of(0) == 96  # the 4-token tail is not inserted
    assert tok.choose(req("q", q), states([3, 0])) == 0  # 31/100 > 0.3: hit
    assert page.choose(req("q", q), states([3, 0])) == 1  # 16/100: one whole page, a miss
    assert page.last_match_rate == pytest.approx(0.16)
    assert page.choose(req("s", np.arange(0, 15)), states([0, 0])) in (0, 1)
    assert page.size_of(0) + page.size_of(1) == 96 + 96  # shorter than a page: nothing inserted


def test_sglang_tree_evicts_lru_leaves():
    pol = make_policy("sglang_cache_aware", 1, max_tree_size=300)
    pol.choose(req("a", np.arange(0, 200)), states([0]))
    pol.choose(req("b", toks(np.arange(0, 100), np.arange(500, 600))), states([0]))  # split
    assert pol.size_of(0) == 300
    assert pol.tree.match(toks(np.arange(0, 150), [9])) == (150, 0)
    pol.choose(req("c", np.arange(900, 1000)), states([0]))  # 400 > 300: evict LRU leaf (a's)
    assert pol.size_of(0) == 300
    assert pol.tree.held_prefix(np.arange(0, 200), 0) == 100  # a's leaf [100, 200) evicted
    assert pol.tree.held_prefix(toks(np.arange(0, 100), np.arange(500, 600)), 0) == 200
    assert pol.tree.match(np.arange(0, 200))[0] == 100  # the node went with its last tenant


def _first_lcp(a, b):
    n = min(len(a), len(b))
    neq = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(neq[0]) if len(neq) else n


@settings(max_examples=150, deadline=None)
@given(ins=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2), st.lists(st.integers(0, 2), max_size=8)),
                    max_size=14),
       queries=st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(0, 2), max_size=8)), min_size=1,
                        max_size=6))
def test_sglang_tree_matches_brute_force(ins, queries):
    """The walk's match length is the longest prefix shared with anything inserted; its tenant
    is the one whose insert first reached that depth (the node's creator: ST:447/487); a
    tenant's size is the number of distinct prefixes it inserted."""
    from war_openrlhf.dispatch.sglang_cache_aware import ApproxRadixTree

    stems = [np.zeros(0, np.int64), np.array([7, 7, 7]), np.array([7, 7, 8, 8])]
    tree, done = ApproxRadixTree(), []
    for tenant, stem, rest in ins:
        s = np.concatenate([stems[stem], np.asarray(rest, dtype=np.int64)])
        tree.insert(s, tenant)
        done.append((s, tenant))
    for stem, rest in queries:
        q = np.concatenate([stems[stem], np.asarray(rest, dtype=np.int64)])
        lcps = [_first_lcp(q, s) for s, _ in done]
        best = max(lcps, default=0)
        matched, tenant = tree.match(q)
        assert matched == best
        if best:
            assert tenant == next(t for (s, t), m in zip(done, lcps) if m == best)
    for t in range(3):
        prefixes = {tuple(s[:k]) for s, tt in done if tt == t for k in range(1, len(s) + 1)}
        assert tree.size_of(t) == len(prefixes)
        for stem, rest in queries:
            q = np.concatenate([stems[stem], np.asarray(rest, dtype=np.int64)])
            assert tree.held_prefix(q, t) == max([_first_lcp(q, s) for s, tt in done if tt == t], default=0)


def _first_turns(policy, sys_len, task_len, groups=32, n=8, engines=4, seed=0):
    """Dispatch the first turns of a GRPO step (all start together; nothing finishes), with
    the engines' load = the requests dispatched to them, as the router counts it."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 150_000, sys_len)
    loads, where = [0] * engines, {}
    for g in range(groups):
        prompt = toks(system, rng.integers(0, 150_000, task_len))
        for s in range(n):
            e = policy.choose(req(f"g{g}s{s}", prompt, group=f"g{g}"), states(loads))
            loads[e] += 1
            where[f"g{g}s{s}"] = (e, prompt)
    return loads, where


def test_sglang_agentic_first_turns_pile_on_the_system_prompt_engine():
    """Why the router loses to OpenRLHF's placement on agentic GRPO steps (module docstring):
    a shared system prompt that is > 30% of a first turn makes every first turn a hit on the
    engine that created the prompt's node; only a spread > 64 in-flight requests sends one
    elsewhere, so that engine keeps 64 more than the others for the step."""
    loads, where = _first_turns(make_policy("sglang_cache_aware", 4), sys_len=2000, task_len=200)
    assert loads == [64 + 192 // 4, 48, 48, 48]
    # A later turn (its own response appended) reaches its group's prompt node: the engine
    # of the group's first sample created it, and the turn goes there while the spread stays
    # <= 64 (here exactly 64), including the samples the switch had sent elsewhere.
    pol = make_policy("sglang_cache_aware", 4)
    loads, where = _first_turns(pol, sys_len=2000, task_len=200)
    moved = 0
    for i, (tid, (e, prompt)) in enumerate(where.items()):
        home = where[tid.split("s")[0] + "s0"][0]
        resp = np.arange(10_000 + 50 * i, 10_050 + 50 * i)
        assert pol.choose(req(tid, toks(prompt, resp), turn=1), states(loads)) == home
        moved += e != home
    assert moved > 0  # here 144 of 256: the next turn undoes the switch (and re-triggers it)
    # With a system prompt under 30% of the first turn a new group is a miss: min load,
    # and its samples follow their group's prompt: even spread, as OpenRLHF's placement.
    assert _first_turns(make_policy("sglang_cache_aware", 4), sys_len=50, task_len=200)[0] == [64] * 4
    assert _first_turns(make_policy("least_loaded", 4, n_samples_per_prompt=8), 2000, 200)[0] == [64] * 4
    # slime's thresholds (abs 10, rel 1.2) bound the pile-up: a hit lands only while
    # max - min <= 10 or max <= 1.2 * min.
    pol = make_policy("sglang_cache_aware", 4, balance_abs_threshold=10, balance_rel_threshold=1.2)
    loads = _first_turns(pol, 2000, 200)[0]
    assert max(loads) <= max(min(loads) + 11, 1.2 * min(loads) + 1)


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


def _reference_chain(tokens, parent=None):
    """The chain hash written out per block, as block_index's docstring defines it: a block's 16
    int32 tokens read as 8 little-endian uint64 words (token pairs), their sum with the odd
    multipliers mod 2**64, one xor-shift round, then ``h = P * parent + C1 * x``."""
    from war_openrlhf.dispatch import block_index as bi
    h = bi.ROOT_HASH if parent is None else parent
    mask = (1 << 64) - 1
    out = []
    u32 = [int(t) & 0xFFFFFFFF for t in tokens]
    for b in range(len(u32) // BLOCK_SIZE):
        blk = u32[b * BLOCK_SIZE:(b + 1) * BLOCK_SIZE]
        words = [blk[2 * i] | (blk[2 * i + 1] << 32) for i in range(BLOCK_SIZE // 2)]
        x = sum(w * int(m) for w, m in zip(words, bi._MULT)) & mask
        x ^= x >> 31
        h = (bi._P * h + bi._C1 * x) & mask
        out.append(h)
    return out


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(-2 ** 31, 2 ** 31 - 1), max_size=100),
       parent=st.integers(0, 2 ** 64 - 1), offset=st.integers(0, 3))
def test_chain_hashes_equal_the_per_block_reference(tokens, parent, offset):
    """The vectorised chain (token-pair views, folded powers) against a per-block loop of
    Python integers, from any parent, on an array that does not start at an 8-byte boundary."""
    backing = np.zeros(len(tokens) + offset, dtype=np.int32)
    backing[offset:] = tokens
    arr = backing[offset:]
    assert chain_hashes(arr, parent) == _reference_chain(tokens, parent)
    assert chain_hashes(arr) == _reference_chain(tokens)
    strided = np.repeat(np.asarray(tokens, dtype=np.int32), 2)[::2]  # not contiguous
    assert chain_hashes(strided) == _reference_chain(tokens)


@settings(max_examples=80, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(["sync", "sync_lazy", "extend", "extend_lazy",
                                                  "flush"]), seq_strategy), min_size=1, max_size=8))
def test_lazy_chain_hashes_what_it_took_and_predicts_the_next_block(steps):
    """Any mix of hashing and non-hashing syncs and extends: the hashed part is the chain of the
    context's first blocks, the tail holds the rest, ``next_hash`` is the next block's hash, and
    a flush leaves exactly the full chain."""
    tc = TrajectoryChain()
    ctx = np.zeros(0, dtype=np.int32)
    for op, chunk in steps:
        ctx = toks(ctx, chunk)
        if op == "flush":
            tc.sync(ctx, hash_blocks=False)
            tc.flush()
        elif op.startswith("sync"):
            tc.sync(ctx, hash_blocks=op == "sync")
        else:
            tc.extend(np.asarray(chunk, dtype=np.int32), hash_blocks=op == "extend")
        full = chain_hashes(ctx)
        nb = len(tc.hashes)
        assert tc.hashes == full[:nb] and tc.n_tokens == len(ctx)
        assert tc.unhashed_blocks == len(full) - nb
        if op in ("sync", "extend", "flush"):
            assert nb == len(full)
        assert tc.next_hash() == (full[nb] if nb < len(full) else None)
    assert tc.rehashes == 0
    tc.flush()
    assert tc.hashes == chain_hashes(ctx)


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


class _OrderedLru:
    """The reference the index must equal: per engine one ordered map, every touched chain
    moved to the most-recent end leaf first, root last; evictions from the least-recent end."""

    def __init__(self, engines, cap):
        self.od = [OrderedDict() for _ in range(engines)]
        self.cap = [cap] * engines

    def touch(self, e, chain):
        for h in reversed(chain):
            if h in self.od[e]:
                self.od[e].move_to_end(h)
            else:
                self.od[e][h] = None
        self.evict(e)

    def evict(self, e):
        while len(self.od[e]) > self.cap[e]:
            self.od[e].popitem(last=False)

    def remove(self, e, hashes):
        for h in hashes:
            self.od[e].pop(h, None)


@pytest.mark.parametrize("tree_only", [True, False])
@pytest.mark.parametrize("seed", range(12))
def test_block_index_evicts_exactly_as_the_ordered_lru(seed, tree_only):
    """Random walks of touches of chains from the root (trajectories sharing prompts, touched
    up to any block), capacity changes, removals of leaves and of inner blocks, runs stored
    without their root, and clears: after every operation each engine caches exactly the
    reference's blocks, and the reverse map agrees. ``tree_only``: chains from the root,
    capacity changes, leaf removals and clears only, so the engines never leave the tree."""
    rng = random.Random(seed)
    stems = [np.zeros(48, dtype=np.int32), np.arange(64, dtype=np.int32) % 3]
    trajs = [chain_hashes(toks(stems[t % 3 % 2], np.full(16 * (2 + t % 5), t + 1), np.arange(t)))
             for t in range(10)]
    cap = rng.randint(2, 24)
    idx = BlockHashIndex(2, [cap, cap])
    ref = _OrderedLru(2, cap)
    for _ in range(300):
        e = rng.randrange(2)
        chain = trajs[rng.randrange(len(trajs))]
        lo = rng.randrange(len(chain))
        hi = rng.randrange(lo, len(chain))
        kind = rng.random()
        if kind < 0.6:  # a trajectory's context up to some block, from the root
            idx.touch(e, chain[:hi + 1])
            ref.touch(e, chain[:hi + 1])
        elif kind < 0.7:
            c = rng.randint(1, 30)
            idx.set_capacity(e, c)
            ref.cap[e] = c
            ref.evict(e)
        elif kind < 0.85:  # blocks removed: the chain's cached leaf, or any run
            inner = {c[i - 1] for c in trajs for i in range(1, len(c)) if c[i] in ref.od[e]}
            leaves = [h for h in chain if h in ref.od[e] and h not in inner]
            run = leaves[-1:] if tree_only or rng.random() < 0.5 else chain[lo:hi + 1]
            idx.remove(e, run)
            ref.remove(e, run)
        elif kind < 0.95 and not tree_only:  # a stored run continuing a parent (KV events)
            idx.touch(e, chain[lo:hi + 1], from_root=False)
            ref.touch(e, chain[lo:hi + 1])
        elif kind >= 0.97:
            idx.clear(e)
            ref.od[e].clear()
        for eng in range(2):
            assert set(idx.blocks(eng)) == set(ref.od[eng]), (kind, eng)
            assert idx.cached_blocks(eng) == len(ref.od[eng])
            if tree_only:
                assert idx._ordered[eng] is None
        want = {}
        for eng in range(2):
            for h in ref.od[eng]:
                want[h] = want.get(h, 0) | (1 << eng)
        assert idx.holders == want


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
        assert mask and all(((mask >> e) & 1) == (h in idx.blocks(e)) for e in range(2))
    assert all(h in idx.holders for e in range(2) for h in idx.blocks(e))


@settings(max_examples=30, deadline=None)
@given(cap=st.integers(0, 30), seqs=st.lists(st.tuples(st.integers(0, 2), seq_strategy),
                                           min_size=1, max_size=10))
def test_war_index_never_exceeds_kv_capacity(cap, seqs):
    pol = make_policy("war", 3, kv_capacity_tokens=cap * BLOCK_SIZE)
    for i, (e, s) in enumerate(seqs):
        r = req(f"t{i}", toks(np.arange(64) % 5, s))
        pol.on_turn_finished(r, e, np.arange(20, dtype=np.int32))
        assert all(pol.index.cached_blocks(k) <= cap for k in range(3))


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
