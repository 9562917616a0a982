"""war-predict: a user's trajectories (SWE-agent ``.traj``, tau-bench chat JSON, OpenAI-chat
JSONL, war-train's own rollout dumps) read into turns with their tool latencies, bad files
named by file, record and field, and the prediction per configuration (the simulator and the
speculation replay are tested in their own modules; here: what the command adds)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from war_openrlhf.cli.predict import main
from war_openrlhf.rollout.trajectory import Trajectory, TurnRecord
from war_openrlhf.simulation.predict import PredictSettings, predict
from war_openrlhf.traces import TraceFormatError, load_chat_traces
from war_openrlhf.traces.trace_files import load_trace_files, trace_summary

REAL_TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "tau_airline_dev.json"


def _swe_traj(steps: int, action: str = "ls -la", seconds: float = 0.25) -> dict:
    """A SWE-agent 1.x trajectory file's layout: history (the model's conversation, content as
    text blocks) and trajectory (one step per action, with its execution time)."""
    history = [{"role": "system", "content": "You are a helpful assistant that can fix bugs.", "agent": "main"},
               {"role": "user", "content": [{"type": "text", "text": "<issue>TypeError in parse()</issue>"}],
                "agent": "main", "message_type": "observation"}]
    trajectory = []
    for i in range(steps):
        history.append({"role": "assistant", "content": f"Let me look around, step {i}.\n```\n{action} {i}\n```",
                        "thought": "Let me look around.", "action": f"{action} {i}", "agent": "main",
                        "message_type": "action", "tool_calls": [{"function": {"name": "bash",
                                                                               "arguments": {"command": action}}}]})
        history.append({"role": "tool", "content": [{"type": "text", "text": f"file_{i}.py\nsetup.cfg\n"}],
                        "agent": "main", "message_type": "observation", "tool_call_ids": [f"call_{i}"]})
        trajectory.append({"action": f"{action} {i}", "observation": f"file_{i}.py", "response": "...",
                           "thought": "...", "execution_time": seconds + 0.01 * i, "state": {}, "query": []})
    return {"environment": "swe_main", "trajectory": trajectory, "history": history,
            "info": {"exit_status": "submitted"}}


def _chat_records(tasks: int, trials: int) -> list[dict]:
    out = []
    for t in range(tasks):
        for k in range(trials):
            msgs = [{"role": "system", "content": "You are an airline agent."},
                    {"role": "user", "content": f"Change my flight {t} to Friday."}]
            for turn in range(3):
                msgs.append({"role": "assistant", "content": f"Looking up reservation {t}-{turn}: the flight is on time."})
                msgs.append({"role": "user", "content": f"ok {turn}"})
            out.append({"task_id": t, "trial": k, "reward": 1.0, "traj": msgs})
    return out


def test_swe_agent_trajectories_bring_their_tool_latencies_and_group_by_instance(tmp_path):
    a, b = tmp_path / "run1", tmp_path / "run2"
    a.mkdir(), b.mkdir()
    (a / "django__django-11099.traj").write_text(json.dumps(_swe_traj(4)))
    (b / "django__django-11099.traj").write_text(json.dumps(_swe_traj(5)))
    (a / "sympy__sympy-20590.traj").write_text(json.dumps(_swe_traj(2)))
    ts = load_trace_files(sorted(tmp_path.glob("*/*.traj")))
    assert [len(t.turns) for t in ts.trajectories] == [4, 2, 5]
    assert [t.group_id for t in ts.trajectories] == ["django__django-11099", "sympy__sympy-20590",
                                                     "django__django-11099"]
    assert ts.trajectories[0].tool_delays_s == pytest.approx([0.25, 0.26, 0.27])  # after each turn but the last
    for t in ts.trajectories:  # each turn's context is the previous turn's context + response + observation
        for prev, nxt in zip(t.turns, t.turns[1:]):
            n = prev.context_token_ids.size + prev.response_token_ids.size
            assert np.array_equal(nxt.context_token_ids[:n],
                                  np.concatenate([prev.context_token_ids, prev.response_token_ids]))
            # the observation's tokens, and the chat template's own around the next turn
            assert nxt.context_token_ids.size >= n + prev.env_token_count and prev.env_token_count > 0
    assert trace_summary(ts)["groups"] == 2


def test_chat_json_and_jsonl_and_the_real_tau_file(tmp_path):
    (tmp_path / "tau.json").write_text(json.dumps(_chat_records(2, 3)))
    lines = [{"messages": r["traj"], "group_id": f"prompt{r['task_id']}", "tool_latency_s": [0.5, 0.7]}
             for r in _chat_records(2, 2)]
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    ts = load_trace_files([tmp_path / "tau.json", tmp_path / "chat.jsonl"])
    assert [f["format"] for f in ts.files] == ["chat_json", "chat_jsonl"]
    assert len(ts.trajectories) == 10 and all(len(t.turns) == 3 for t in ts.trajectories)
    assert ts.trajectories[0].tool_delays_s is None and ts.trajectories[6].tool_delays_s == [0.5, 0.7]
    assert {t.group_id for t in ts.trajectories[6:]} == {"prompt0", "prompt1"}
    if not REAL_TRACES.is_file():
        pytest.skip(f"{REAL_TRACES} absent (expected <repo>/../shared/traces/)")
    real = load_trace_files(REAL_TRACES)
    chats = load_chat_traces(REAL_TRACES)
    assert len(real.trajectories) == len(chats)
    assert [len(t.turns) for t in real.trajectories] == [c.model_turns for c in chats]


def test_war_train_rollout_dumps_replay_the_tokens_the_engines_saw(tmp_path):
    tokens = list(range(100, 160))
    turns = [TurnRecord(index=0, engine=0, start=10, end=20, prompt_tokens=10, cached_tokens=0, finish_reason="stop",
                        dispatched_s=0.0, generate_s=0.1, tool_s=0.4),
             TurnRecord(index=1, engine=1, start=25, end=40, prompt_tokens=25, cached_tokens=16, finish_reason="stop",
                        dispatched_s=0.5, generate_s=0.1, tool_s=1.5),
             TurnRecord(index=2, engine=1, start=44, end=60, prompt_tokens=44, cached_tokens=32, finish_reason="stop",
                        dispatched_s=1.0, generate_s=0.1)]
    traj = Trajectory("b0-p0-s0", "b0-p0", "prompt", None, token_ids=tokens, turns=turns)
    path = tmp_path / "rollout_0001.jsonl"
    path.write_text(json.dumps({**traj.to_dict(), "policy_version": 3}) + "\n")
    (t,) = load_trace_files(path).trajectories
    assert (t.trajectory_id, t.group_id, t.tool_delays_s) == ("b0-p0-s0", "b0-p0", [0.4, 1.5])
    assert [x.context_token_ids.tolist() for x in t.turns] == [tokens[:10], tokens[:25], tokens[:44]]
    assert [x.response_token_ids.tolist() for x in t.turns] == [tokens[10:20], tokens[25:40], tokens[44:60]]
    assert [x.env_token_count for x in t.turns] == [5, 4, 0]


@pytest.mark.parametrize("name, content, message", [
    ("bad.json", "{not json", r"bad.json: not valid JSON"),
    ("obj.json", json.dumps({"a": 1}), r"obj.json: top level must be a list"),
    ("x.traj", json.dumps({"trajectory": [], "history": "none"}), r"x.traj: field 'history' must be a non-empty list"),
    ("y.traj", json.dumps({"trajectory": [{"execution_time": -1}], "history": [{"role": "user", "content": "q"},
                                                                             {"role": "assistant", "content": "a"}]}),
     r"y.traj: trajectory step 0: field 'execution_time' must be seconds >= 0"),
    ("c.jsonl", json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
     + "\n" + json.dumps({"prompt": "q"}),
     r"c.jsonl: line 2: a chat record needs 'traj' \(tau-bench\) or 'messages'"),
    ("d.jsonl", json.dumps({"messages": [{"role": "robot", "content": "q"}]}), r"d.jsonl: line 1: message 0: role"),
    ("e.jsonl", json.dumps({"messages": [{"role": "user", "content": "q"}]}),
     r"e.jsonl: line 1: no assistant message"),
    ("rollout_0000.jsonl", json.dumps({"trajectory_id": "t", "group_id": "g", "token_ids": [1, 2, 3],
                                       "turns": [{"start": 2, "end": 9}]}),
     r"rollout_0000.jsonl: line 1: turn 0: span \[2, 9\) is not inside the tokens"),
])
def test_a_file_it_cannot_read_is_named_with_its_record_and_field(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(TraceFormatError, match=message):
        load_trace_files(path)
    with pytest.raises(SystemExit, match=message):  # the command says the same, without a traceback
        main(["--traces", str(path), "--quiet"])


def test_prediction_per_configuration_with_drafting_from_siblings(tmp_path):
    """Siblings of one group answer alike (as GRPO samples of a task often do): the replay finds
    drafts for them, WAR's switch keeps drafting where it is faster, and every configuration's
    gain is the baseline's step over its own."""
    (tmp_path / "tau.json").write_text(json.dumps(_chat_records(4, 4)))
    ts = load_trace_files(tmp_path / "tau.json")
    settings = PredictSettings(engines=2, cost_model="h100_qwen7b", tool_latency_s=0.2, replay_engines=2)
    r = predict(ts.trajectories, settings, ["war", "war_sched_only", "openrlhf_vllm_suffix", "dynamo_kv"], jobs=2)
    rows = r["configs"]
    alone = predict(ts.trajectories, settings, ["war", "war_sched_only", "openrlhf_vllm_suffix", "dynamo_kv"], jobs=1)
    assert r["processes"] == 2 and alone["processes"] == 1  # worker processes compute what one process does
    assert alone["configs"] == rows and alone["speculation"] == r["speculation"]
    assert list(rows) == ["openrlhf", "war", "war_sched_only", "openrlhf_vllm_suffix", "dynamo_kv"]
    assert rows["openrlhf"]["x_openrlhf"] == 1.0
    for row in rows.values():
        assert row["x_openrlhf"] == pytest.approx(rows["openrlhf"]["step_s"] / row["step_s"])
    assert r["speculation"]["war"]["tokens_per_step"] > 1.5 and r["speculation"]["war"]["acceptance"] > 0.3
    war = rows["war"]
    assert war["step_s"] == min(war["step_s_drafting_on"], war["step_s_drafting_off"])
    assert war["step_s_drafting_off"] == rows["war_sched_only"]["step_s"]
    assert war["switch"] == "on" and war["step_s"] < rows["war_sched_only"]["step_s"]
    assert r["speculation"]["war"]["replay_groups"] == 4 and r["speculation"]["war"]["replay_trajectories"] == 16
    sampled = predict(ts.trajectories, PredictSettings(engines=2, tool_latency_s=0.2, replay_groups=2), ["war"])
    assert sampled["speculation"]["war"]["replay_groups"] == 2  # a seeded sample of whole groups
    assert sampled["speculation"]["war"]["replay_trajectories"] == 8
    with pytest.raises(ValueError, match="configs: unknown nope"):
        predict(ts.trajectories, settings, ["nope"])


