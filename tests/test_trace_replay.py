"""Trace-shaped workloads (examples/trace_replay): rows built from recorded trajectories, and their
replay on real engines with every turn at its recorded length, through the WAR pool and through
OpenRLHF's own executor (the same agent file), so that every configuration does the same work."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the module's engines start inside its first test's timeout
# (the default, setup.cfg, is 300 s a test)
pytestmark = pytest.mark.timeout(600)
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
REAL_TRACES = ROOT.parent / "shared" / "traces" / "tau_airline_dev.json"
AGENT = ROOT / "examples" / "trace_replay" / "agent.py"
MODEL_DIR = Path(os.environ.get("WAR_TINY_MODEL_DIR", ROOT / ".cache" / "war_tiny_llama"))


def _dataset():
    spec = importlib.util.spec_from_file_location("trace_replay_dataset", ROOT / "examples" / "trace_replay" / "dataset.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _trace_file(tmp_path: Path, tasks: int = 4, trials: int = 2) -> Path:
    """A small tau-format trace file: each trial calls a tool once or twice, then answers."""
    records = []
    for task in range(tasks):
        for trial in range(trials):
            msgs = [{"role": "system", "content": "You are a booking agent."},
                    {"role": "user", "content": f"Change my flight number {task}."}]
            for k in range(1 + (task + trial) % 2):
                call = {"id": f"c{task}{trial}{k}", "type": "function",
                        "function": {"name": "lookup", "arguments": json.dumps({"id": task * 10 + k})}}
                msgs.append({"role": "assistant", "content": "Let me check" + " please" * trial, "tool_calls": [call]})
                msgs.append({"role": "tool", "tool_call_id": call["id"], "name": "lookup",
                             "content": f"flight {task}{k} on time" + ", gate B" * k})
            msgs.append({"role": "assistant", "content": f"Done with task {task}."})
            records.append({"task_id": task, "trial": trial, "reward": 1.0, "traj": msgs})
    path = tmp_path / "traces.json"
    path.write_text(json.dumps(records))
    return path


def test_rows_hold_recorded_lengths_observations_and_fixed_delays(tmp_path):
    ds = _dataset()
    from war_openrlhf.traces import load_chat_traces, qwen25_tokenizer, tokenize_traces

    path = _trace_file(tmp_path)
    rows = ds.generate_from_traces(path, split="all", seed=3, tool_latency_s=0.1, jitter_sigma=0.5)
    assert len(rows) == 4
    recorded = {t.trajectory_id: [len(turn.response_token_ids) for turn in t.turns]
                for t in tokenize_traces(load_chat_traces(path), qwen25_tokenizer())}
    for row in rows:
        label = json.loads(row["label"])
        assert row["prompt"].endswith("<|im_start|>assistant\n") and "Change my flight" in row["prompt"]
        for trial in label["trials"]:
            assert trial["lengths"] == recorded[f"task{label['task']}/trial{trial['trial']}"]
            assert len(trial["observations"]) == len(trial["lengths"]) - 1 == len(trial["delays"]) - 1
            assert all("on time" in o and o.endswith("<|im_start|>assistant\n") for o in trial["observations"])
            assert all(d > 0 for d in trial["delays"][:-1])
    again = ds.generate_from_traces(path, split="all", seed=3, tool_latency_s=0.1, jitter_sigma=0.5)
    other = ds.generate_from_traces(path, split="all", seed=4, tool_latency_s=0.1, jitter_sigma=0.5)
    assert again == rows and other != rows  # delays drawn once per seed: every configuration waits alike


def test_split_halves_are_disjoint_and_cover_every_task(tmp_path):
    ds = _dataset()
    path = _trace_file(tmp_path, tasks=12)
    tune = {json.loads(r["label"])["task"] for r in ds.generate_from_traces(path, split="tune")}
    report = {json.loads(r["label"])["task"] for r in ds.generate_from_traces(path, split="report")}
    assert tune and report and not tune & report and tune | report == set(range(12))
    with pytest.raises(ValueError, match="split: 'half'"):
        ds.generate_from_traces(path, split="half")
    with pytest.raises(ValueError, match="tool_latency_s: must be a finite number >= 0"):
        ds.generate_from_traces(path, tool_latency_s=float("nan"))


def test_skipping_groups_takes_the_next_tasks_of_the_half_in_task_order(tmp_path):
    """``skip_groups`` leaves out the half's first tasks, so a run can take tasks no earlier run
    of its regime used; the rows of the tasks it keeps are those of the whole half."""
    ds = _dataset()
    path = _trace_file(tmp_path, tasks=12)
    whole = ds.generate_from_traces(path, split="validation")
    tasks = [json.loads(r["label"])["task"] for r in whole]
    assert tasks == sorted(tasks) and len(tasks) == 6
    for skip in range(len(tasks)):
        for most in (None, 1, 2, 4):
            got = ds.generate_from_traces(path, split="validation", skip_groups=skip, max_groups=most)
            assert got == whole[skip:][:most]
    with pytest.raises(ValueError, match="after the first 6 tasks"):
        ds.generate_from_traces(path, split="validation", skip_groups=6)
    with pytest.raises(ValueError, match="skip_groups: must be an int >= 0"):
        ds.generate_from_traces(path, split="validation", skip_groups=-1)


@pytest.mark.skipif(not REAL_TRACES.is_file(), reason=f"real trace file not found at {REAL_TRACES}")
def test_the_shared_tau_traces_split_into_two_halves_of_the_tasks():
    ds = _dataset()
    tune = ds.generate_from_traces(REAL_TRACES, split="tune")
    report = ds.generate_from_traces(REAL_TRACES, split="report")
    assert len(tune) + len(report) == 35 and min(len(tune), len(report)) >= 14


@pytest.fixture(scope="module")
def engines():
    import ray

    from war_openrlhf.engine.actors import create_war_engines
    from war_openrlhf.engine.config import EngineConfig
    from war_openrlhf.fixtures.tiny_model import build_tiny_model

    model = build_tiny_model(MODEL_DIR)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    cfg = EngineConfig(model=str(model), dtype="float32", max_model_len=1024, enforce_eager=True,
                       speculation="auto", num_speculative_tokens=4, kv_capacity_tokens=4096)
    handles = create_war_engines(1, cfg, env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"})
    try:
        yield model, handles
    finally:
        for h in handles:
            ray.get(h.shutdown.remote())
        ray.shutdown()


def _replay_pool(model, handles):
    """A WAR pool on the module's engine running the trace-replay agent."""
    from war_openrlhf.rollout import RolloutConfig, RolloutPool, load_agent_class

    cfg = RolloutConfig(num_engines=1, engine={"model": str(model), "max_model_len": 1024},
                        agent_func_path=str(AGENT), max_context_tokens=1024, max_new_tokens_per_turn=None,
                        progress=False, max_turns=16)
    return RolloutPool(cfg, handles, agent_cls=load_agent_class(AGENT))


