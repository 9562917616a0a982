"""The main job's run record: what cpu_demo writes after its stages (memory, install time,
the command that ran it) and how the docs read a set of records against the demo's targets."""

from __future__ import annotations

import json

import pytest

from war_openrlhf.cli import cpu_demo
from war_openrlhf.metrics.docs_renderers import demo_runs, demo_runs_reading


def _record(demo_s=300.0, install_s=None, tpv=2.0, first2=0.4, last2=0.6, x=1.5, peak=9.0):
    side = {"regime": "high load", "x_openrlhf": x,
            "configs": {"openrlhf": {"step_s": 3.0 * x, "step_s_spread": [2.9 * x, 3.1 * x]},
                        "war": {"step_s": 3.0, "step_s_spread": [2.8, 3.3]}}} if x else None
    return {"seed": 42, "demo_s": demo_s, "install_s": install_s, "written_at": "2026-12-04T14:00:00+00:00",
            "memory": {"peak_gib": peak},
            "summary": {"tokens_per_verification_step": tpv, "acceptance": 0.6,
                        "reward_first2": first2, "reward_last2": last2},
            "side_by_side": side}


def test_main_writes_the_record_with_memory_install_time_and_command(tmp_path, monkeypatch):
    out = tmp_path / "run"
    monkeypatch.setattr(cpu_demo, "_demo", lambda args: {"out": str(out), "demo_s": 1.0, "summary": {}})
    monkeypatch.setenv("WAR_INSTALL_S", "12.5")
    target = tmp_path / "record.json"
    cpu_demo.main(["--seed", "7", "--json", str(target)])
    d = json.loads(target.read_text())
    assert d["install_s"] == 12.5
    assert d["command"] == f"bash scripts/main.sh --seed 7 --json {target}"
    assert d["memory"]["peak_gib"] >= d["memory"]["baseline_gib"] > 0
    assert d["git"] is not None and "machine" in d

    monkeypatch.delenv("WAR_INSTALL_S")
    cpu_demo.main([])  # the default place: the run directory
    d = json.loads((out / "demo_run.json").read_text())
    assert d["install_s"] is None and d["command"] == "python -m war_openrlhf.cli.cpu_demo"


def test_the_table_has_a_row_per_run_with_total_minutes():
    table = demo_runs(_record(), _record(demo_s=420.0, install_s=120.0))
    rows = [r for r in table.splitlines() if r.startswith("| ") and not r.startswith("| run")]
    assert len(rows) == 2
    assert "| 5.0 |" in rows[0] and "| 9.0 |" in rows[1]  # (install + demo) / 60
    assert "0.400 -> 0.600" in rows[0] and "4.50 (4.35-4.65)" in rows[0]


@pytest.mark.parametrize("bad, missed", [
    (dict(demo_s=700.0), "target <= 10: 2 of 3 runs: **missed**"),
    (dict(peak=12.5), "target <= 12: 2 of 3 runs: **missed**"),
    (dict(tpv=1.2), "target >= 1.5: 2 of 3 runs: **missed**"),
    (dict(last2=0.45), "target >= +0.1 on 1 seed(s): 2 of 3 runs: **missed**"),
    (dict(x=1.2), "target >= 1.3x in every run: 2 of 3 runs: **missed**"),
    (dict(x=None), "target >= 1.3x in every run: 2 of 3 runs: **missed**"),
])
def test_the_reading_says_which_target_one_run_misses(bad, missed):
    good = demo_runs_reading(_record(), _record(), _record())
    assert "missed" not in good and good.count("3 of 3 runs: met") == 5
    assert "training seeds 42, 42, 42; target >= +0.1 on 1 seed(s)" in good
    text = demo_runs_reading(_record(), _record(**bad), _record())
    assert missed in text and text.count("**missed**") == 1
