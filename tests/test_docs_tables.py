"""The docs' tables and figures against the committed result files they name.

Every rendered region of README.md and docs/*.md (``<!-- table: FILE#RENDERER -->`` ...
``<!-- /table -->``, ``block`` and inline ``value`` regions alike) must equal a fresh rendering
from its file, the file must be committed, carry its provenance (command, commit, machine) and,
for timed results, at least 3 runs per figure; no markdown table of README.md or
docs/benchmarks.md may be typed by hand (a table without figures says so with the static mark),
nor a measured ratio in their prose; and every committed result file is used.
``python tools/render_docs.py`` re-renders the docs after a result file changes.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from war_openrlhf.metrics import write_json
from war_openrlhf.metrics.docs_tables import (
    STATIC_MARK,
    check_text,
    regions,
    render_text,
    unsourced_tables,
)
from war_openrlhf.metrics.report import read_json

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: the pages that state measured figures: every table in them renders from a file or is marked static
TABLE_DOCS = [ROOT / "README.md", ROOT / "docs" / "benchmarks.md"]


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


def _tracked(paths: list[str]) -> set[str]:
    """The paths git tracks (all of them outside a git checkout: nothing to compare against)."""
    try:
        out = subprocess.run(["git", "ls-files", "--", *paths], cwd=ROOT, capture_output=True, text=True,
                             timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return set(paths)
    return set(out.split())


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_every_rendered_region_matches_its_result_file(doc):
    text = doc.read_text()
    bad = check_text(text, ROOT, _rel(doc))
    assert not bad, "\n\n".join(
        f"{m.file}:{m.line}: {m.spec} no longer matches its file (python tools/render_docs.py):\n"
        f"--- in the docs\n{m.found}--- rendered from the file\n{m.expected}" for m in bad)


@pytest.mark.parametrize("doc", TABLE_DOCS, ids=_rel)
def test_no_table_is_typed_by_hand(doc):
    lines = unsourced_tables(doc.read_text())
    assert not lines, (f"{_rel(doc)}: tables at lines {lines} name no result file; render them from one "
                       f"(<!-- table: FILE#RENDERER -->) or, if they state no measured figure, mark them {STATIC_MARK}")


def _named_files() -> dict[str, list[str]]:
    named: dict[str, list[str]] = {}
    for doc in DOCS:
        for r in regions(doc.read_text()):
            for p in r.paths:
                named.setdefault(p, []).append(f"{_rel(doc)}:{r.line}")
    return named


def test_the_files_the_docs_name_are_committed_result_files():
    named = _named_files()
    assert named, "the docs render nothing from result files"
    for path in named:
        assert path.startswith("benchmarks/results/"), f"{path} ({named[path][0]}): not under benchmarks/results/"
        assert (ROOT / path).is_file(), f"{path} ({named[path][0]}): no such file"
    untracked = set(named) - _tracked(sorted(named))
    assert not untracked, f"result files the docs render but git does not track: {sorted(untracked)}"


def _result_files() -> list[Path]:
    return sorted(p for p in RESULTS.rglob("*") if p.is_file() and p.name.endswith((".json", ".json.gz")))


def test_every_result_file_is_used_by_the_docs():
    named = set(_named_files())
    unused = [_rel(p) for p in _result_files() if _rel(p) not in named]
    assert not unused, f"result files no doc renders from (name them in the docs or remove them): {unused}"


def _spreads(node):
    """Every timed figure in a result file: dicts holding a median and its runs."""
    if isinstance(node, dict):
        if "median" in node and "runs" in node:
            yield node
        for v in node.values():
            yield from _spreads(v)
    elif isinstance(node, list):
        for v in node:
            yield from _spreads(v)


@pytest.mark.parametrize("path", _result_files(), ids=_rel)
def test_every_result_file_records_its_provenance_and_its_runs(path):
    d = read_json(path)
    assert isinstance(d.get("command"), str) and d["command"].startswith(("python ", "bash scripts/")), \
        "the command that wrote it"
    assert re.fullmatch(r"[0-9a-f]{40}", (d.get("git") or {}).get("commit", "")), "the git commit it ran from"
    machine = d.get("machine") or {}
    assert machine.get("cpu_model") and machine.get("cpus"), "the machine: CPU model and cores"
    if d.get("timed"):
        spreads = list(_spreads(d))
        assert spreads, "a timed result keeps its runs"
        for s in spreads:
            if s["median"] is None:  # nothing fell in this bucket in any run
                continue
            runs = [x for x in s["runs"] if x is not None]
            assert len(runs) >= 3, f"a timed figure from {len(runs)} runs: >= 3 needed"
            assert min(runs) == s["min"] and max(runs) == s["max"]
            assert s["min"] <= s["median"] <= s["max"]
    if path.name.endswith(".json"):
        assert path.stat().st_size <= 2 * 2**20, "a large result file is committed gzipped (.json.gz)"


# ------------------------------------------------------------------- the checker itself
def _synthetic(tmp_path: Path) -> tuple[Path, str]:
    f = tmp_path / "benchmarks" / "results" / "x" / "r.json"
    write_json(f, {"benchmark": "dispatch_decision", "timed": True, "repeats": 3,
                   "workload": {"engines": 4, "max_context": 65536},
                   "policies": ["war"],
                   "results": {"war": {"turns": 12, **{
                       f"{clock}{k}": {"median": 2.0, "min": 1.0, "max": 3.0, "runs": [1.0, 2.0, 3.0]}
                       for clock in ("", "cpu_")
                       for k in ("p50_us", "p99_us", "p50_us_ctx>=32k", "p99_us_ctx>=32k", "finish_p50_us")}}}})
    text = ("# t\n\n<!-- table: benchmarks/results/x/r.json#decision_cost -->\n<!-- /table -->\n\n"
            "p50 <!-- value: benchmarks/results/x/r.json#results.war.p50_us:spread.1f --><!-- /value --> us, "
            "<!-- value: benchmarks/results/x/r.json#results.war.turns --><!-- /value --> turns\n")
    return f, render_text(text, tmp_path)


def test_rendering_fills_tables_and_values_from_the_file(tmp_path):
    _, text = _synthetic(tmp_path)
    assert "| war | 2.0 (1.0-3.0) | 2.0 (1.0-3.0) | 2.0 (1.0-3.0) | 2.0 (1.0-3.0) | 2.0 (1.0-3.0) |" in text
    assert "p50 <!-- value: benchmarks/results/x/r.json#results.war.p50_us:spread.1f -->2.0 (1.0-3.0)<!-- /value -->" in text
    assert "-->12<!-- /value --> turns" in text
    assert check_text(text, tmp_path) == []
    assert render_text(text, tmp_path) == text  # rendering is idempotent


def test_a_table_edited_by_hand_or_a_changed_file_is_caught(tmp_path):
    f, text = _synthetic(tmp_path)
    edited = text.replace("| war | 2.0 (1.0-3.0)", "| war | 1.9 (1.0-3.0)")
    assert edited != text
    bad = check_text(edited, tmp_path, "t.md")
    assert len(bad) == 1 and bad[0].spec == "benchmarks/results/x/r.json#decision_cost" and bad[0].line == 3
    edited_value = text.replace("-->12<!-- /value -->", "-->13<!-- /value -->")
    assert [m.spec for m in check_text(edited_value, tmp_path)] == ["benchmarks/results/x/r.json#results.war.turns"]
    d = json.loads(f.read_text())
    d["results"]["war"]["p50_us"]["median"] = 2.5
    f.write_text(json.dumps(d))
    assert len(check_text(text, tmp_path)) == 2  # the table (its wall-time column) and the inline value


def test_a_missing_file_or_renderer_fails_loudly(tmp_path):
    with pytest.raises(FileNotFoundError):
        check_text("<!-- table: benchmarks/results/none.json#decision_cost -->\n<!-- /table -->\n", tmp_path)
    _synthetic(tmp_path)
    with pytest.raises(KeyError):
        check_text("<!-- table: benchmarks/results/x/r.json#no_such_renderer -->\n<!-- /table -->\n", tmp_path)


def test_hand_typed_tables_are_found_and_the_static_mark_exempts_one():
    typed = "text\n\n| a | b |\n|---|---:|\n| x | 1.5 |\n"
    assert unsourced_tables(typed) == [3]
    assert unsourced_tables(f"text\n\n{STATIC_MARK}\n| a | b |\n|---|---|\n| x | y |\n") == []
    inside = "<!-- table: f.json#r -->\n| a | b |\n|---|---|\n| x | 1 |\n<!-- /table -->\n"
    assert unsourced_tables(inside) == []
    assert unsourced_tables("```\n| a | b |\n|---|---|\n```\n") == []


def test_prose_states_no_measured_ratio_outside_rendered_regions():
    """A ratio such as 1.18x is a measurement: it must come from a file (a target, '>= 1.2x', may be typed)."""
    from war_openrlhf.metrics.docs_tables import REGION_RE, VALUE_RE

    found = []
    for doc in TABLE_DOCS:
        text = VALUE_RE.sub("", REGION_RE.sub("", doc.read_text()))
        text = re.sub(r"```.*?```", "", text, flags=re.S)
        for m in re.finditer(r"(?<![\w.])(\d+\.\d+)x\b", text):
            before = text[max(0, m.start() - 3):m.start()]
            if not re.search(r"[<>]=\s?$", before):
                found.append(f"{_rel(doc)}: {text[max(0, m.start() - 60):m.end() + 20]!r}")
    assert not found, "measured ratios typed in prose:\n" + "\n".join(found)


def test_every_benchmark_tool_writes_its_results_through_write_json():
    """The one writer records command, commit and machine; a tool that writes its own JSON would not."""
    tools = sorted((ROOT / "tools").glob("bench_*.py")) + [ROOT / "tools" / n for n in
                                                           ("check_spec_sampling.py", "soak.py", "resimulate_rollout.py")]
    assert len(tools) >= 8
    for tool in tools:
        src = tool.read_text()
        assert "write_json(" in src, f"{tool.name}: results not written through war_openrlhf.metrics.write_json"
        assert "json.dumps(out" not in src and ".write_text(json.dumps" not in src, \
            f"{tool.name}: writes a result file of its own (use war_openrlhf.metrics.write_json)"


def test_cpu_by_process_groups_a_configuration_s_own_engines_apart_from_the_idle_set():
    from war_openrlhf.metrics.docs_renderers import _cpu_groups

    cpu = {"driver": 0.5, "ray::WarEngine": 1.0, "ray::WarEngine/VLLM::Worker": 5.0,
           "ray::WarEngine/VLLM::EngineCore": 0.8, "ray::RolloutRayActor": 0.1,
           "ray::RolloutRayActor/VLLM::Worker": 0.2, "other": 0.3}
    war = _cpu_groups("war_sticky", cpu)
    assert war == {"workers": 5.0, "cores": 0.8, "actors": 1.0, "driver": 0.5, "idle set": pytest.approx(0.3),
                   "other": 0.3}
    base = _cpu_groups("openrlhf_vllm_suffix", cpu)
    assert base["workers"] == 0.2 and base["actors"] == 0.1 and base["idle set"] == pytest.approx(6.8)
    assert sum(war.values()) == pytest.approx(sum(cpu.values())) == pytest.approx(sum(base.values()))


def test_the_rollout_engine_tax_pairs_each_repeat_and_states_the_target():
    from war_openrlhf.metrics.docs_renderers import rollout_engine_tax

    d = {"configs": {"war_sched_only": {"step_s": 10.5, "step_s_runs": [10.5, 11.0, 10.0]},
                     "war_plain_engines": {"step_s": 10.0, "step_s_runs": [10.0, 10.0, 10.0]},
                     "war": {"step_s": 8.0}}}
    text = rollout_engine_tax(d)
    assert "+0.0%, +5.0%, +10.0% (median +5.0%" in text and "1.25x `war_plain_engines`" in text
    assert "missed on the median repeat" in text
    d["configs"]["war_sched_only"]["step_s_runs"] = [10.1, 9.9, 10.0]
    assert "met on the median repeat" in rollout_engine_tax(d)


def test_the_admission_table_pools_each_configurations_turns_and_leaves_out_the_baselines():
    from war_openrlhf.metrics.docs_renderers import rollout_admission

    def est(turns, over, over_tokens, cached):
        return {"turns": turns, "over": over, "over_tokens": over_tokens, "cached_tokens": cached}

    d = {"runs": {"openrlhf": [{"step_s": 1.0}, {"step_s": 1.0}],
                  "war": [{"deferrals": 0, "cache_estimate": est(100, 0.5, 300, 1000)},
                          {"deferrals": 3, "cache_estimate": est(300, 0.1, 100, 3000)}]}}
    text = rollout_admission(d)
    row = next(x for x in text.splitlines() if x.startswith("| `war`"))
    # turns pooled: (50 + 30) / 400; tokens pooled: 400 / 4000
    assert row == "| `war` | 0, 3 | -, - | 0.20 | 0.10 |"
    assert "`openrlhf`" not in text
    # which gate each run met: never full, the fluid model's answer either way, K >= N
    gates = [{"admission_full_offers": 0, "admission_fluid": None},
             {"admission_full_offers": 7, "admission_fluid": {"admit_s": 60.4, "defer_s": 40.2, "K": 5,
                                                               "N": 8.0, "defers": True}},
             {"admission_full_offers": 7, "admission_fluid": {"admit_s": 40.0, "defer_s": 45.0, "K": 5,
                                                               "N": 8.0, "defers": False}},
             {"admission_full_offers": 2, "admission_fluid": {"K": 9, "N": 8.0, "defers": False}},
             {"admission_full_offers": 3, "admission_fluid": {"defers": True, "unmeasured": True}}]
    d["runs"]["war"] = [dict(g, deferrals=0, cache_estimate=est(10, 0.0, 0, 10)) for g in gates]
    d["runs"]["war"][2]["step_s"] = 51.6
    row = next(x for x in rollout_admission(d).splitlines() if x.startswith("| `war`"))
    assert ("| never full, waves, K 5 of 8 (estimated: waves 40 s, all 60 s), all, K 5 of 8 (estimated: "
            "waves 45 s, all 40 s; step 52 s), K >= N, waves, nothing measured yet |") in row
    d["runs"]["war"][0]["admission_full_offers"] = 4  # refused, yet no answer recorded: not read as one
    with pytest.raises(ValueError, match="admission_fluid: a run whose budget refused 4 first turns"):
        rollout_admission(d)
    with pytest.raises(ValueError, match="no run of a WAR-pool configuration"):
        rollout_admission({"runs": {"openrlhf": [{"step_s": 1.0}]}})


def test_drafting_fractions_are_labelled_by_what_they_count():
    """Files whose fractions count each run's own steps say nothing more; older ones (counted
    since the engines started, over every configuration sharing them) say so."""
    from war_openrlhf.metrics.docs_renderers import noroom_target

    d = {"configs": {"war": {"step_s": 10.0, "speculating_fraction": [0.2, 0.5]},
                     "openrlhf": {"step_s": 12.0}}}
    old = noroom_target(d)
    assert "drafted in 20-50% of their steps (counted since the engines started" in old
    d["speculating_fraction_scope"] = "run"
    assert "drafted in 20-50% of their steps." in noroom_target(d)


def test_the_price_ablation_pairs_each_repeat_and_names_the_fastest_router():
    from war_openrlhf.metrics.docs_renderers import rollout_price_ablation

    d = {"configs": {"war": {"step_s": 10.0, "step_s_runs": [10.0, 12.0, 8.0]},
                     "war_all_prompt_price": {"step_s": 11.0, "step_s_runs": [11.0, 12.0, 6.0]},
                     "war_sticky": {"step_s": 9.0}, "war_dynamo_kv": {"step_s": 10.5}}}
    text = rollout_price_ablation(d)
    assert "per repeat: 0.75, 1.00, 1.10 (median 1.00; median step over median step 1.10" in text
    assert "(`war_sticky`, median step over median step): `war` 0.90x, `war_all_prompt_price` 0.82x" in text
    del d["configs"]["war_sticky"], d["configs"]["war_dynamo_kv"]
    assert "router" not in rollout_price_ablation(d)


def test_the_fluid_inputs_table_lists_each_asked_run_and_refuses_a_file_without_them():
    from war_openrlhf.metrics.docs_renderers import rollout_fluid_inputs

    inputs = {"prefill_s_per_token": 1.3e-4, "step_s": 0.0106, "growth_per_turn": 493.0, "kv_tokens": 20480.0,
              "budget": 17056.0, "miss_rounds": 13}
    fluid = {"admit_s": 39.8, "defer_s": 66.9, "K": 3, "N": 8.0, "defers": False, "inputs": inputs}
    d = {"runs": {"openrlhf": [{"step_s": 80.0}],
                  "war": [{"step_s": 63.6, "admission_fluid": fluid}, {"step_s": 50.0, "admission_fluid": None}]}}
    rows = [x for x in rollout_fluid_inputs(d).splitlines() if x.startswith("| `")]
    assert rows == ["| `war` | 1 | 130 | 10.6 | 493 | 20,480 / 17,056 | 3 of 8 | 13 | 67 | 40 | all | 63.6 |"]
    with pytest.raises(ValueError, match="no run recorded the fluid model's inputs"):
        rollout_fluid_inputs({"runs": {"war": [{"step_s": 1.0, "admission_fluid": {"K": 9, "N": 8.0}}]}})
