"""The README's real-engine standing: every reported bench_rollout run grouped by regime, war
against OpenRLHF, vLLM's suffix method and the fastest router, newest run and range over runs."""

from __future__ import annotations

import pytest

from war_openrlhf.metrics.docs_renderers import real_engine_standing


def _run(when, steps, *, split="validation", seed=0, pressure=None, commit="abc1234", repeats=3,
         workload="../shared/traces/tau_airline_dev.json"):
    return {"workload": workload, "split": split, "trace_args": {"seed": seed},
            "kv_tokens_per_engine": None if pressure is None else 1000, "pressure": pressure,
            "regime": {"load": "high", "episodes_per_engine": 8.0}, "written_at": when,
            "git": {"commit": commit + "0" * 33}, "repeats": repeats,
            "configs": {c: {"step_s": s} for c, s in steps.items()}}


def _rows(text):
    return [x for x in text.splitlines() if x.startswith("| ") and not x.startswith("| workload")]


def test_newest_run_of_a_regime_leads_and_the_range_covers_every_run():
    old = _run("2026-01-01T00:00:00", {"openrlhf": 30.0, "war": 20.0, "war_sticky": 25.0}, pressure=2.0,
               commit="old0000")
    new = _run("2026-01-02T00:00:00", {"openrlhf": 24.0, "war": 20.0, "war_sticky": 22.0, "war_dynamo_kv": 18.0},
               pressure=2.0, commit="new0000", repeats=5)
    rows = _rows(real_engine_standing(new, old))  # file order does not decide which run is newest
    assert len(rows) == 1
    r = rows[0]
    assert "| 2 | `new0000`, 5 repeats |" in r
    assert "| 1.20; 1.20-1.50 over 2 |" in r  # 24/20 newest, 30/20 older
    assert "| 0.90 (`war_dynamo_kv`); 0.90-1.25 over 2 |" in r  # the fastest router of each run
    assert "| - |" in r  # vLLM's suffix method in no run


def test_regimes_split_by_kv_and_a_comparison_missing_from_the_newest_run_says_so():
    ample_old = _run("2026-01-01T00:00:00", {"openrlhf": 10.0, "openrlhf_vllm_suffix": 9.0, "war": 10.0})
    ample_new = _run("2026-01-03T00:00:00", {"openrlhf": 10.0, "war": 12.5})
    p2 = _run("2026-01-02T00:00:00", {"openrlhf": 20.0, "war": 10.0}, pressure=2.0)
    rows = _rows(real_engine_standing(ample_old, p2, ample_new))
    assert len(rows) == 2
    ample = next(r for r in rows if "ample KV" in r)
    assert "| 0.80; 0.80-1.00 over 2 |" in ample and "| not run; 0.90 over 1 |" in ample
    assert "| 2.00 |" in next(r for r in rows if "KV pressure 2.0" in r)


@pytest.mark.parametrize("bad", [dict(split="tuning"), dict(split=None, seed=2, workload="task:sql_qa"),
                                 dict(split=None, seed=1, workload="task:sql_qa")])
def test_data_other_than_the_reported_is_refused(bad):
    with pytest.raises(ValueError, match="is not reported data: tuning data or another draw"):
        real_engine_standing(_run("2026-01-01T00:00:00", {"openrlhf": 1.0, "war": 1.0}, **bad))


def test_the_suffix_engine_reading_pairs_each_repeat_with_its_neighbours():
    from war_openrlhf.metrics.docs_renderers import rollout_suffix_engines

    runs = {"openrlhf": [4.0, 4.4, 4.0], "openrlhf_vllm_suffix": [2.0, 2.2, 3.0], "war": [2.5, 2.5, 2.5],
            "war_vllm_suffix_engines": [2.0, 2.0, 2.5]}
    d = {"runs": {c: [{"step_s": x} for x in v] for c, v in runs.items()},
         "configs": {c: {"step_s": sorted(v)[1]} for c, v in runs.items()}}
    text = rollout_suffix_engines(d)
    # medians: suffix 2.2, war 2.5, war on vLLM-suffix engines 2.0; per repeat 2.0/2.0, 2.2/2.0, 3.0/2.5
    assert "`war_vllm_suffix_engines` 1.10x `openrlhf_vllm_suffix` (median step over median step; per repeat " \
           "1.10 (1.00-1.20)" in text
    assert "`war_vllm_suffix_engines` 1.25x `war` (median step over median step; per repeat 1.25 (1.00-1.25)" in text
    assert "`war` 0.88x `openrlhf_vllm_suffix` in the same runs." in text
    del d["configs"]["openrlhf"]
    assert "`openrlhf`" not in rollout_suffix_engines(d)  # a comparison not run is not written


