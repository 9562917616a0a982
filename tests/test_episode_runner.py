"""The episode runner, the step-result contract and the engine client's deadline, without
engines: a fake turn service (pure logic under test, no vLLM) and small agent classes that
misbehave the way real ones do (a blocking tool, a hostile result, a hung engine)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from openrlhf.utils.agent import AgentInstanceBase

from war_openrlhf.rollout import RolloutConfig, run_episode
from war_openrlhf.rollout.engine_client import EngineClient, EngineDead
from war_openrlhf.rollout.turn_result import TurnResult
from war_openrlhf.training.samples_generator import RolloutFailed, healthy_groups


class CharTokenizer:
    """One token per character (ids are code points): exact round trips, no files."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


class FakeService:
    """Answers every turn with the text ``reply`` (its tokens, logprob -0.5 each)."""

    def __init__(self, reply: str = "<answer>5</answer>", extra_tokens: int = 0) -> None:
        self.reply, self.extra = reply, extra_tokens
        self.parked: dict[str, int] = {}
        self.turns = 0

    async def generate_turn(self, trajectory_id, group_id, context, sampling_params, turn_index, tokens_so_far):
        self.turns += 1
        ids = [ord(c) for c in self.reply][: sampling_params["max_tokens"]] + [ord("x")] * self.extra
        return TurnResult(token_ids=ids, logprobs=[-0.5] * len(ids), engine=0, finish_reason="stop",
                          num_prompt_tokens=len(context), num_cached_tokens=0, weight_versions=(2, 2))

    def park(self, trajectory_id, engine):
        self.parked[trajectory_id] = engine

    def unpark(self, trajectory_id):
        self.parked.pop(trajectory_id, None)


def _agent(step_result=None, block_s: float = 0.0):
    class Agent(AgentInstanceBase):
        async def __init__(self, *a, **k):  # noqa: D401 - OpenRLHF's async-constructor style
            pass

        async def reset(self, states, **kwargs):
            return {"observation": states["observation"]}

        async def step(self, states, **kwargs):
            if block_s:
                time.sleep(block_s)  # a synchronous tool inside an async step
            if step_result is not None:
                return step_result
            return {"rewards": 1.0, "scores": 1.0, "environment_feedback": "", "done": True,
                    "sampling_params": states["sampling_params"], "extra_logs": {"tool_calls": 1.0}}

    Agent.__init__ = lambda self, *a, **k: None
    return Agent


def _cfg(**kw):
    base = dict(max_turns=3, max_context_tokens=256, max_new_tokens_per_turn=32, tool_timeout_s=0.5,
                agent_func_path="my_agent.py", progress=False)
    base.update(kw)
    return RolloutConfig(**base)


def _episode(service, agent, cfg, tid="t0"):
    return run_episode(service, agent, CharTokenizer(), cfg, prompt="Q: 2+3? ", label="5", trajectory_id=tid,
                       group_id="g0")


def test_a_healthy_episode_keeps_tokens_mask_logprobs_and_versions():
    traj = asyncio.run(_episode(FakeService(), _agent(), _cfg()))
    assert traj.end_reason == "done" and traj.reward == 1.0 and traj.extra_logs == {"tool_calls": 1.0}
    traj.check()
    assert traj.turns[0].policy_versions == (2, 2)
    assert traj.action_mask.count(1) == len("<answer>5</answer>")
    assert all(lp == -0.5 for lp, m in zip(traj.logprobs, traj.action_mask) if m)


def test_a_blocking_tool_is_stopped_at_its_deadline_and_delays_only_its_own_episode():
    async def both():
        t0 = time.perf_counter()
        slow, fast = await asyncio.gather(_episode(FakeService("<tool_call>{}</tool_call>"), _agent(block_s=3.0),
                                                   _cfg(on_tool_error="end"), "slow"),
                                          _episode(FakeService(), _agent(), _cfg(), "fast"))
        return slow, fast, time.perf_counter() - t0

    slow, fast, wall = asyncio.run(both())
    assert fast.end_reason == "done" and fast.wall_s < 0.4  # not held by the blocked tool
    assert slow.end_reason == "tool_error" and "timed out after 0.5 s" in slow.error
    assert wall < 2.0  # the deadline fired while the tool still blocked its thread


