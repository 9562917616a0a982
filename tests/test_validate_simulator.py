"""tools/validate_simulator.py: the simulator's predictions set beside real-engine runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import validate_simulator as vs  # noqa: E402


def _task_run(tmp_path: Path, cost_name: str, model: str = "/x/.cache/war_tiny_policy") -> Path:
    configs = {
        "openrlhf": {"step_s": 4.0, "x_openrlhf": 1.0, "simulated_step_s": 5.0, "simulated_x_openrlhf": 1.0},
        "war": {"step_s": 2.0, "x_openrlhf": 2.0, "simulated_step_s": 2.0, "simulated_x_openrlhf": 2.5},
        "war_finished_only": {"step_s": 2.2, "x_openrlhf": 1.8},
    }
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"benchmark": "rollout", "workload": "task:sql_qa", "model": model, "engines": 2,
                                "pressure": None, "kv_tokens_per_engine": None, "regime": {"load": "low"},
                                "cost_model": f"benchmarks/results/engine/{cost_name}", "configs": configs,
                                "git": {"commit": "abc"}}))
    return path


def _cost(tmp_path: Path, name: str, model: str) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps({"benchmark": "engine_step_costs_serving", "model": model, "cost_model": {}}))
    return path


def test_errors_are_of_the_gain_and_of_the_step(tmp_path):
    rows = vs.compare(json.loads(_task_run(tmp_path, "c.json").read_text()),
                      {"openrlhf": {"step_s": 5.0, "x_openrlhf": 1.0}, "war": {"step_s": 2.0, "x_openrlhf": 2.5}})
    war = next(r for r in rows if r["config"] == "war")
    assert war["gain_error"] == pytest.approx(0.25) and war["step_error"] == 0.0
    assert next(r for r in rows if r["config"] == "openrlhf")["step_error"] == pytest.approx(0.25)


def test_a_task_run_is_compared_with_its_own_prediction_and_the_worst_error_written(tmp_path, capsys):
    run = _task_run(tmp_path, "cost_policy.json")
    cost = _cost(tmp_path, "cost_policy.json", "/elsewhere/war_tiny_policy")
    out = tmp_path / "validation.json"
    assert vs.main([str(run), "--cost-models", str(cost), "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["comparisons"] == 1 and d["worst_abs_error"] == pytest.approx(0.25)
    assert d["worst_abs_step_error"] == pytest.approx(0.25) and d["target_abs_error"] == 0.15
    (r,) = d["runs"]
    assert r["prediction"] == "simulated in the run" and r["not_modelled"] == ["war_finished_only"]
    assert "low load" in r["regime"] and d["git"]["commit"]


def test_runs_without_a_matching_cost_model_or_prediction_are_listed_not_dropped(tmp_path):
    out = tmp_path / "validation.json"
    other_model = _cost(tmp_path, "cost_peaked.json", "/m/war_tiny_llama_peaked_32768")
    assert vs.main([str(_task_run(tmp_path, "cost_policy.json")), "--cost-models", str(other_model),
                    "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["runs"] == [] and "no cost model fitted to its model" in d["skipped"][0]["reason"]
    same_model_other_cost = _cost(tmp_path, "cost_policy_v2.json", "/m/war_tiny_policy")
    assert vs.main([str(_task_run(tmp_path, "cost_policy.json")), "--cost-models", str(same_model_other_cost),
                    "--json", str(out)]) == 0
    assert "made no prediction with this cost model" in json.loads(out.read_text())["skipped"][0]["reason"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model": ""}))
    with pytest.raises(SystemExit, match="not a fitted cost model"):
        vs.main([str(_task_run(tmp_path, "cost_policy.json")), "--cost-models", str(bad), "--json", str(out)])


# ---------------------------------------------------------- plain engines priced by their own fit
import bench_rollout as br  # noqa: E402


@pytest.mark.parametrize("name, same_engines, war_engines, kind", [
    ("openrlhf", False, "auto", "plain"),               # OpenRLHF's own engines
    ("openrlhf", True, "auto", "war_index"),            # its executor on WAR's drafting engines
    ("openrlhf", True, "none", "plain"),
    ("openrlhf_vllm_suffix", False, "auto", "vllm_suffix"),
    ("war", False, "auto", "war_index"),
    ("war_sched_only", False, "auto", "war_index"),     # drafting off, the speculative config stays
    ("war", False, "none", "plain"),
    ("war_plain_engines", False, "auto", "plain"),      # a plain engine set of its own beside WAR's
    ("war_vllm_suffix_engines", False, "auto", "vllm_suffix"),  # WAR's dispatch, vLLM's own drafter
    ("war_vllm_suffix_engines", False, "none", "vllm_suffix"),  # a set of its own whatever WAR's engines are
])
def test_each_configuration_is_priced_as_the_engines_it_ran_on(name, same_engines, war_engines, kind):
    assert br.engine_kind(name, same_engines, war_engines) == kind


def _trajectories(n=8, turns=3):
    from types import SimpleNamespace

    import numpy as np

    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        ctx, ts = rng.integers(5, 500, size=200).astype(np.int32), []
        for _ in range(turns):
            resp = rng.integers(5, 500, size=40).astype(np.int32)
            ts.append(SimpleNamespace(context_token_ids=ctx, response_token_ids=resp, env_token_count=20))
            ctx = np.concatenate([ctx, resp, rng.integers(5, 500, size=20).astype(np.int32)])
        out.append(SimpleNamespace(trajectory_id=f"t{i}", group_id=f"g{i // 4}", turns=ts,
                                   tool_delays_s=[0.05] * (turns - 1)))
    return out


def test_a_plain_fit_moves_only_the_configurations_on_plain_engines(tmp_path):
    from war_openrlhf.simulation.cost_model import get_preset

    spec = ROOT / "benchmarks" / "results" / "engine" / "cost_serving_cpu_policy.json"
    model = get_preset(str(spec))
    faster = model.with_overrides(step_overhead_s=model.step_overhead_s / 2, decode_per_seq_s=model.decode_per_seq_s / 2)
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"cost_model": faster.to_dict()}))
    summary = {"openrlhf": {}, "war": {}}
    trajs = _trajectories()
    one = br.simulate_configs(trajs, str(spec), 2, None, summary)
    two = br.simulate_configs(trajs, str(spec), 2, None, summary, str(plain))
    assert two["war"]["step_s"] == one["war"]["step_s"]
    assert two["openrlhf"]["step_s"] < 0.8 * one["openrlhf"]["step_s"]
    assert two["war"]["x_openrlhf"] < one["war"]["x_openrlhf"]
    same = br.simulate_configs(trajs, str(spec), 2, None, summary, str(plain), same_engines=True)
    assert same["openrlhf"]["step_s"] == one["openrlhf"]["step_s"]  # on WAR's engines: the speculative fit


def test_a_suffix_fit_moves_only_vllms_suffix_configuration(tmp_path):
    from war_openrlhf.simulation.cost_model import get_preset

    spec = ROOT / "benchmarks" / "results" / "engine" / "cost_serving_cpu_policy.json"
    model = get_preset(str(spec))
    slower = model.with_overrides(step_overhead_s=model.step_overhead_s * 2, spec_step_s=model.spec_step_s * 2 + 1e-3)
    suffix = tmp_path / "suffix.json"
    suffix.write_text(json.dumps({"cost_model": slower.to_dict()}))
    drafting = {"tokens_per_verification_step": 2.5, "acceptance": 0.5, "speculating_fraction": 1.0}
    summary = {"openrlhf": {}, "openrlhf_vllm_suffix": dict(drafting), "war": dict(drafting)}
    trajs = _trajectories()
    one = br.simulate_configs(trajs, str(spec), 2, None, summary)
    two = br.simulate_configs(trajs, str(spec), 2, None, summary, suffix_cost_model=str(suffix))
    assert two["war"]["step_s"] == one["war"]["step_s"] and two["openrlhf"]["step_s"] == one["openrlhf"]["step_s"]
    assert two["openrlhf_vllm_suffix"]["step_s"] > 1.3 * one["openrlhf_vllm_suffix"]["step_s"]


def test_validation_sorts_cost_models_by_the_engines_they_were_fitted_to(tmp_path):
    files = []
    for name, kind in (("a.json", "war_index"), ("b.json", "plain"), ("c.json", "vllm_suffix")):
        f = tmp_path / name
        f.write_text(json.dumps({"benchmark": "engine_step_costs_rollout", "model": f"/m{name[0]}/war_tiny_policy",
                                 "engine_kind": kind, "cost_model": {}}))
        files.append(str(f))
    out = tmp_path / "validation.json"
    assert vs.main([str(_task_run(tmp_path, "cost_policy.json")), "--cost-models", *files, "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert [len(d[k]) for k in ("cost_models", "plain_cost_models", "suffix_cost_models")] == [1, 1, 1]
    assert d["cost_models"][0].endswith("a.json") and d["suffix_cost_models"][0].endswith("c.json")


def test_a_plain_fit_alone_does_not_stand_in_for_the_drafting_engines_fit(tmp_path):
    plain = tmp_path / "cost_policy_plain.json"
    plain.write_text(json.dumps({"benchmark": "engine_step_costs_serving", "model": "/m/war_tiny_policy",
                                 "engine_kind": "plain", "cost_model": {}}))
    out = tmp_path / "validation.json"
    assert vs.main([str(_task_run(tmp_path, "cost_policy.json")), "--cost-models", str(plain),
                    "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["runs"] == [] and "no cost model fitted to its model" in d["skipped"][0]["reason"]
    assert d["plain_cost_models"] and not d["cost_models"]


def test_a_task_run_that_keeps_its_replayed_episodes_is_re_simulated_with_any_cost_model(tmp_path):
    """A task run's file keeps the episodes every configuration replayed: validation re-runs the
    simulator on them with the cost models given (not the run's own prediction), and a cheaper
    engine predicts a shorter step."""
    from war_openrlhf.fixtures.tiny_model import build_tiny_model
    from war_openrlhf.simulation.cost_model import get_preset

    model = build_tiny_model(ROOT / ".cache" / "war_tiny_model")
    trials = [{"trial": i, "lengths": [30, 20, 12], "observations": ["ok: 3 rows", "done"], "delays": [0.1, 0.05, 0.0],
               "trajectory_id": f"t{i}"} for i in range(4)]
    rows = [{"prompt": f"Question {g}: how many flights?", "label": json.dumps({"task": f"g{g}", "trials": trials})}
            for g in range(2)]
    path = _task_run(tmp_path, "cost_policy.json", model=str(model))
    d = json.loads(path.read_text())
    d.update(replayed_rows=rows, n_samples=4, trace_args={"seed": 3})
    path.write_text(json.dumps(d))
    spec = ROOT / "benchmarks" / "results" / "engine" / "cost_serving_cpu_policy.json"
    slow = get_preset(str(spec))
    slow = slow.with_overrides(step_overhead_s=slow.step_overhead_s * 3)
    costs = []
    for name, m in (("fast", get_preset(str(spec))), ("slow", slow)):
        f = tmp_path / name / f"cost_{model.name}.json"
        f.parent.mkdir()
        f.write_text(json.dumps({"benchmark": "engine_step_costs_rollout", "model": str(model),
                                 "engine_kind": "war_index", "cost_model": m.to_dict()}))
        out = tmp_path / name / "validation.json"
        assert vs.main([str(path), "--cost-models", str(f), "--json", str(out)]) == 0
        run = json.loads(out.read_text())["runs"][0]
        assert run["prediction"] == "re-simulated"
        costs.append({r["config"]: r["simulated_step_s"] for r in run["rows"]})
    assert costs[1]["war"] > 1.5 * costs[0]["war"] and costs[1]["openrlhf"] > 1.5 * costs[0]["openrlhf"]


def test_longest_first_is_simulated_on_priority_engines_with_the_runs_predictor(monkeypatch):
    """``war_longest_first`` is re-simulated (not listed as unmodelled): war on engines that
    schedule by priority, the predictor seeded with the fit data the run's pool had; the other
    configurations keep FCFS engines."""
    import war_openrlhf.simulation.cluster as cluster

    seen = {}
    real = cluster.simulate

    def spy(prepared, policy, cfg):
        seen[len(seen)] = (policy, cfg.turn_priority, cfg.turn_priority_history)
        return real(prepared, policy, cfg)

    monkeypatch.setattr(cluster, "simulate", spy)
    from war_openrlhf.dispatch.turn_priority import TurnPriorities

    history = [[1, 3, 3, 3], [2, 1, 1, 2], [3, 3, 1, 3]]
    seeded = TurnPriorities()
    seeded.seed(history)
    monkeypatch.setattr(br, "_PRIORITY_SEED", [seeded])
    spec = ROOT / "benchmarks" / "results" / "engine" / "cost_serving_cpu_policy.json"
    summary = {"openrlhf": {}, "war": {}, "war_longest_first": {}}
    out = br.simulate_configs(_trajectories(), str(spec), 2, None, summary)
    assert set(out) == {"openrlhf", "war", "war_longest_first"} and out["war_longest_first"]["step_s"] > 0
    assert sorted(seen.values()) == [("least_loaded", "none", ()), ("war", "longest_first", tuple(map(tuple, history))),
                                     ("war", "none", ())]
    from resimulate_rollout import unmodelled_configs

    assert "war_longest_first" not in unmodelled_configs({"configs": summary})


def test_a_run_written_elsewhere_finds_its_model_in_this_checkout(tmp_path, monkeypatch):
    """A result file records the model directory of the checkout that ran it; re-simulating it
    here takes the same model under this checkout's .cache, and names the field when absent."""
    import resimulate_rollout as rs

    monkeypatch.setattr(rs, "ROOT", tmp_path)
    here = tmp_path / ".cache" / "war_tiny_llama_peaked_32768"
    elsewhere = tmp_path / "gone" / ".cache" / "war_tiny_llama_peaked_32768"
    with pytest.raises(ValueError, match="model: .*is not there"):
        rs.run_model_dir({"model": str(elsewhere)})
    here.mkdir(parents=True)
    (here / "config.json").write_text("{}")
    assert rs.run_model_dir({"model": str(elsewhere)}) == here
    elsewhere.mkdir(parents=True)
    (elsewhere / "config.json").write_text("{}")
    assert rs.run_model_dir({"model": str(elsewhere)}) == elsewhere  # the recorded path first
