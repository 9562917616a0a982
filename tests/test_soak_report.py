"""The chaos soak's rendered report (tools/soak.py writes the file): a failed check and the
faults injected are named, not summed away."""

from __future__ import annotations

from war_openrlhf.metrics.docs_renderers import soak_summary


def test_soak_summary_says_which_check_failed_and_what_was_injected():
    d = {"ok": False, "checks": {"run_completed": True, "model_loads": False}, "steps": 8, "wall_s": 301.4,
         "faults_injected": {"raise": 3, "garbage": 1}, "engine_hung": {"call": 37, "t": 95.2, "pid": 1}, "hang_s": 40.0,
         "hung_engine_declared_dead": False,
         "engines_recovered": 1, "episodes": 64, "failed_episodes": 1, "failed_by_reason": {"agent_error": 1},
         "groups_dropped": [0, 1], "samples_per_step": [32, 28]}
    text = soak_summary(d)
    assert text.startswith("Soak **failed**.")
    assert "| `model_loads` | **failed** |" in text and "| `run_completed` | passed |" in text
    assert "| tool faults injected | garbage 1, raise 3 |" in text and "at tool call 37, 95 s in, for 40 s" in text
    assert "| hung engine declared dead (turn deadline) | no |" in text
    assert "| episodes (dumped), failed | 64, 1 (agent_error 1) |" in text and "| samples trained on, per step | 32, 28 |" in text