def test_longest_first_is_war_on_priority_scheduling_engines(tmp_path):
    """``war_longest_first`` is its own simulation (engines scheduling by vLLM priority), with
    the switch's on/off pair of its own, and says so in its row."""
    (tmp_path / "tau.json").write_text(json.dumps(_chat_records(4, 4)))
    ts = load_trace_files(tmp_path / "tau.json")
    settings = PredictSettings(engines=2, kv_tokens=4096, tool_latency_s=0.2, replay_engines=2)
    rows = predict(ts.trajectories, settings, ["war", "war_longest_first"], jobs=1)["configs"]
    lf, war = rows["war_longest_first"], rows["war"]
    assert lf["turn_priority"] == "longest_first" and "turn_priority" not in war
    assert lf["policy"] == war["policy"] == "war" and lf["speculation"] == "war"
    assert lf["step_s"] == min(lf["step_s_drafting_on"], lf["step_s_drafting_off"])


def test_the_command_writes_its_json_and_plot_and_says_how_far_it_is_validated(tmp_path, capsys):
    (tmp_path / "t.traj").write_text(json.dumps(_swe_traj(3)))
    (tmp_path / "u.traj").write_text(json.dumps(_swe_traj(3, action="cat")))
    out, plot = tmp_path / "p.json", tmp_path / "p.png"
    assert main(["--traces", str(tmp_path / "t.traj"), str(tmp_path / "u.traj"), "--engines", "2",
                 "--configs", "war,verl_sticky", "--json", str(out), "--plot", str(plot), "--quiet"]) == 0
    d = json.loads(out.read_text())
    assert set(d["configs"]) == {"openrlhf", "war", "verl_sticky"} and d["tool_latency"] == "recorded"
    assert d["traces"]["trajectories"] == 2 and d["traces"]["recorded_tool_latency_median_s"] == pytest.approx(0.255)
    assert "validated" in d["validation"] and d["git"]["commit"]
    assert plot.stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "| war |" in printed and "validation:" in printed
    with pytest.raises(SystemExit, match="--engines: must be"):
        main(["--traces", str(tmp_path / "t.traj"), "--engines", "0", "--quiet"])


