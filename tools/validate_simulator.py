#!/usr/bin/env python
"""The simulator against real engines: every committed real-engine rollout result beside the
simulator's prediction of the same run, in one file that war-predict reads.

    python tools/validate_simulator.py --cost-models benchmarks/results/engine/cost_serving_cpu_peaked.json \\
        benchmarks/results/engine/cost_serving_cpu_policy.json --json benchmarks/results/simulator/validation.json

For each ``bench_rollout`` result under ``benchmarks/results/rollout/`` (or the files given), the
cost model is the one fitted to the run's model (``--cost-models``: files written by
``tools/fit_serving_costs.py`` or ``bench_engine.py --fit-costs``, matched by the model directory's
name; a fit of plain engines, ``fit_serving_costs.py --engine-kind plain`` or ``fit_rollout_costs.py
--kind plain``, prices the configurations that ran on plain engines, OpenRLHF's own, and a fit of
vLLM's suffix engines, ``fit_rollout_costs.py --kind vllm_suffix``, ``openrlhf_vllm_suffix``:
``bench_rollout.engine_kind``). A trace
run is re-simulated: every measured configuration with the run's trajectories,
tool delays, KV and the configuration's measured speculation (tokens per verification step,
acceptance, speculating fraction); the step time and the gain over ``openrlhf`` it predicts are
set beside the measured ones. A task run replays episodes it recorded in the run; one whose
file keeps them (``replayed_rows``) is re-simulated the same way, an older one is represented
by the prediction ``bench_rollout --cost-model`` made in the run (used when made with the same
cost model), else it is listed as skipped, with the reason. Configurations
the simulator has no model of are listed per run (``war_longest_first`` is modelled: vLLM's
priority scheduling, the predictor fitted on the tasks the run does not replay, as the run's was).

The errors are reported two ways: of the gain over OpenRLHF's path (what war-predict's table
says, ``simulated x / measured x - 1``) and of the absolute step time. The worst of the gain's
is ``worst_abs_error``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

DEFAULT_RESULTS = ROOT / "benchmarks" / "results" / "rollout"


def regime_name(d: dict) -> str:
    """A run's regime in words: workload, split, engines, KV, load."""
    kv = f"KV pressure {d['pressure']:g}" if d.get("pressure") else (
        f"{d['kv_tokens_per_engine']} KV tokens/engine" if d.get("kv_tokens_per_engine") else "ample KV")
    workload = d.get("workload", "?").split("/")[-1]
    split = f" ({d['split']} half)" if d.get("split") else ""
    load = (d.get("regime") or {}).get("load")
    return f"{workload}{split}, {d.get('engines')} engines, {load or '?'} load, {kv}"


