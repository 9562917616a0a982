"""The docs' reading of a low-load run against its target: both bars, per repeat, refused without war."""

from __future__ import annotations

import pytest

from war_openrlhf.metrics.docs_renderers import rollout_low_load_target


def _run(step):
    return {"step_s": step}


def _doc(war=(1.0, 1.1, 0.9), suffix=(1.2, 1.3, 1.1), openrlhf=(1.7, 1.8, 1.6)):
    runs = {"war": [_run(s) for s in war], "openrlhf_vllm_suffix": [_run(s) for s in suffix],
            "openrlhf": [_run(s) for s in openrlhf]}
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    configs = {k: {"step_s": med([r["step_s"] for r in v]), "tokens_per_verification_step": 2.5}
               for k, v in runs.items()}
    return {"configs": configs, "runs": runs, "command": "bench"}


def test_both_bars_are_read_from_median_steps_and_reported_per_repeat():
    text = rollout_low_load_target(_doc())
    assert "`war` 1.20x `openrlhf_vllm_suffix`" in text and "target >= 1.15x" in text
    assert "`war` 1.70x `openrlhf`" in text and "Target (both): met." in text
    assert "per repeat 1.20 (1.18-1.22)" in text  # 1.2/1.0, 1.3/1.1, 1.1/0.9 paired by repeat


def test_a_missed_bar_and_a_missing_baseline_say_missed():
    assert "Target (both): missed." in rollout_low_load_target(_doc(suffix=(1.1, 1.1, 1.0)))
    doc = _doc()
    del doc["configs"]["openrlhf"], doc["runs"]["openrlhf"]
    text = rollout_low_load_target(doc)
    assert "`openrlhf` not run." in text and "Target (both): missed." in text
    del doc["configs"]["war"]
    with pytest.raises(ValueError, match="no war configuration"):
        rollout_low_load_target(doc)