def test_the_validation_note_says_what_was_checked_and_whether_it_covers_this_prediction(tmp_path):
    """war-predict's validation line comes from the committed comparison with real engines: no
    file -> not validated; a file -> its worst error and the target's verdict, and whether the
    prediction's own cost model is one the file checked (a preset never is)."""
    from war_openrlhf.cli.predict import validation_note

    missing = validation_note(tmp_path / "none.json", cost="h100_qwen7b")
    assert missing["validated"] is False and "not been validated" in missing["note"]
    f = tmp_path / "validation.json"
    f.write_text(json.dumps({"worst_abs_error": 0.12, "target_abs_error": 0.15, "comparisons": 20,
                             "cost_models": ["benchmarks/results/engine/cost_serving_cpu_peaked.json"]}))
    mine = validation_note(f, cost="/somewhere/cost_serving_cpu_peaked.json")
    assert mine["validated"] is True and mine["cost_model_checked"] is True
    assert "within 12%" in mine["note"] and "20 comparisons" in mine["note"] and "met" in mine["note"]
    assert "step time" not in mine["note"]  # an older file without it says nothing of it
    preset = validation_note(f, cost="h100_qwen7b")
    assert preset["validated"] is False and "fit yours" in preset["note"]
    f.write_text(json.dumps({"worst_abs_error": 0.4, "target_abs_error": 0.15, "comparisons": 20,
                             "cost_models": ["cost_serving_cpu_peaked.json"]}))
    worse = validation_note(f, cost="cost_serving_cpu_peaked.json")
    assert worse["validated"] is False and "missed" in worse["note"]
    f.write_text(json.dumps({"worst_abs_error": 0.12, "worst_abs_step_error": 0.24, "target_abs_error": 0.15,
                             "comparisons": 16, "cost_models": ["cost_serving_cpu_peaked.json"]}))
    both = validation_note(f, cost="cost_serving_cpu_peaked.json")
    assert "within 12%" in both["note"] and "step time within 24%" in both["note"] and both["worst_abs_step_error"] == 0.24