def test_agents_on_the_pools_loop_run_the_same_episode_on_the_callers_thread():
    """agent_runner: loop: reset/step run on the pool's own loop and thread (no hop), and the
    episode is the one agent_runner: thread gives."""
    import threading

    seen = []

    class Where(_agent()):
        async def reset(self, states, **kwargs):
            seen.append((threading.get_ident(), asyncio.get_running_loop()))
            return await super().reset(states, **kwargs)

        async def step(self, states, **kwargs):
            seen.append((threading.get_ident(), asyncio.get_running_loop()))
            return await super().step(states, **kwargs)

    async def one(runner):
        seen.clear()
        traj = await _episode(FakeService(), Where, _cfg(agent_runner=runner))
        return traj, list(seen), (threading.get_ident(), asyncio.get_running_loop())

    on_loop, where_loop, caller = asyncio.run(one("loop"))
    on_thread, where_thread, caller_t = asyncio.run(one("thread"))
    assert where_loop == [caller, caller]  # same thread and loop as the pool
    assert all(w[0] != caller_t[0] and w[1] is not caller_t[1] for w in where_thread)
    assert (on_loop.token_ids, on_loop.action_mask, on_loop.reward, on_loop.end_reason) == \
        (on_thread.token_ids, on_thread.action_mask, on_thread.reward, on_thread.end_reason)


def test_an_agent_on_the_loop_is_stopped_at_its_deadline_when_it_awaits_and_failed_when_it_blocks_past_it():
    from war_openrlhf.rollout import episode

    class Awaits(_agent()):
        async def step(self, states, **kwargs):
            await asyncio.sleep(3.0)

    t0 = time.perf_counter()
    traj = asyncio.run(_episode(FakeService(), Awaits, _cfg(agent_runner="loop", on_tool_error="end")))
    assert traj.end_reason == "tool_error" and "timed out after 0.5 s" in traj.error
    assert time.perf_counter() - t0 < 2.0
    before = episode.LOOP_OVERRUNS["calls"]
    traj = asyncio.run(_episode(FakeService(), _agent(block_s=0.8), _cfg(agent_runner="loop", on_tool_error="end")))
    assert traj.end_reason == "tool_error" and "timed out" in traj.error  # returned, but past its deadline
    assert episode.LOOP_OVERRUNS["calls"] == before + 1


def test_an_unknown_agent_runner_is_refused_by_name():
    with pytest.raises(ValueError, match="agent_runner: 'process' is not one of thread, loop"):
        _cfg(agent_runner="process")


@pytest.mark.parametrize("bad, field", [
    ({"done": "False"}, "'done' = 'False'"),
    ({"rewards": float("nan")}, "'rewards' = nan"),
    ({"rewards": float("inf")}, "'rewards' = inf"),
    ({"extra_logs": {"x": float("nan")}}, "'extra_logs.x' = nan"),
])
def test_a_result_outside_the_contract_is_the_agents_error_and_never_a_sample(bad, field):
    result = {"rewards": 1.0, "scores": 1.0, "environment_feedback": "", "done": True, **bad}
    traj = asyncio.run(_episode(FakeService(), _agent(step_result=result), _cfg()))
    assert traj.end_reason == "agent_error" and "my_agent.py: step() returned " + field in traj.error
    with pytest.raises(RolloutFailed, match="agent_error"):
        healthy_groups([traj], 1, "fail")


def test_an_engine_returning_more_than_max_tokens_is_an_engine_error():
    traj = asyncio.run(_episode(FakeService(extra_tokens=40), _agent(), _cfg()))
    assert traj.end_reason == "engine_error" and "for max_tokens" in traj.error