def test_the_war_pool_replays_every_turn_at_its_recorded_length(engines, tmp_path):
    import ray

    model, handles = engines
    stats = ray.get(handles[0].stats.remote())
    assert stats["kv_capacity_tokens"] == 4096  # the stated KV, usable (vLLM's null block not counted)
    rows = _dataset().generate_from_traces(_trace_file(tmp_path), split="all", tool_latency_s=0.01)
    pool = _replay_pool(model, handles)
    res = pool.run_batch([r["prompt"] for r in rows], [r["label"] for r in rows], n_samples_per_prompt=2)
    assert res.end_reasons == {"done": 8}
    got = sorted(tuple(len(range(t.start, t.end)) for t in traj.turns) for traj in res.trajectories)
    want = sorted(tuple(tr["lengths"]) for r in rows for tr in json.loads(r["label"])["trials"])
    assert got == want  # each sample replayed one trial, each turn exactly its recorded length
    for traj in res.trajectories:
        text = pool.tokenizer.decode(traj.token_ids)
        assert text.count("on time") == len(traj.turns) - 1  # the recorded observations came back


def test_openrlhfs_executor_replays_the_same_lengths(engines, tmp_path):
    """OpenRLHF's own path on the same rows: the same tokens per trial, so step times compare."""
    from war_openrlhf.baselines.openrlhf_rollout import (reset_vllm_suffix_caches, run_openrlhf_rollout,
                                                         start_openrlhf_engines, stop_openrlhf_engines)
    from transformers import AutoTokenizer

    model, _ = engines
    rows = _dataset().generate_from_traces(_trace_file(tmp_path), split="all", tool_latency_s=0.01)
    # with vLLM's own suffix method (openrlhf_vllm_suffix): drafting never changes a forced length
    base = start_openrlhf_engines(1, model, agent_func_path=AGENT, max_model_len=1024, kv_capacity_tokens=4096,
                                  speculative_config={"method": "suffix", "num_speculative_tokens": 4})
    try:
        assert reset_vllm_suffix_caches(base) == 0  # nothing generated yet
        exps, st = run_openrlhf_rollout(base, [r["prompt"] for r in rows], [r["label"] for r in rows],
                                        tokenizer=AutoTokenizer.from_pretrained(str(model)), n_samples_per_prompt=2,
                                        max_new_tokens=None, max_len=1024, temperature=1.0)
        # the benchmark empties vLLM's cache between repeats: the finished turns were cached (vLLM
        # releases the last batch's requests only at its next step, so they may still be active)
        turns = sum(len(tr["lengths"]) for r in rows for tr in json.loads(r["label"])["trials"])
        assert 0 < reset_vllm_suffix_caches(base) <= turns
        assert reset_vllm_suffix_caches(base) == 0
    finally:
        stop_openrlhf_engines(base)
    want = sum(sum(tr["lengths"]) for r in rows for tr in json.loads(r["label"])["trials"])
    assert st["trajectories"] == 8 and st["action_tokens"] == want


