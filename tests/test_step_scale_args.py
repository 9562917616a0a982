"""tools/bench_step_scale.py refuses bad arguments before any engine starts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import bench_step_scale  # noqa: E402


@pytest.mark.parametrize("argv, message", [
    (["--episodes", "0"], "--episodes: must be >= 1"),
    (["--episodes", "100", "--group", "8"], "must be a multiple of --group"),
    (["--agent-runners", "thread,process"], "--agent-runners: \\['process'\\] not among thread, loop, hosted"),
    (["--agent-runners", "loop,hosted_frozen"], "--agent-runners: \\['hosted_frozen'\\] not among"),
    (["--agent-runners", ","], "--agent-runners: empty"),
])
def test_bad_arguments_are_refused_by_name(argv, message, monkeypatch):
    import ray

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("ray started before the arguments were checked"))
    with pytest.raises(SystemExit, match=message):
        bench_step_scale.main(argv)


def test_the_reading_names_each_runner_by_its_settings():
    from war_openrlhf.metrics.docs_renderers import step_scale_reading

    def row(runner, cpu):
        return {"agent_runner": runner, "episodes_lost_or_failed": 0, "all_turns_served": True,
                "driver_cpu_per_turn_us": {"median": cpu}}

    d = {"rows": [row("loop", 700.0), row("hosted_unfrozen", 300.0)], "target_us_per_turn": 200.0,
         "target_met": False, "regime": "r", "machine": {"load_average_1m": 1.0, "cpus": 2}}
    assert "`episode_host: engine`, `freeze_heap: false`, 300 us" in step_scale_reading(d)
    d["rows"].append(row("hosted", 150.0))
    assert "Lowest pool CPU per turn: `episode_host: engine`, 150 us" in step_scale_reading(d)