def test_failed_episodes_fail_the_step_or_drop_their_whole_group():
    good = asyncio.run(_episode(FakeService(), _agent(), _cfg()))
    bad = asyncio.run(_episode(FakeService(extra_tokens=40), _agent(), _cfg()))
    batch = [good, good, bad, good]  # two groups of 2; the second holds a failure
    with pytest.raises(RolloutFailed, match="1 episode\\(s\\) failed.*engine_error.*drop_group"):
        healthy_groups(batch, 2, "fail")
    kept, dropped = healthy_groups(batch, 2, "drop_group")
    assert kept == [good, good] and dropped == 1
    assert healthy_groups([good, good], 2, "fail") == ([good, good], 0)


def test_a_hung_engine_is_treated_as_dead_at_the_turn_deadline():
    class HungEngine:
        async def generate_tokens(self, *args):
            await asyncio.sleep(30)

    client = EngineClient(0, HungEngine())

    async def call():
        t0 = time.perf_counter()
        with pytest.raises(EngineDead, match="treated as hung"):
            await client.generate_tokens([1, 2], {"max_tokens": 4}, "t", "g", timeout_s=0.2)
        return time.perf_counter() - t0

    assert asyncio.run(call()) < 1.0
    assert client.healthy is False and "within 0.2 s" in client.error


def test_experiences_of_one_batch_carry_the_same_info_keys():
    """OpenRLHF batches experiences and needs every info key in each: an episode whose agent
    logged less (its tool failed first) must not fail the step (found by tools/soak.py)."""
    from war_openrlhf.rollout import to_experiences

    full = asyncio.run(_episode(FakeService(), _agent(), _cfg()))
    bare = asyncio.run(_episode(FakeService(), _agent(), _cfg(), "t1"))
    bare.extra_logs = {}
    exps = to_experiences([full, bare], max_len=256)
    assert set(exps[0].info) == set(exps[1].info) and "tool_calls" in exps[1].info
    assert float(exps[1].info["tool_calls"][0]) == 0.0 and float(exps[0].info["tool_calls"][0]) == 1.0


def test_dropped_groups_are_refilled_with_new_prompts_while_the_dataset_lasts():
    """As OpenRLHF's generator replaces filtered prompts: a group dropped for a failed episode
    is replaced by a new prompt's group, so the training step stays full; when the data runs
    out the batch comes back short, with a warning."""
    from types import SimpleNamespace as ns

    from war_openrlhf.training.samples_generator import WarSamplesGenerator

    gen = object.__new__(WarSamplesGenerator)
    gen.args = ns(rollout=ns(batch_size=2, n_samples_per_prompt=2, vllm_generate_batch_size=None),
                  algo=ns(dynamic_filtering_enable=False), vllm=ns(enable_sleep=False))
    gen.prompts_dataloader = [(None, [f"p{i}"], [str(i)], [None]) for i in range(5)]  # one prompt per batch
    gen._dataloader_iter, gen._sample_buffer, gen.metrics = None, [], {}
    rolled = []

    def rollout(prompts, labels, **kw):
        rolled.append(list(prompts))
        kept = [p for p in prompts if p != "p1"]  # p1's group holds a failed episode: dropped
        gen.metrics = {"war/groups_dropped": float(len(prompts) - len(kept))}
        return [ns(name=f"{p}/s{s}", info={}) for p in kept for s in range(2)], 2

    gen._rollout = rollout
    out, _rate, consumed, exhausted = gen.generate_samples()
    assert rolled == [["p0", "p1"], ["p2"]] and consumed == 3  # p1 replaced by p2
    assert [e.name for e in out] == ["p0/s0", "p0/s1", "p2/s0", "p2/s1"] and not exhausted
    out, _rate, consumed, exhausted = gen.generate_samples()
    assert [e.name for e in out] == ["p3/s0", "p3/s1", "p4/s0", "p4/s1"] and consumed == 2


