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
        "war_longest_first": {"step_s": 2.2, "x_openrlhf": 1.8},
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
    assert r["prediction"] == "simulated in the run" and r["not_modelled"] == ["war_longest_first"]
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
