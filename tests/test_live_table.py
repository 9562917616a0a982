"""The dispatcher's live-trajectory columns against brute-force references."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from war_openrlhf.dispatch import DEFER, EngineState, TurnRequest, make_policy
from war_openrlhf.dispatch.live_table import LiveTable


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "set", "remove"]), st.integers(0, 3),
                              st.integers(0, 9), st.integers(1, 5000)), max_size=300))
def test_the_table_holds_what_a_dict_of_rows_holds(ops):
    table, ref, rows = LiveTable(capacity=4), {}, []
    for op, engine, turns, tokens in ops:
        if op == "add" or not rows:
            row = table.add(engine, turns, tokens)
            assert row not in ref
            ref[row] = (engine, turns, tokens)
            rows.append(row)
        elif op == "set":
            row = rows[tokens % len(rows)]
            table.engine[row], table.turns[row], table.tokens[row] = engine, turns, tokens
            ref[row] = (engine, turns, tokens)
        else:
            row = rows.pop(tokens % len(rows))
            table.remove(row)
            del ref[row]
            with pytest.raises(KeyError):
                table.remove(row)
        assert table.rows == len(ref)
        for e in range(4):
            ks, toks = table.of_engine(e)
            want = sorted((t, float(n)) for (en, t, n) in ref.values() if en == e)
            assert sorted(zip(ks.tolist(), toks.tolist())) == want


def _reference_curve(policy, e):
    """The footprint projection as the per-trajectory loop computed it."""
    shared = policy._shared0_sum / max(policy._x0_count, 1)
    ks, owns = [], []
    for rec in policy._live.values():
        if rec.engine == e:
            ks.append(rec.turns)
            owns.append(max(rec.tokens - shared, 0.0))
    return policy._curve(ks, owns)


def test_the_engines_footprint_curves_equal_the_per_trajectory_loop():
    """A WAR policy over 3 engines, 300 trajectories of uneven length finishing at random: at
    every tenth turn each engine's projection from the columns equals the loop's."""
    rng = np.random.default_rng(3)
    E, N = 3, 300
    policy = make_policy("war", E, kv_capacity_tokens=20_000)
    policy.start_batch()
    ctx = {f"t{i}": list(rng.integers(0, 30000, int(rng.integers(20, 200)))) for i in range(N)}
    length = {t: int(rng.integers(1, 8)) for t in ctx}
    turn = {t: 0 for t in ctx}
    live = list(ctx)
    checks = 0
    step = 0
    while live:
        tid = live[int(rng.integers(0, len(live)))]
        req = TurnRequest(tid, f"g{int(tid[1:]) // 8}", np.asarray(ctx[tid], dtype=np.int32), turn[tid], 0,
                          arrival_s=float(step))
        states = [EngineState(e, int(rng.integers(0, 5)), 0, 0, 20_000, int(rng.integers(0, 3)), True, 16)
                  for e in range(E)]
        eid = policy.choose(req, states)
        if eid == DEFER:
            step += 1
            continue
        resp = np.asarray(rng.integers(0, 30000, int(rng.integers(1, 60))), dtype=np.int32)
        policy.on_turn_finished(req, eid, resp)
        ctx[tid] += resp.tolist() + [1, 2, 3]
        turn[tid] += 1
        if turn[tid] >= length[tid]:
            policy.on_trajectory_finished(tid)
            live.remove(tid)
        step += 1
        if step % 10 == 0:
            for e in range(E):
                policy._curves[e] = None
                got, want = policy._engine_curve(e), _reference_curve(policy, e)
                np.testing.assert_allclose(got[0], want[0], rtol=1e-12, atol=1e-9)
                np.testing.assert_allclose(got[1], want[1], rtol=1e-12, atol=1e-6)
                checks += 1
    assert checks > 100 and policy._live_table.rows == 0