def test_agent_calls_in_flight_are_bounded():
    """max_agent_calls_in_flight: the most agent steps running at once (each blocking its own
    thread for a while) never exceeds the slots; with enough slots they do overlap."""
    import threading

    def counting_agent(state):
        class Agent(_agent()):
            async def step(self, states, **kwargs):
                with state["lock"]:
                    state["now"] += 1
                    state["max"] = max(state["max"], state["now"])
                time.sleep(0.1)
                with state["lock"]:
                    state["now"] -= 1
                return await super().step(states, **kwargs)
        return Agent

    def peak(slots):
        state = {"lock": threading.Lock(), "now": 0, "max": 0}

        async def batch():
            limiter = asyncio.Semaphore(slots)
            await asyncio.gather(*(run_episode(FakeService(), counting_agent(state), CharTokenizer(),
                                               _cfg(tool_timeout_s=30), prompt="Q ", label="5",
                                               trajectory_id=f"t{i}", group_id="g", limiter=limiter)
                                   for i in range(6)))
        asyncio.run(batch())
        return state["max"]

    assert peak(1) == 1 and peak(2) == 2
    assert peak(6) > 2  # not serialised when slots allow


def test_a_step_mixing_two_rollout_batches_has_uniform_info_keys():
    """A refilled step holds samples of two rollout batches whose scalars differ (found by the
    soak: 'war/warm_up_s' rides on the first batch only and OpenRLHF's batching raised KeyError)."""
    from war_openrlhf.rollout import to_experiences
    from war_openrlhf.rollout.trajectory import uniform_info
    from war_openrlhf.training.samples_generator import attach_metrics

    a = asyncio.run(_episode(FakeService(), _agent(), _cfg()))
    b = asyncio.run(_episode(FakeService(), _agent(), _cfg(), "t1"))
    first = attach_metrics(to_experiences([a], 256), {"war/warm_up_s": 1.5, "war/turns": 1.0})
    second = attach_metrics(to_experiences([b], 256), {"war/turns": 2.0})
    step = uniform_info(first + second)
    assert set(step[0].info) == set(step[1].info)
    assert float(step[1].info["war/warm_up_s"][0]) == 0.0 and float(step[0].info["war/warm_up_s"][0]) == 1.5


def test_a_refilled_steps_dropped_groups_are_summed_not_averaged():
    from types import SimpleNamespace as ns

    import torch

    from war_openrlhf.training.samples_generator import WarSamplesGenerator

    gen = object.__new__(WarSamplesGenerator)
    gen.args = ns(rollout=ns(batch_size=2, n_samples_per_prompt=1, vllm_generate_batch_size=None),
                  algo=ns(dynamic_filtering_enable=False), vllm=ns(enable_sleep=False))
    gen.prompts_dataloader = [(None, [f"p{i}"], [str(i)], [None]) for i in range(6)]
    gen._dataloader_iter, gen._sample_buffer, gen.metrics = None, [], {}
    dropped = {"p0": 1, "p1": 0, "p2": 1, "p3": 0}  # p0 and p2 dropped

    def rollout(prompts, labels, **kw):
        gen.metrics = {"war/groups_dropped": float(sum(dropped.get(p, 0) for p in prompts))}
        return [ns(info={"war/groups_dropped": torch.tensor([gen.metrics["war/groups_dropped"]])})
                for p in prompts if not dropped.get(p, 0)], 1

    gen._rollout = rollout
    out, *_ = gen.generate_samples()
    assert len(out) == 2 and {float(e.info["war/groups_dropped"][0]) for e in out} == {2.0}


def test_a_pool_with_bad_dispatcher_options_is_refused_before_any_engine_starts():
    """RolloutPool.start builds the dispatcher first (no Ray is running here: an engine start
    would fail differently)."""
    from war_openrlhf.rollout import RolloutPool

    with pytest.raises(ValueError, match="RolloutConfig.dispatch_kwargs: .*bogus"):
        RolloutPool.start(RolloutConfig(dispatch_kwargs={"bogus": 1}))