def compare(d: dict, sim: dict) -> list[dict]:
    """Measured vs simulated, per configuration of one run."""
    rows = []
    for name, v in sim.items():
        m = d["configs"][name]
        x_meas, x_sim = m.get("x_openrlhf"), v["x_openrlhf"]
        runs = m.get("step_s_runs") or [m["step_s"]]
        rows.append({
            "config": name, "measured_step_s": round(m["step_s"], 3), "simulated_step_s": v["step_s"],
            "measured_step_range": [round(min(runs), 3), round(max(runs), 3)],
            "within_measured_range": min(runs) <= v["step_s"] <= max(runs),
            "step_error": round(v["step_s"] / m["step_s"] - 1.0, 4),
            "measured_x_openrlhf": None if x_meas is None else round(x_meas, 4), "simulated_x_openrlhf": x_sim,
            "gain_error": None if not x_meas or x_sim is None else round(x_sim / x_meas - 1.0, 4),
        })
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="*", type=Path,
                    help=f"bench_rollout result files (default: every file in {DEFAULT_RESULTS.relative_to(ROOT)})")
    ap.add_argument("--cost-models", nargs="+", required=True, type=Path,
                    help="cost models fitted on the machine of the runs, one per model (tools/fit_serving_costs.py)")
    ap.add_argument("--traces-root", type=Path, default=ROOT,
                    help="directory the runs' relative trace paths are resolved from (default: the repository root, "
                         "where bench_rollout runs)")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args(argv)
    from resimulate_rollout import resimulate, unmodelled_configs
    from tqdm import tqdm

    from war_openrlhf.metrics import read_json, write_json

    costs, plain_costs, suffix_costs = {}, {}, {}
    for path in args.cost_models:
        doc = read_json(path)
        model = doc.get("model")
        if not model:
            raise SystemExit(f"{path}: not a fitted cost model (no 'model' field)")
        kind = doc.get("engine_kind", "speculative")
        {"plain": plain_costs, "vllm_suffix": suffix_costs}.get(kind, costs)[Path(model).name] = _rel(path)
    files = args.results or sorted(DEFAULT_RESULTS.glob("*.json*"))
    runs, skipped = [], []
    for path in tqdm(files, desc="re-simulating runs", unit="run"):
        d = read_json(path)
        if d.get("benchmark") != "rollout":
            skipped.append({"file": _rel(path), "reason": f"not a bench_rollout result ({d.get('benchmark')!r})"})
            continue
        cost = costs.get(Path(d.get("model", "")).name)
        if cost is None:
            skipped.append({"file": _rel(path), "reason": f"no cost model fitted to its model {d.get('model')!r}"})
            continue
        plain = plain_costs.get(Path(d.get("model", "")).name)
        suffix = suffix_costs.get(Path(d.get("model", "")).name)
        if (d.get("workload") or "").startswith("traces:") or d.get("replayed_rows"):
            sim, source = resimulate(d, str(ROOT / cost), args.traces_root,
                                     None if plain is None else str(ROOT / plain),
                                     None if suffix is None else str(ROOT / suffix)), "re-simulated"
        elif d.get("cost_model") and Path(d["cost_model"]).name == Path(cost).name:
            plain, suffix = d.get("plain_cost_model"), d.get("suffix_cost_model")  # the run's own
            sim, source = {c: {"step_s": v["simulated_step_s"], "x_openrlhf": v["simulated_x_openrlhf"]}
                           for c, v in d["configs"].items() if "simulated_step_s" in v}, "simulated in the run"
        else:
            skipped.append({"file": _rel(path), "reason": f"workload {d.get('workload')!r} keeps no trajectories "
                            "and the run made no prediction with this cost model (bench_rollout --cost-model)"})
            continue
        runs.append({"file": _rel(path), "regime": regime_name(d), "load": (d.get("regime") or {}).get("load"),
                     "pressure": d.get("pressure"), "commit": (d.get("git") or {}).get("commit"),
                     "written_at": d.get("written_at"), "cost_model": cost,
                     "plain_cost_model": plain, "suffix_cost_model": suffix, "prediction": source,
                     "rows": compare(d, sim), "not_modelled": unmodelled_configs(d)})
    rows = [r for run in runs for r in run["rows"]]
    gain = [abs(r["gain_error"]) for r in rows if r["gain_error"] is not None and r["config"] != "openrlhf"]
    step = [abs(r["step_error"]) for r in rows]
    out = write_json(args.json, {
        "benchmark": "simulator_validation", "cost_models": sorted(costs.values()),
        "plain_cost_models": sorted(plain_costs.values()), "suffix_cost_models": sorted(suffix_costs.values()),
        "runs": runs, "skipped": skipped,
        "comparisons": len(gain), "worst_abs_error": max(gain) if gain else None,
        "worst_abs_step_error": max(step) if step else None,
        "target_abs_error": 0.15,
    })
    for run in runs:
        print(f"\n{run['file']}: {run['regime']} ({run['prediction']}, {run['cost_model']})")
        for r in run["rows"]:
            print(f"  {r['config']:<22} step {r['measured_step_s']:7.2f} s measured, {r['simulated_step_s']:7.2f} s "
                  f"simulated ({r['step_error']:+.0%}); x openrlhf {r['measured_x_openrlhf']} vs "
                  f"{r['simulated_x_openrlhf']}" + ("" if r["gain_error"] is None else f" ({r['gain_error']:+.0%})"))
        for name in run["not_modelled"]:
            print(f"  {name:<22} not modelled by the simulator")
    for s in skipped:
        print(f"skipped {s['file']}: {s['reason']}")
    if gain:
        print(f"\nworst |simulated / measured - 1|: gain {max(gain):.1%}, step time {max(step):.1%} "
              f"over {len(gain)} comparisons")
    print(f"wrote {out}")
    return 0


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


if __name__ == "__main__":
    sys.exit(main())
