"""The run summary (the CPU demo's plot and text): tags in engine order, the learning check,
the side-by-side panel."""

from __future__ import annotations

import pytest

from war_openrlhf.metrics.run_summary import _matching, plot, reward_ends, summary_lines


def _scalars(rewards, engines=12):
    s = {"train/reward": list(enumerate(rewards, 1)), "train/timing/generation": [(1, 2.0), (2, 1.0)]}
    for i in range(engines):
        s[f"war/engine{i}_spec_acceptance_rate"] = [(1, 0.1 * (i % 10)), (2, 0.1 * (i % 10))]
        s[f"war/engine{i}_tokens_per_verification_step"] = [(1, 1.0 + i), (2, 1.0 + i)]
    s["war/engine_total_spec_acceptance_rate"] = [(1, 9.0)]  # not an engine index: not matched
    return s


def test_engine_tags_come_in_numeric_order_and_only_with_an_index():
    tags = _matching(_scalars([0.1, 0.2]), "war/engine*_spec_acceptance_rate")
    assert tags == [f"war/engine{i}_spec_acceptance_rate" for i in range(12)]


def test_reward_ends_average_the_first_and_last_two_steps():
    assert reward_ends(_scalars([0.1, 0.3, 0.5, 0.4, 0.8])) == pytest.approx((0.2, 0.6))
    assert reward_ends(_scalars([0.5])) == (None, None)
    lines = summary_lines(_scalars([0.1, 0.3, 0.5, 0.4, 0.8], engines=2))
    assert any("first 2 -> last 2:   0.200 -> 0.600" in line for line in lines)
    assert any(line.strip().startswith("engine 1: acceptance 0.100, tokens / verification step 2.00")
               for line in lines)


def test_plot_draws_the_side_by_side_panel(tmp_path):
    comparison = {"configs": {"openrlhf": {"step_s": 2.0, "x_openrlhf": 1.0},
                              "war": {"step_s": 1.0, "x_openrlhf": 2.0}}, "regime": "low load"}
    with_panel, without = tmp_path / "a.png", tmp_path / "b.png"
    plot(_scalars([0.1, 0.2], engines=2), with_panel, comparison)
    plot(_scalars([0.1, 0.2], engines=2), without)
    assert with_panel.stat().st_size > 10_000 and without.stat().st_size > 10_000
    assert with_panel.read_bytes() != without.read_bytes()
    # the repeats' spread is drawn as whiskers: a different picture from the medians alone
    spread = {"configs": {"openrlhf": {"step_s": 2.0, "x_openrlhf": 1.0, "step_s_spread": [1.5, 2.6]},
                          "war": {"step_s": 1.0, "x_openrlhf": 2.0, "step_s_spread": [0.8, 1.4]}},
              "regime": "low load"}
    whiskers = tmp_path / "c.png"
    plot(_scalars([0.1, 0.2], engines=2), whiskers, spread)
    assert whiskers.read_bytes() != with_panel.read_bytes()


def test_the_scalar_reader_returns_every_point_written_across_event_files(tmp_path):
    """read_scalars: two runs' event files under one directory, 1,600 steps: every (step, value)
    comes back, by tag as written, sorted by step; war-summary's loader renames train/war/... to
    war/... and refuses an empty dir."""
    import random

    from torch.utils.tensorboard import SummaryWriter

    from war_openrlhf.metrics.run_summary import load_scalars
    from war_openrlhf.metrics.tb_scalars import read_scalars

    rng = random.Random(5)
    written: dict[str, list[tuple[int, float]]] = {}
    for run, steps in (("a", range(0, 1500)), ("b", range(1500, 1600))):
        w = SummaryWriter(str(tmp_path / "tb" / run))
        for step in steps:
            for tag in ("train/war/index_records", "train/reward") if step % 3 else ("train/reward",):
                v = float(rng.randint(0, 1000))  # exact in float32
                w.add_scalar(tag, v, step)
                written.setdefault(tag, []).append((step, v))
        w.close()
    assert read_scalars(tmp_path / "tb") == written
    renamed = load_scalars(tmp_path / "tb")
    assert renamed["war/index_records"] == written["train/war/index_records"]
    assert renamed["train/reward"] == written["train/reward"]
    with pytest.raises(ValueError, match="no TensorBoard event files"):
        load_scalars(tmp_path / "empty")