def test_a_batch_of_agent_threads_raises_the_fd_limit_or_is_refused_before_it_starts(monkeypatch):
    """agent_runner: thread holds ~3 descriptors per episode: a soft limit too low is raised
    towards the hard one; a hard limit too low refuses the batch by name, before any episode."""
    import resource

    from war_openrlhf.rollout import episode

    limits = {"soft": 1024, "hard": 100_000}
    monkeypatch.setattr(resource, "getrlimit", lambda _what: (limits["soft"], limits["hard"]))

    def setrlimit(_what, value):
        if value[0] > limits["hard"]:
            raise ValueError("not allowed")
        limits["soft"] = value[0]

    monkeypatch.setattr(resource, "setrlimit", setrlimit)
    episode.make_room_for_agent_threads(100)  # fits: untouched
    assert limits["soft"] == 1024
    episode.make_room_for_agent_threads(4096)
    assert limits["soft"] == 4096 * episode.FDS_PER_AGENT_THREAD + episode.FD_HEADROOM
    limits.update(soft=1024, hard=4096)
    with pytest.raises(RuntimeError, match="agent_runner: thread runs 4096 episodes.*agent_runner: loop"):
        episode.make_room_for_agent_threads(4096)
    assert limits["soft"] == 4096  # raised as far as allowed, still refused


def test_an_agent_thread_holds_the_descriptors_the_limit_check_counts():
    import os

    from war_openrlhf.rollout import episode

    before = len(os.listdir("/proc/self/fd"))
    threads = [episode.AgentThread(f"t{i}") for i in range(8)]
    held = len(os.listdir("/proc/self/fd")) - before
    for t in threads:
        t.close()
    assert held <= 8 * episode.FDS_PER_AGENT_THREAD


def test_reset_sees_the_sample_number_only_where_the_pool_gives_it():
    """``war_sample_index``: the episode's number in its GRPO group, in ``reset``'s states (absent
    when the caller gives none), so an agent can assign work per sample in any process."""
    seen = []

    class Agent(_agent()):
        async def reset(self, states, **kwargs):
            seen.append(dict(states))
            return {"observation": states["observation"]}

    asyncio.run(run_episode(FakeService(), Agent, CharTokenizer(), _cfg(), prompt="Q: 2+3? ", label="5",
                            trajectory_id="t1", group_id="g0", sample_index=3))
    asyncio.run(_episode(FakeService(), Agent, _cfg()))
    assert seen == [{"observation": "Q: 2+3? ", "label": "5", "war_sample_index": 3},
                    {"observation": "Q: 2+3? ", "label": "5"}]


def test_observations_encode_as_the_tokenizers_own_call_on_a_real_fast_tokenizer():
    """The episode's observation encoding (the backend alone where that gives the same ids) against
    ``tokenizer(text, add_special_tokens=False)`` on random text with special tokens, unicode and
    whitespace, in each backend state: as loaded, with truncation and padding configured on the
    backend, with special tokens split, and with the backend left splitting them the other way."""
    import random

    from transformers import AutoTokenizer

    from war_openrlhf.fixtures.tiny_model import SPECIAL_TOKENS, build_tiny_model
    from war_openrlhf.rollout.episode import _encode

    model = build_tiny_model(Path(__file__).resolve().parents[1] / ".cache" / "war_tiny_llama")
    rng = random.Random(3)
    pieces = [*SPECIAL_TOKENS, " ", "  ", "\n", "\t", "ok", " the", "é", "数据", "🙂", "<tool>", "</", "{\"a\": 1}",
              "0123", "x" * 40]

    def texts(n):
        for _ in range(n):
            yield "".join(rng.choice(pieces) for _ in range(rng.randrange(0, 12)))

    for split in (False, True):
        tok = AutoTokenizer.from_pretrained(str(model), split_special_tokens=split)
        ref = AutoTokenizer.from_pretrained(str(model), split_special_tokens=split)
        for i, text in enumerate(texts(300)):
            if i == 100:  # a backend left truncating and padding (a tokenizer.json may ship so)
                tok._tokenizer.enable_truncation(max_length=3)
                tok._tokenizer.enable_padding(length=64)
            if i % 50 == 25:  # a call elsewhere left the backend splitting special tokens the other way
                tok(text="x", split_special_tokens=not split)
            assert _encode(tok, text) == list(ref(text=text, add_special_tokens=False)["input_ids"]), (split, text)
        assert any(len(_encode(tok, t)) > 3 for t in texts(20))  # truncation never applied

    class Wrapped(CharTokenizer):  # a tokenizer whose "backend" is something else: it is called
        backend_tokenizer = tok
        truncation = padding = None
        encode_special_tokens = False

    assert _encode(Wrapped(), "ab") == [97, 98]

