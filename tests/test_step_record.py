"""Step records (engine/step_record.py) and the machine-model fit to them (simulation/fit_steps.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from war_openrlhf.engine.step_record import FIELDS, EngineSteps, read_step_records
from war_openrlhf.simulation.cost_model import CostModel
from war_openrlhf.simulation.fit_steps import fit_rollout_steps, step_table

ROOT = Path(__file__).resolve().parents[1]


def test_a_real_engine_records_each_step_as_the_simulator_counts_it(tmp_path):
    """Three distinct prompts (100, 200, 300 tokens) decoded 8 tokens each: one prefill step of
    600 tokens, then 7 decode steps of 3 sequences; every decode step attends the computed
    context (prompt + tokens so far): 8 * 600 + 3 * (0 + ... + 6) = 4863 context tokens in all."""
    from war_openrlhf.fixtures.tiny_model import build_tiny_model

    model = build_tiny_model(ROOT / ".cache" / "war_tiny_llama")
    script = textwrap.dedent(f"""
        import json
        from vllm import LLM, SamplingParams
        llm = LLM(model={str(model)!r}, max_model_len=1024, enforce_eager=True, dtype="float32")
        prompts = [{{"prompt_token_ids": [10 + (7 * i + 13 * k) % 200 for i in range(n)]}}
                   for k, n in enumerate((100, 200, 300))]
        out = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True, temperature=0), use_tqdm=False)
        print("RESULT", json.dumps([len(o.outputs[0].token_ids) for o in out]))
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_CPU_OMP_THREADS_BIND="nobind", WAR_STEP_RECORD_DIR=str(tmp_path / "steps"))
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    assert json.loads(lines[0][len("RESULT "):]) == [8, 8, 8]
    (eng,) = read_step_records(tmp_path / "steps")
    c = eng.columns
    assert eng.header["engine_kind"] == "plain" and eng.header["drafter"] is None and eng.header["block_size"] > 0
    assert eng.header["kv_capacity_tokens"] >= 1024 and eng.header["max_num_seqs"] > 0
    assert len(eng) == 8
    assert c["prefill_tokens"].tolist() == [600] + [0] * 7
    assert c["decode_seqs"].tolist() == [0] + [3] * 7
    assert c["context_tokens"].tolist() == [600] + [600 + 3 * k for k in range(7)]
    assert c["prefill_pairs"][0] == sum(n * n / 2 for n in (100, 200, 300))
    assert c["draft_tokens"].sum() == 0 and c["requests"].tolist() == [3] * 8
    assert c["busy_before"].tolist() == [0] + [1] * 7
    assert (c["t_end"] > c["t_start"]).all() and (np.diff(c["t_end"]) > 0).all()


def test_recording_is_off_without_the_variable(monkeypatch):
    from war_openrlhf.engine import step_record

    monkeypatch.delenv(step_record.ENV, raising=False)
    assert step_record.install() is False


def test_malformed_records_are_named_by_file_and_line(tmp_path):
    with pytest.raises(ValueError, match="no steps-"):
        read_step_records(tmp_path)
    bad = tmp_path / "steps-h-1.csv"
    bad.write_text("# {}\n" + ",".join(FIELDS) + "\n" + ",".join(["1"] * len(FIELDS)) + "\n1,2\n")
    with pytest.raises(ValueError, match=r"steps-h-1.csv: line 4: 2 fields"):
        read_step_records(tmp_path)
    bad.write_text("# {nope\n" + ",".join(FIELDS) + "\n")
    with pytest.raises(ValueError, match=r"steps-h-1.csv: line 1: header is not JSON"):
        read_step_records(tmp_path)


_TRUE = CostModel(name="truth", step_overhead_s=2e-3, decode_per_seq_s=80e-6, kv_read_per_token_s=60e-9,
                  prefill_per_token_s=15e-6, prefill_attn_per_pair_s=1e-10, spec_step_s=0.4e-3,
                  draft_token_s=30e-6, draft_context_token_s=20e-9, kv_capacity_tokens=65536, max_num_seqs=64,
                  max_num_batched_tokens=4096, block_size=128)


def _work(rng, drafting: bool) -> list[float]:
    if rng.random() < 0.15:  # a prefill step
        p = float(rng.integers(200, 4000))
        done = float(rng.integers(0, 8000))
        return [0, done + p, p, p * (done + p / 2), 0, 0]
    b = int(rng.integers(1, 16))
    ctx = float(b * rng.integers(500, 12000))
    d = float(b * rng.integers(1, 5)) if drafting and rng.random() < 0.7 else 0.0
    return [b, ctx, 0, 0.0, d, d * ctx / b]


def _cost(w: list[float], model: CostModel) -> float:
    dec, ctx, pre, pairs, d, dctx = w
    s = model.step_time(int(dec), ctx, pre, pairs)
    if d:
        s += model.spec_step_s + model.draft_token_s * d + model.draft_context_token_s * dctx
    return s


