"""tools/bench_dispatch.py end to end on a small matrix: the suite runs, keeps the JSON shape
results are compared by across versions, and a matrix run in parts merges to the same summary."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "bench_dispatch.py"


def _run(*args, cwd=ROOT):
    proc = subprocess.run([sys.executable, str(TOOL), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_suite_runs_keeps_the_json_shape_and_merges(tmp_path):
    common = ["--suite", "--sources", "gen:math_tool,gen:chatty_long_responses", "--per-engine", "2",
              "--suite-pressures", "2", "--suite-tools", "fast"]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    out = _run(*common, "--suite-engines", "2", "--json", str(a))
    _run(*common, "--suite-engines", "3", "--json", str(b))
    assert "min over 2 cells of war / best peer" in out
    data = json.loads(a.read_text())
    assert data["split"] == "validation" and data["generator_seed"] == 0
    for run in data["runs"]:
        assert run["ceiling"]["x_least_loaded"] >= 0.999  # nothing beats the ceiling
        for pol, res in run["results"].items():
            assert res["throughput_tok_s"] > 0
            assert res["critical_paths"] and res["makespan_s"] >= run["ceiling"]["makespan_s"] * 0.999, pol
        assert run["workload"]["kv_capacity_tokens_per_engine"] >= run["workload"]["longest_sequence_tokens"]
    merged = tmp_path / "m.json"
    _run("--suite-from", str(a), str(b), "--json", str(merged), "--plot", str(tmp_path / "m.png"))
    m = json.loads(merged.read_text())
    assert len(m["runs"]) == 4 and (tmp_path / "m.png").stat().st_size > 0
    ratios = [c["war_over_best_peer"] for c in m["cells"]]
    assert m["summary"]["min_war_over_best_peer"] == min(ratios)
    # the docs' suite regions render from the merged file: one row per cell, the minimum quoted
    from war_openrlhf.metrics.docs_renderers import (dispatch_suite_by_source, dispatch_suite_cells,
                                                     dispatch_suite_targets)

    assert dispatch_suite_cells(m).count("\n") == 2 + len(m["cells"])
    assert dispatch_suite_by_source(m).count("\n") == 2 + len({(c["cell"]["source"], c["cell"]["engines"])
                                                              for c in m["cells"]})
    assert f"{min(ratios):.3f}" in dispatch_suite_targets(m)


def _without_timings(x):
    """The test's own notion of "the same result" (not the tool's, which it checks)."""
    if isinstance(x, dict):
        return {k: _without_timings(v) for k, v in x.items() if "decision" not in k and "wall" not in k}
    if isinstance(x, list):
        return [_without_timings(v) for v in x]
    return x


def test_suite_in_worker_processes_gives_the_same_cells_in_matrix_order(tmp_path):
    common = ["--suite", "--sources", "gen:math_tool,gen:chatty_long_responses", "--per-engine", "2",
              "--suite-pressures", "2", "--suite-tools", "fast,slow", "--suite-engines", "2"]
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    _run(*common, "--json", str(one))
    _run(*common, "--workers", "2", "--json", str(two))
    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    assert [r["workload"]["source"] + r["workload"]["tools"] for r in b["runs"]] == \
        [r["workload"]["source"] + r["workload"]["tools"] for r in a["runs"]]
    assert _without_timings(a["runs"]) == _without_timings(b["runs"])
    assert a["summary"] == b["summary"]


def test_suite_from_keeps_a_cell_in_two_files_once_and_refuses_one_that_differs(tmp_path):
    import gzip

    common = ["--suite", "--sources", "gen:math_tool", "--per-engine", "2", "--suite-pressures", "2",
              "--suite-engines", "2"]
    a, b = tmp_path / "a.json.gz", tmp_path / "b.json.gz"
    _run(*common, "--suite-tools", "fast", "--json", str(a))
    _run(*common, "--suite-tools", "fast,slow", "--json", str(b))  # a stopped run, completed by another
    merged = tmp_path / "m.json"
    out = _run("--suite-from", str(a), str(b), "--json", str(merged))
    assert "1 cell(s) found in two files" in out
    m = json.loads(merged.read_text())
    assert [(r["workload"]["tools"]) for r in m["runs"]] == ["fast", "slow"] and len(m["cells"]) == 2
    data = json.loads(gzip.open(b, "rt").read())
    data["runs"][0]["results"]["war"]["makespan_s"] *= 1.01  # not what the simulation gives
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    proc = subprocess.run([sys.executable, str(TOOL), "--suite-from", str(a), str(bad), "--json",
                           str(tmp_path / "o.json")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "differs between" in proc.stderr


def test_suite_from_refuses_a_non_suite_file(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"runs": []}))
    proc = subprocess.run([sys.executable, str(TOOL), "--suite-from", str(bad), "--json", str(tmp_path / "o.json")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "not a --suite result" in proc.stderr


def test_suite_refuses_an_unknown_source_naming_the_known_ones(tmp_path):
    proc = subprocess.run([sys.executable, str(TOOL), "--suite", "--sources", "gen:nope",
                           "--json", str(tmp_path / "o.json")], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "unknown source 'gen:nope'" in proc.stderr
    assert "gen:math_tool" in proc.stderr


def _suite(war_s, peer_s, deferrals, commit, cells=(("gen:tau_like", 32, 4.0, "slow"),)):
    runs, summaries = [], []
    for (src, e, p, t) in cells:
        res = {"war": {"makespan_s": war_s, "throughput_tok_s": 1000.0 / war_s, "deferrals": deferrals},
               "sticky": {"makespan_s": peer_s, "throughput_tok_s": 1000.0 / peer_s, "deferrals": 0},
               "least_loaded": {"makespan_s": 70.0, "throughput_tok_s": 1000.0 / 70.0, "deferrals": 0}}
        runs.append({"results": res})
        summaries.append({"cell": {"source": src, "split": "validation", "engines": e, "pressure": p,
                                   "tools": t}})
    return {"suite": True, "cells": summaries, "runs": runs, "git": {"commit": commit}}


def test_suite_rerun_renders_war_before_and_after_and_refuses_other_work():
    """The rerun table pairs cells by regime, shows war's step and ratio before and after, and
    refuses files whose peers differ (not the same work) or cells the earlier suite lacks."""
    import pytest

    from war_openrlhf.metrics.docs_renderers import dispatch_suite_rerun, dispatch_suite_rerun_reading

    old = _suite(75.2, 66.3, 8834, "a" * 40)
    new = _suite(63.0, 66.3, 0, "b" * 40)
    table = dispatch_suite_rerun(old, new)
    assert "| gen:tau_like | 32 | 4 | slow | 75.2 | 63.0 | 8,834 | 0 | sticky | 0.882 | 1.052 |" in table
    text = dispatch_suite_rerun_reading(old, new)
    assert "min 0.882 before, 1.052 after" in text and "war's changed in 1" in text and "`aaaaaaa`" in text
    with pytest.raises(ValueError, match="sticky differs"):
        dispatch_suite_rerun(old, _suite(63.0, 60.0, 0, "b" * 40))
    with pytest.raises(ValueError, match="not in the earlier suite"):
        dispatch_suite_rerun(old, _suite(63.0, 66.3, 0, "b" * 40, cells=(("tau", 8, 2.0, "fast"),)))


def test_suite_ablation_renders_the_option_per_cell_and_in_sum():
    """An ablation pairs the cells of two runs of the same work, names the variant's option,
    and counts faster and slower cells; a variant that changes nothing is refused."""
    import pytest

    from war_openrlhf.metrics.docs_renderers import dispatch_suite_ablation, dispatch_suite_ablation_reading

    cells = (("gen:tau_like", 32, 4.0, "slow"), ("tau", 8, 2.0, "fast"))
    base = _suite(60.0, 66.3, 0, "a" * 40, cells=cells)
    variant = _suite(50.0, 66.3, 0, "b" * 40, cells=cells)
    variant["runs"][1]["results"]["war"] = {"makespan_s": 70.0, "throughput_tok_s": 1000.0 / 70.0, "deferrals": 0}
    variant["war_sim"] = {"turn_priority": "longest_first"}
    table = dispatch_suite_ablation(base, variant)
    assert "| gen:tau_like | 32 | 4 | slow | 60.0 | 50.0 | 1.200 | war | " not in table  # war is never its own peer
    assert "| gen:tau_like | 32 | 4 | slow | 60.0 | 50.0 | 1.200 | sticky | 1.105 | 1.326 |" in table
    text = dispatch_suite_ablation_reading(base, variant)
    assert "`turn_priority: longest_first`" in text and "range 0.857-1.200" in text
    assert "1 cells faster by more than 1%, 1 slower by more than 1%, 0 identical" in text and "min 1.105 without, 0.947 with" in text
    del variant["war_sim"]
    with pytest.raises(ValueError, match="no war_sim"):
        dispatch_suite_ablation_reading(base, variant)



def test_draws_average_each_policy_over_workloads_of_the_splits_parity(tmp_path):
    """``--draws 2``: each cell runs every policy on two workload draws (generator seeds 0 and 2
    for validation, never the tuning half's odd seeds); each policy's step is its mean, its
    throughput ratio to another equals the ratio of mean steps, and one draw alone is the
    one-draw suite's cell."""
    common = ["--suite", "--sources", "gen:math_tool", "--per-engine", "2", "--suite-pressures", "2",
              "--suite-tools", "fast", "--suite-engines", "2"]
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    _run(*common, "--json", str(one))
    _run(*common, "--draws", "2", "--json", str(two))
    (r1,), (r2,) = json.loads(one.read_text())["runs"], json.loads(two.read_text())["runs"]
    assert [d["generator"] for d in r2["workload"]["draws"]] == [0, 2]
    for pol, res in r2["results"].items():
        steps = [d["makespan_s"] for d in res["draws"]]
        assert res["makespan_s"] == sum(steps) / 2 and steps[0] == r1["results"][pol]["makespan_s"], pol
    war, ll = r2["results"]["war"], r2["results"]["least_loaded"]
    assert abs(war["x_least_loaded"] - ll["makespan_s"] / war["makespan_s"]) < 1e-9
    assert len(r2["ceiling"]["draws"]) == 2
    proc = subprocess.run([sys.executable, str(TOOL), *common, "--draws", "0", "--json", str(tmp_path / "x.json")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "--draws must be >= 1" in proc.stderr
    proc = subprocess.run([sys.executable, str(TOOL), "--draws", "2", "--json", str(tmp_path / "y.json")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "--draws applies to --suite runs only" in proc.stderr


def test_draws_reading_places_the_losing_cells_by_pressure_and_their_swing():
    import pytest

    from war_openrlhf.metrics.docs_renderers import dispatch_suite_draws_reading

    d = _suite(60.0, 66.3, 0, "a" * 40, cells=(("tau", 4, 1.0, "fast"), ("tau", 4, 4.0, "fast")))
    d["cells"][0]["war_over_best_peer"], d["cells"][1]["war_over_best_peer"] = 1.01, 0.95
    d["cells"][1]["best_peer"] = "sticky"
    for run in d["runs"]:
        for res in run["results"].values():
            res["draws"] = [{"makespan_s": res["makespan_s"]}, {"makespan_s": res["makespan_s"]}]
    d["runs"][1]["results"]["war"]["draws"] = [{"makespan_s": 66.3}, {"makespan_s": 78.0}]
    text = dispatch_suite_draws_reading(d)
    assert "2 draws per cell" in text and "pressure 1: 0 of 1, pressure 4: 1 of 1" in text
    assert "by 0.150-0.150" in text  # 66.3/66.3 - 66.3/78.0
    for run in d["runs"]:
        for res in run["results"].values():
            del res["draws"]
    with pytest.raises(ValueError, match="several draws"):
        dispatch_suite_draws_reading(d)