def test_turn_limits_and_kv_size_are_validated():
    from war_openrlhf.engine.config import EngineConfig
    from war_openrlhf.rollout.agents import turn_limits

    assert turn_limits({"max_tokens": 7, "min_tokens": 7, "ignore_eos": True}, "step()") == \
        {"max_tokens": 7, "min_tokens": 7, "ignore_eos": True}
    assert turn_limits(None, "step()") == {} and turn_limits({}, "reset()") == {}
    with pytest.raises(ValueError, match=r"step\(\) returned war_turn_limits.max_tokens = 0"):
        turn_limits({"max_tokens": 0}, "step()")
    with pytest.raises(ValueError, match="war_turn_limits.ignore_eos"):
        turn_limits({"ignore_eos": "yes"}, "reset()")
    with pytest.raises(ValueError, match="war_turn_limits.temperature: not one of"):  # it belongs in sampling_params
        turn_limits({"temperature": 0.5}, "step()")
    with pytest.raises(ValueError, match="kv_capacity_tokens: 1000 cannot hold one max_model_len=2048"):
        EngineConfig(max_model_len=2048, kv_capacity_tokens=1000)


def test_bench_rollout_refuses_bad_arguments_before_starting_engines(tmp_path):
    """The tool's own main (in this process: each case would otherwise pay a process's imports)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_rollout_cli", ROOT / "tools" / "bench_rollout.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def refused(*argv) -> str:
        with pytest.raises(SystemExit) as exit_:
            mod.main(["--json", str(tmp_path / "o.json"), *argv])
        return str(exit_.value.code)

    assert "--kv-tokens: 100 cannot hold one 2048-token episode" in refused(
        "--workload", "task:arithmetic_calculator", "--model", "random", "--kv-tokens", "100")
    assert "--workload: 'bogus' is neither task:NAME nor traces:FILE" in refused("--workload", "bogus")
    assert "unknown configuration 'fastest'" in refused("--configs", "war,fastest")
    assert "--free-sampling: a traces: workload replays recorded lengths" in refused(
        "--workload", "traces:x.json", "--free-sampling")
    assert "--war-engines none: plain engines cannot draft, but war would" in refused(
        "--war-engines", "none", "--configs", "openrlhf,war,war_sched_only")
    assert "--war-engines none: the WAR engines are plain already" in refused(
        "--war-engines", "none", "--configs", "war_sched_only,war_plain_engines")
    assert "--configs: war_no_history needs --history-steps >= 1" in refused("--configs", "war,war_no_history")
    assert "--history-steps: must be >= 0, got -1" in refused("--history-steps", "-1")
    assert "--warm-steps: must be >= 0, got -1" in refused("--warm-steps", "-1")
    assert "--warm-steps: the warm steps run the other half's tasks" in refused(
        "--workload", "task:sql_qa", "--warm-steps", "1")
    assert "--split all" in refused("--workload", "traces:x.json", "--split", "all", "--warm-steps", "1")
    assert "--warm-steps and --history-steps: choose one" in refused(
        "--workload", "traces:x.json", "--split", "validation", "--warm-steps", "1", "--history-steps", "1")
    assert "--skip-groups: a count >= 0 of a trace workload's tasks" in refused(
        "--workload", "task:sql_qa", "--skip-groups", "2")
    assert "--skip-groups: a count >= 0" in refused("--workload", "traces:x.json", "--skip-groups", "-1")
    assert not (tmp_path / "o.json").exists()


def test_returned_share_counts_placements_on_an_engine_that_served_the_prompt_before():
    import importlib.util
    import random

    spec = importlib.util.spec_from_file_location("bench_rollout_share", ROOT / "tools" / "bench_rollout.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.returned_share({"a": {0}, "b": {1}}, [("a", 0), ("b", 0), ("c", 1)]) == 1 / 3
    assert mod.returned_share({}, []) == 0.0
    rng = random.Random(5)
    for _ in range(50):  # against a brute-force count
        before = {p: {e for e in range(3) if rng.random() < 0.4} for p in "abcd"}
        placed = [(rng.choice("abcde"), rng.randrange(3)) for _ in range(rng.randrange(1, 12))]
        hits = 0
        for p, e in placed:
            if p in before and e in before[p]:
                hits += 1
        assert mod.returned_share(before, iter(placed)) == hits / len(placed)


def test_drafting_fraction_counts_the_runs_own_steps():
    """The switch counts from the engine's start; a run on an engine set shared by several
    configurations reports its own steps only (a replaced switch counts from its start)."""
    import importlib.util

    from war_openrlhf.engine.stats import EngineStats

    spec = importlib.util.spec_from_file_location("bench_rollout_frac", ROOT / "tools" / "bench_rollout.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def stats(steps, spec_steps, switch=True):
        sw = {"steps": steps, "spec_steps": spec_steps,
              "spec_step_fraction": spec_steps / steps if steps else 0.0} if switch else None
        return EngineStats.from_wire({"war": {"switch": sw} if switch else {}})

    # 100 earlier steps all drafting (another configuration), then 50 steps of which 10 drafted
    assert mod.run_spec_fraction(stats(100, 100), stats(150, 110)) == 0.2
    assert mod.run_spec_fraction(stats(100, 100), stats(100, 100)) == 0.0  # forced off: no step fed
    assert mod.run_spec_fraction(stats(100, 100), stats(40, 30)) == 0.75  # a fresh switch
    assert mod.run_spec_fraction(stats(0, 0, False), stats(0, 0, False)) is None  # no switch


def test_rollout_plot_speedups_are_openrlhfs_median_over_each_run(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("plot_rollout", ROOT / "tools" / "plot_rollout.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    runs = {"openrlhf": [{"step_s": 10.0}, {"step_s": 12.0}, {"step_s": 14.0}],
            "war": [{"step_s": 6.0}, {"step_s": 8.0}, {"step_s": 12.0}]}
    x = mod.speedups({"runs": runs})
    assert x["openrlhf"] == (1.0, 12.0 / 14.0, 12.0 / 10.0)
    assert x["war"] == (1.5, 1.0, 2.0)
    with pytest.raises(SystemExit, match="no openrlhf runs"):
        mod.speedups({"runs": {"war": runs["war"]}})
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(SystemExit, match="cannot read the benchmark JSON"):
        mod.main([str(bad), "--out", str(tmp_path / "x.png")])


def test_a_recorded_run_replays_as_the_same_work(engines, tmp_path):
    """bench_rollout's equal work for task workloads: a run's episodes, turned into replay rows
    (war_openrlhf.traces.recorded), replay with every turn at its recorded length and the
    recorded environment text between turns."""
    from war_openrlhf.traces.recorded import replay_rows

    model, handles = engines
    rows = _dataset().generate_from_traces(_trace_file(tmp_path), split="all", tool_latency_s=0.01)
    pool = _replay_pool(model, handles)
    first = pool.run_batch([r["prompt"] for r in rows], [r["label"] for r in rows], n_samples_per_prompt=2)
    decode = lambda ids: pool.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    replay = replay_rows(first.trajectories, decode)
    assert len(replay) == len(rows)
    for traj in first.trajectories:
        label = next(json.loads(r["label"]) for r in replay if json.loads(r["label"])["task"] == traj.group_id)
        trial = next(t for t in label["trials"] if t["trajectory_id"] == traj.trajectory_id)
        assert trial["lengths"] == [t.end - t.start for t in traj.turns]
        assert trial["delays"][:-1] == [round(t.tool_s, 6) for t in traj.turns[:-1]] and trial["delays"][-1] == 0.0
        text = decode(traj.token_ids)
        assert len(trial["observations"]) == len(traj.turns) - 1 and all(o in text for o in trial["observations"])
    again = pool.run_batch([r["prompt"] for r in replay], [r["label"] for r in replay], n_samples_per_prompt=2)
    assert sorted(tuple(t.end - t.start for t in tr.turns) for tr in again.trajectories) == \
        sorted(tuple(t.end - t.start for t in tr.turns) for tr in first.trajectories)
    assert again.generated_tokens == first.generated_tokens


def test_replay_rows_count_episodes_without_a_turn_and_refuse_an_empty_group():
    from types import SimpleNamespace as NS

    from war_openrlhf.traces.recorded import replay_rows

    turn = NS(start=3, end=5, tool_s=0.25)
    last = NS(start=7, end=8, tool_s=0.0)
    full = NS(trajectory_id="a/0", group_id="a", prompt="p", token_ids=[1, 2, 3, 10, 11, 20, 21, 12], turns=[turn, last])
    empty = NS(trajectory_id="a/1", group_id="a", prompt="p", token_ids=[1, 2, 3], turns=[])
    rows = replay_rows([full, empty], lambda ids: ",".join(map(str, ids)))
    label = json.loads(rows[0]["label"])
    assert label["skipped_episodes"] == 1 and len(label["trials"]) == 1
    assert label["trials"][0] | {} == {"trial": 0, "lengths": [2, 1], "observations": ["20,21"], "delays": [0.25, 0.0],
                                      "trajectory_id": "a/0"}
    with pytest.raises(ValueError, match="group 'b'"):
        replay_rows([NS(trajectory_id="b/0", group_id="b", prompt="q", token_ids=[1], turns=[])], str)


def test_a_sample_replays_the_trial_of_its_number_in_any_process():
    """With the pool's ``war_sample_index`` a sample replays the trial of its number, so a GRPO
    group split across engine processes (hosted episodes) still replays each trial once; a
    label's own ``trial_index`` wins; without either, this process's counter decides."""
    import asyncio

    from war_openrlhf.rollout.agents import load_agent_class

    agent_cls = load_agent_class(AGENT)
    trials = [{"lengths": [i + 1], "delays": [0.0], "observations": [""]} for i in range(4)]
    label = json.dumps({"task": 991, "trials": trials})

    def first_length(states):
        inst = agent_cls()
        return asyncio.run(inst.reset(states))["war_turn_limits"]["max_tokens"]

    assert [first_length({"observation": "p", "label": label, "war_sample_index": s}) for s in (3, 0, 5, 1)] \
        == [4, 1, 2, 2]
    pinned = json.dumps({"task": 991, "trials": trials, "trial_index": 2})
    assert first_length({"observation": "p", "label": pinned, "war_sample_index": 0}) == 3
    assert [first_length({"observation": "p", "label": label}) for _ in range(5)] == [1, 2, 3, 4, 1]
