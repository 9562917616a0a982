"""Longest-first turn priorities: nothing predicted before finished groups exist; then a
trajectory whose finished siblings ran long gets a higher priority (a lower vLLM value) than
one whose siblings ended early; the setting is refused on engines without priority scheduling."""

from __future__ import annotations

import pytest

from war_openrlhf.rollout import RolloutConfig
from war_openrlhf.dispatch.turn_priority import TurnPriorities


def _batch(tp: TurnPriorities, groups: dict[str, list[int]]) -> None:
    tp.start_batch()
    for g, totals in groups.items():
        for i, total in enumerate(totals):
            for k in range(total):
                tp.priority(f"{g}/{i}", g, k)
            tp.finished(f"{g}/{i}", g, total)


def test_priorities_follow_the_siblings_once_groups_have_finished():
    tp = TurnPriorities()
    tp.start_batch()
    assert tp.priority("a/0", "a", 0) == 0 and tp.predictions == 0  # nothing finished yet
    tp.finished("a/0", "a", 1)
    _batch(tp, {f"g{i}": [2 + i % 5 * 4 + d for d in (0, 1, 1, 2)] for i in range(20)})  # groups differ a lot
    tp.start_batch()
    for i in range(4):  # every member registered at turn 0
        tp.priority(f"short/{i}", "short", 0)
        tp.priority(f"long/{i}", "long", 0)
    tp.finished("short/0", "short", 2)
    tp.finished("short/1", "short", 3)
    tp.finished("long/0", "long", 3)  # one long-group member ended early: still informative
    p_short = tp.priority("short/2", "short", 4)
    p_long = tp.priority("long/2", "long", 4)
    assert p_long <= p_short  # the long group's member at least as urgent
    tp.finished("long/1", "long", 18)
    assert tp.priority("long/2", "long", 5) < tp.priority("short/3", "short", 5)
    assert tp.predictions > 0


def test_seeded_fit_predicts_from_the_first_turn():
    tp = TurnPriorities()
    tp.seed([[3, 4, 4, 5], [12, 14, 13, 15], [7, 8, 8, 9]])
    assert tp.priority("x/0", "x", 0) < 0 and tp.predictions == 1


def test_longest_first_needs_priority_scheduling_on_the_engines():
    with pytest.raises(ValueError, match="engine.scheduling_policy: priority"):
        RolloutConfig(turn_priority="longest_first")
    assert RolloutConfig(turn_priority="longest_first", engine={"scheduling_policy": "priority"}).turn_priority
    with pytest.raises(ValueError, match="turn_priority: 'shortest' is not one of"):
        RolloutConfig(turn_priority="shortest")


@pytest.mark.timeout(600)
def test_longest_first_priorities_reach_an_engine_with_priority_scheduling(tmp_path):
    """turn_priority longest_first on a real engine started with vLLM's priority scheduling:
    the first batch has nothing to predict from (priority 0), the second sends every turn with
    its predicted remaining work as the priority, and the engine serves them all."""
    import os
    import sys
    from pathlib import Path

    import ray

    from war_openrlhf.rollout import RolloutPool

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "tests"))
    from test_rollout_pool import DOC_STYLE_AGENT, MODEL_DIR  # the pool tests' agent and model

    from war_openrlhf.fixtures.tiny_model import build_tiny_model

    model = build_tiny_model(MODEL_DIR)
    agent = tmp_path / "agent_func.py"
    agent.write_text(DOC_STYLE_AGENT)
    cfg = RolloutConfig(num_engines=1, agent_func_path=str(agent), n_samples_per_prompt=3, max_turns=5,
                        max_context_tokens=1024, max_new_tokens_per_turn=32, seed=3, progress=False,
                        tool_timeout_s=2.0, turn_priority="longest_first",
                        engine=dict(model=str(model), dtype="float32", max_model_len=2048, enforce_eager=True,
                                    num_speculative_tokens=8, scheduling_policy="priority"))
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(root)}})
    try:
        p = RolloutPool.start(cfg)
        try:
            prompts = ["Question: what is 2+3?", "Find the status of flight AA12."]
            first = p.run_batch(prompts, ["ok", "ok"])
            assert first.end_reasons == {"done": 6} and p.router.priorities.predictions == 0
            second = p.run_batch(prompts, ["ok", "ok"])
            assert second.end_reasons == {"done": 6}
            assert p.router.priorities.predictions == second.turns  # every turn carried a predicted priority
        finally:
            p.shutdown()
    finally:
        ray.shutdown()
        os.environ.pop("RAY_ADDRESS", None)