def test_runs_on_other_tasks_of_a_half_are_a_regime_of_their_own():
    """``--skip-groups``: the half's later tasks are other work, named in the row and the regime."""
    from war_openrlhf.metrics.docs_renderers import rollout_regime

    first = _run("2026-01-01T00:00:00", {"openrlhf": 2.0, "war": 1.0}, pressure=4.0)
    later = _run("2026-01-02T00:00:00", {"openrlhf": 3.0, "war": 1.0}, pressure=4.0)
    later["trace_args"]["skip_groups"] = 4
    rows = _rows(real_engine_standing(first, later))
    assert len(rows) == 2
    assert any("validation half, its tasks after the first 4" in r and "| 3.00 |" in r for r in rows)
    assert any("after the first" not in r and "| 2.00 |" in r for r in rows)
    d = {**later, "episodes": 8, "engines": 2, "regime": {**later["regime"], "tool_latency": "instant"},
         "machine": {}}
    assert "tau_airline_dev.json (validation half, its tasks after the first 4)" in rollout_regime(d)
    d["trace_args"]["skip_groups"] = 0
    assert "tau_airline_dev.json (validation half)," in rollout_regime(d)


def test_a_held_out_task_draw_is_accepted():
    text = real_engine_standing(_run("2026-01-01T00:00:00", {"openrlhf": 2.0, "war": 1.0}, split=None, seed=3,
                                     workload="task:sql_qa"))
    assert "| task:sql_qa, seed 3 |" in text and "| 2.00 |" in text


EARLIER_STEPS = [
    # (run keywords, regime keys of the earlier steps, standing row text, regime text, keys switched off)
    (dict(split=None, seed=3, workload="task:sql_qa"), {"history_steps": 1, "history_order": "reversed"},
     "after 1 step on the same prompts (reversed order)",
     "the timed step after 1 earlier step on the same prompts (in reverse order",
     {"history_steps": 0, "history_order": None}),
    (dict(pressure=4.0), {"warm_steps": 1, "warm_split": "tuning"},  # a pool past its first step
     "KV pressure 4.0, after 1 step on the tuning half's tasks",
     "the timed step after 1 untimed step on the tuning half's tasks by the same pool",
     {"warm_steps": 0, "warm_split": None}),
]


@pytest.mark.parametrize("run_kw, steps, row_text, regime_text, off", EARLIER_STEPS)
def test_runs_after_earlier_steps_are_a_regime_of_their_own(run_kw, steps, row_text, regime_text, off):
    from war_openrlhf.metrics.docs_renderers import rollout_regime

    plain = _run("2026-01-01T00:00:00", {"openrlhf": 2.0, "war": 1.0}, **run_kw)
    again = _run("2026-01-02T00:00:00", {"openrlhf": 3.0, "war": 1.0}, **run_kw)
    again["regime"] = {**again["regime"], **steps}
    rows = _rows(real_engine_standing(plain, again))
    assert len(rows) == 2  # not one regime's two runs
    assert any(row_text in r and "| 3.00 |" in r for r in rows)
    assert any("after" not in r and "| 2.00 |" in r for r in rows)
    d = {**again, "episodes": 8, "engines": 2, "regime": {**again["regime"], "tool_latency": "instant"},
         "machine": {}}
    text = rollout_regime(d)
    assert regime_text in text
    assert "step" not in rollout_regime({**d, "regime": {**d["regime"], **off}}).split("tools instant")[1]
    for other in EARLIER_STEPS:  # the other kind of earlier steps is not claimed
        assert other[1] is steps or other[3] not in text