def _synthetic_run(model: CostModel, contention: float, rng, kind: str = "speculative") -> list[EngineSteps]:
    """Two engines: phases where both step in lockstep (each step stretched by ``contention``)
    and phases where one steps alone, with idle gaps between phases."""
    rows = {0: [], 1: []}
    t = 0.0
    for phase in range(60):
        together, solo = phase % 3 == 0, phase % 2
        t += 0.5  # an idle gap: the next step starts afresh
        for k in range(int(rng.integers(20, 60))):
            w = _work(rng, drafting=kind == "speculative")
            dur = _cost(w, model) * (contention if together else 1.0)
            for e in ((0, 1) if together else (solo,)):
                rows[e].append([t, t + dur, 1.0 if k else 0.0, *w, 4.0])
            t += dur
    header = {"engine_kind": kind, "kv_capacity_tokens": model.kv_capacity_tokens, "max_num_seqs": model.max_num_seqs,
              "max_num_batched_tokens": model.max_num_batched_tokens, "block_size": model.block_size}
    out = []
    for e in (0, 1):
        a = np.array(rows[e], dtype=np.float64)
        cols = {f: a[:, j] for j, f in enumerate(("t_start", "t_end", "busy_before", "decode_seqs", "context_tokens",
                                                   "prefill_tokens", "prefill_pairs", "draft_tokens",
                                                   "draft_context_tokens", "requests"))}
        out.append(EngineSteps(Path(f"steps-{e}.csv"), dict(header), cols))
    return out


def test_the_busy_share_of_the_other_engine_is_exact_on_lockstep_and_solo_phases():
    run = _synthetic_run(_TRUE, 1.5, np.random.default_rng(0))
    t = step_table(run, engines_per_run=2)
    # lockstep steps: the other engine busy all the time; solo steps: never
    together = np.isin(t["t_start"], run[0].columns["t_start"]) & np.isin(t["t_start"], run[1].columns["t_start"])
    assert np.allclose(t["other_busy"][together], 1.0) and np.allclose(t["other_busy"][~together], 0.0)
    assert np.allclose(t["seconds"], t["t_end"] - t["t_start"])


@pytest.mark.parametrize("contention", [1.0, 1.4])
def test_the_fit_recovers_the_costs_and_contention_that_made_the_steps(contention):
    model, report = fit_rollout_steps([_synthetic_run(_TRUE, contention, np.random.default_rng(1))],
                                      kind="speculative", engines_per_run=2, name="fit")
    assert report["drafting_steps"] > 100 and report["drafting"] is not None
    assert model.contention == pytest.approx(contention, abs=0.021)
    for f in ("step_overhead_s", "decode_per_seq_s", "kv_read_per_token_s", "prefill_per_token_s",
              "spec_step_s", "draft_token_s", "draft_context_token_s"):
        assert getattr(model, f) == pytest.approx(getattr(_TRUE, f), rel=0.1), f
    assert (model.kv_capacity_tokens, model.block_size) == (65536, 128)


def test_the_fit_takes_only_the_engines_of_the_kind_asked_for():
    rng = np.random.default_rng(2)
    slow = _TRUE.with_overrides(step_overhead_s=8e-3)
    run = _synthetic_run(_TRUE, 1.0, rng, kind="plain") + _synthetic_run(slow, 1.0, rng, kind="speculative")
    plain, _ = fit_rollout_steps([run], kind="plain", engines_per_run=2, name="p")
    spec, _ = fit_rollout_steps([run], kind="speculative", engines_per_run=2, name="s")
    assert plain.step_overhead_s == pytest.approx(2e-3, rel=0.1)
    assert spec.step_overhead_s == pytest.approx(8e-3, rel=0.1)
    with pytest.raises(ValueError, match="no plain engine"):
        fit_rollout_steps([run[2:]], kind="plain", engines_per_run=2, name="p")


def test_the_fit_prices_each_drafter_apart():
    """WAR's drafting engines and vLLM's suffix engines are both speculative; a fit by drafter
    takes only its own engines, and records that do not name their drafter are refused by name."""
    rng = np.random.default_rng(5)
    suffix_model = _TRUE.with_overrides(spec_step_s=4e-3, step_overhead_s=3e-3)
    war = _synthetic_run(_TRUE, 1.0, rng)
    suffix = _synthetic_run(suffix_model, 1.0, rng)
    for e in war:
        e.header["drafter"] = "war_index"
    for e in suffix:
        e.header["drafter"] = "vllm_suffix"
    run = war + suffix
    w, _ = fit_rollout_steps([run], kind="war_index", engines_per_run=2, name="w")
    v, rep = fit_rollout_steps([run], kind="vllm_suffix", engines_per_run=2, name="v")
    assert rep["engines"] == 2
    assert w.spec_step_s == pytest.approx(_TRUE.spec_step_s, rel=0.1)
    assert v.spec_step_s == pytest.approx(4e-3, rel=0.1) and v.step_overhead_s == pytest.approx(3e-3, rel=0.1)
    for e in run:
        del e.header["drafter"]
    with pytest.raises(ValueError, match="before records named their drafter"):
        fit_rollout_steps([run], kind="vllm_suffix", engines_per_run=2, name="v")