def test_history_block_compares_per_repeat_and_says_where_each_path_ran_before():
    from war_openrlhf.metrics.docs_renderers import rollout_history

    def runs(steps, share):
        return [{"step_s": s, "returned_share": share} for s in steps]

    d = {"regime": {"history_steps": 2, "history_order": "same"},
         "configs": {"openrlhf": {"step_s": 4.0}, "openrlhf_vllm_suffix": {"step_s": 3.0}, "war": {"step_s": 2.0}},
         "runs": {"openrlhf": runs([4.0, 4.0, 4.0], 0.5), "openrlhf_vllm_suffix": runs([3.0, 2.0, 4.0], 0.5),
                  "war": runs([2.0, 2.0, 2.0], 1.0)}}
    assert "war_no_history" not in rollout_history(d)
    d["configs"]["war_no_history"] = {"step_s": 2.5}
    d["runs"]["war_no_history"] = runs([2.5, 2.5, 3.0], 1.0)
    text = rollout_history(d)
    assert "`war` 1.25x `war_no_history` (median step over median step; per repeat 1.25 (1.25-1.50); what drafting" in text
    assert "`war` 1.50x `openrlhf_vllm_suffix` (median step over median step; per repeat 1.50 (1.00-2.00))" in text
    assert "`war` 2.00x `openrlhf`" in text
    assert "`openrlhf_vllm_suffix` 0.50 (0.50-0.50) of its prompts" in text and "`war` 1.00 (1.00-1.00) of its turns" in text
    with pytest.raises(ValueError, match="history_steps"):
        rollout_history({**d, "regime": {"history_steps": 0}})


def test_a_random_init_model_run_is_a_regime_of_its_own():
    trained = _run("2026-01-01T00:00:00", {"openrlhf": 2.0, "war": 1.0}, split=None, seed=3, workload="task:sql_qa")
    random = _run("2026-01-02T00:00:00", {"openrlhf": 1.0, "war": 1.25}, split=None, seed=3, workload="task:sql_qa")
    random["model"] = "/x/.cache/war_tiny_llama"
    rows = _rows(real_engine_standing(trained, random))
    assert len(rows) == 2
    assert any("seed 3, random-init model (nothing to draft)" in r and "| 0.80 |" in r for r in rows)


def test_the_no_room_reading_adds_the_hosted_episodes_where_the_run_has_them():
    from war_openrlhf.metrics.docs_renderers import noroom_target

    steps = {"openrlhf": 10.0, "war": 10.0, "war_sticky": 9.0, "war_dynamo_kv": 10.5}
    text = noroom_target(_run("2026-01-01T00:00:00", steps))
    assert "missed, worst against `war_sticky`" in text and "war_hosted" not in text
    text = noroom_target(_run("2026-01-01T00:00:00", {**steps, "war_hosted": 8.0}))
    assert "missed, worst against `war_sticky`" in text  # the target is war's, the default
    assert ("`war_hosted` (`episode_host: engine`) against each: `openrlhf` 1.25x, `war_sticky` 1.12x, "
            "`war_dynamo_kv` 1.31x; `war` 1.25x (>= 0.98x every one)." in text)


def test_the_no_room_reading_names_where_each_configurations_groups_started():
    from war_openrlhf.metrics.docs_renderers import noroom_target

    steps = {"openrlhf": 10.0, "war": 9.0, "war_sticky": 9.5}
    d = _run("2026-01-01T00:00:00", steps)
    assert "GRPO group" not in noroom_target(d)  # runs recorded without the figure say nothing of it
    d["runs"] = {"openrlhf": [{"step_s": 10.0}] * 2,
                 "war": [{"group_engines": 2.0, "group_engines_max": 2.0}] * 2,
                 "war_sticky": [{"group_engines": 1.5, "group_engines_max": 2.0},
                                {"group_engines": 2.0, "group_engines_max": 2.0}]}
    text = noroom_target(d)
    assert "Target (>= 0.98x every one): met." in text
    assert text.rstrip().endswith("(mean over the groups, range over the runs; at most 2): "
                                  "`war` 2.00, `war_sticky` 1.50-2.00.")