def test_the_drafter_is_read_from_the_engines_config():
    from types import SimpleNamespace as NS

    from war_openrlhf.engine.drafting import drafting_for
    from war_openrlhf.engine.step_record import drafter_of

    def config(speculation: str, openrlhf: bool = False):
        kw = drafting_for(speculation).engine_kwargs(8, 24, openrlhf_worker=openrlhf)
        spec = kw.get("speculative_config")
        return NS(speculative_config=None if spec is None else NS(method=spec["method"]),
                  parallel_config=NS(worker_extension_cls=kw.get("worker_extension_cls", "")))

    assert drafter_of(config("auto")) == drafter_of(config("off", openrlhf=True)) == "war_index"
    assert drafter_of(config("vllm_suffix")) == drafter_of(config("vllm_suffix", openrlhf=True)) == "vllm_suffix"
    assert drafter_of(config("none")) is None


def test_war_train_forwards_the_record_directory_to_every_ray_worker(monkeypatch):
    from war_openrlhf.cli.train_ppo import _ray_env
    from war_openrlhf.engine.step_record import ENV

    monkeypatch.setenv(ENV, "/tmp/steps")
    assert _ray_env()[ENV] == "/tmp/steps"
    monkeypatch.delenv(ENV)
    assert ENV not in _ray_env()


def test_a_busy_step_lasts_from_the_previous_steps_end_and_an_idle_one_from_its_own_start():
    """While requests remain, the engine loop's own time between two steps (scheduling, inputs)
    belongs to the next step; after an idle gap only the step's own span counts."""
    from war_openrlhf.simulation.fit_steps import _periods

    cols = {"t_start": np.array([0.0, 1.3, 5.0, 5.25]), "t_end": np.array([1.0, 2.0, 5.2, 5.5]),
            "busy_before": np.array([0.0, 1.0, 0.0, 1.0])}
    assert np.allclose(_periods(cols), [1.0, 1.0, 0.2, 0.3])


def test_steps_longer_than_the_bound_are_left_out_of_the_fit():
    rng = np.random.default_rng(3)
    run = _synthetic_run(_TRUE, 1.0, rng)
    clean, clean_report = fit_rollout_steps([run], kind="speculative", engines_per_run=2, name="c")
    cols = run[0].columns
    last = max(float(e.columns["t_end"].max()) for e in run)
    row = {f: v[-1] for f, v in cols.items()}  # the last step's work again, after an idle gap, stalled a minute
    row.update(t_start=last + 1.0, t_end=last + 61.0, busy_before=0.0)
    for f in cols:
        cols[f] = np.append(cols[f], row[f])
    model, report = fit_rollout_steps([run], kind="speculative", engines_per_run=2, name="s")
    assert report["steps_dropped"] == clean_report["steps_dropped"] + 1
    assert model.step_overhead_s == pytest.approx(clean.step_overhead_s, rel=0.05)


def test_an_engines_start_up_step_is_left_out_of_the_fit():
    """An engine's first step pays its start-up (seconds for a few hundred tokens on CPU); a
    rollout never repeats it, so the fit must not price it."""
    rng = np.random.default_rng(6)
    run = _synthetic_run(_TRUE, 1.0, rng)
    clean, clean_report = fit_rollout_steps([run], kind="speculative", engines_per_run=2, name="c")
    for e in run:
        e.columns["t_end"][0] = e.columns["t_start"][0] + 3.0  # the first step: 3 s
        later = e.columns["t_start"] > e.columns["t_start"][0]
        for f in ("t_start", "t_end"):
            e.columns[f][later] += 3.0
    model, report = fit_rollout_steps([run], kind="speculative", engines_per_run=2, name="s")
    assert report["steps_dropped"] == clean_report["steps_dropped"] == 2  # each engine's first step
    assert model.step_overhead_s == pytest.approx(clean.step_overhead_s, rel=0.05)
    assert model.prefill_per_token_s == pytest.approx(clean.prefill_per_token_s, rel=0.05)


def test_a_header_without_the_engine_limits_is_named():
    run = _synthetic_run(_TRUE, 1.0, np.random.default_rng(4))
    for e in run:
        del e.header["block_size"]
    with pytest.raises(ValueError, match=r"steps-\d\.csv: line 1: the header lacks an engine limit"):
        fit_rollout_steps([run], kind="speculative", engines_per_run=2, name="x")
