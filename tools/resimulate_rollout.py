#!/usr/bin/env python
"""Re-run the simulator on a finished ``bench_rollout.py`` trace benchmark with another cost
model: the same trajectories, delays, KV and measured speculation as the run, no engines.
Writes the run's JSON again with ``simulated`` (and the per-config columns) replaced and the
re-simulation's command, commit and machine under ``resimulation``.

    python tools/resimulate_rollout.py results/bench_rollout_traces_report_p2_sim.json \\
        --cost-model results/cost_cpu_peaked.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))


def run_model_dir(d: dict) -> Path:
    """The run's model directory (its tokenizer cuts the replayed turns): the path the file records,
    else the same local model under this checkout's ``.cache`` (a run written from another
    checkout or a removed worktree); a ValueError names the field when neither exists."""
    recorded = Path(d["model"])
    for path in (recorded, ROOT / ".cache" / recorded.name):
        if (path / "config.json").is_file():
            return path
    raise ValueError(f"model: {d['model']!r} (the run's model directory) is not there, nor "
                     f"{ROOT / '.cache' / recorded.name}; build it as the run did (bench_rollout --model)")


def resimulate(d: dict, cost_model: str, traces_root: Path | None = None,
               plain_cost_model: str | None = None, suffix_cost_model: str | None = None) -> dict:
    """The simulator's step and gain over ``openrlhf`` for every configuration of a finished
    ``bench_rollout`` trace run ``d``: the run's trajectories, tool delays, KV and measured
    speculation, ``cost_model``'s engines (``plain_cost_model``'s / ``suffix_cost_model``'s for the
    configurations that ran on plain engines / vLLM's suffix engines, when given). A task run whose
    file keeps its replayed episodes (``replayed_rows``) is re-simulated from them; ValueError for
    another run that is not a trace workload."""
    import bench_rollout as br
    from transformers import AutoTokenizer

    workload = d.get("workload") or ""
    ta = d.get("trace_args")
    if d.get("replayed_rows"):  # a task workload's recorded episodes, kept in the run's file
        rows, seed = d["replayed_rows"], (ta or {}).get("seed", 0)
    else:
        if not workload.startswith("traces:"):
            raise ValueError(f"workload {workload!r} is not a trace workload and its file keeps no replayed episodes "
                             "(task runs keep them since bench_rollout recorded 'replayed_rows')")
        if traces_root is not None:
            workload = "traces:" + str(traces_root / workload.split(":", 1)[1])
        if ta is None:  # a run written before bench_rollout recorded them: its command line has them
            cmd = d["command"].split()
            opt = {k: cmd[i + 1] for i, k in enumerate(cmd[:-1]) if k.startswith("--")}
            ta = {"max_groups": int(opt.get("--max-groups", 0)) or None, "seed": int(opt.get("--seed", 0)),
                  "tool_latency": float(opt.get("--tool-latency", 0.05)),
                  "tool_jitter": float(opt.get("--tool-jitter", 0.5)),
                  "per_env_token": float(opt.get("--per-env-token", 0.0))}
        rows, _ = br.load_traces(workload, d["split"], ta["max_groups"], ta["seed"], ta["tool_latency"],
                                 ta["tool_jitter"], ta["per_env_token"], ta.get("skip_groups", 0))
        seed = ta["seed"]
        if any(name in br.PRIORITY_CONFIGS for name in d["configs"]):  # the predictor, fitted as the run's was
            br.seed_priorities(workload, d["split"], seed)
    tok = AutoTokenizer.from_pretrained(str(run_model_dir(d)))
    modelled = {name: v for name, v in d["configs"].items() if name in br.SIM_POLICIES}
    return br.simulate_configs(br.replay_trajectories(rows, tok, d["n_samples"], seed),
                               cost_model, d["engines"], d["kv_tokens_per_engine"], modelled, plain_cost_model,
                               bool(d.get("same_engines")), d.get("war_engines", "auto"), suffix_cost_model)


def unmodelled_configs(d: dict) -> list[str]:
    """Configurations of run ``d`` the simulator has no model of."""
    import bench_rollout as br

    return [name for name in d["configs"] if name not in br.SIM_POLICIES]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", type=Path)
    ap.add_argument("--cost-model", required=True)
    ap.add_argument("--plain-cost-model", default=None,
                    help="the cost model of plain engines, for the configurations that ran on them")
    ap.add_argument("--suffix-cost-model", default=None,
                    help="the cost model of vLLM's suffix engines, for openrlhf_vllm_suffix")
    ap.add_argument("--traces-root", type=Path, default=None,
                    help="directory the run's relative traces path is resolved from (default: the current one)")
    args = ap.parse_args(argv)
    from war_openrlhf.metrics import provenance, read_json, write_json

    d = read_json(args.json)
    try:
        sim = resimulate(d, args.cost_model, args.traces_root, args.plain_cost_model, args.suffix_cost_model)
    except ValueError as exc:
        raise SystemExit(f"{args.json}: {exc}")
    d["simulated"] = {c: v["x_openrlhf"] for c, v in sim.items()}
    d["cost_model"] = args.cost_model
    d["plain_cost_model"] = args.plain_cost_model
    d["suffix_cost_model"] = args.suffix_cost_model
    print("| config | measured x openrlhf | simulated x openrlhf | simulated / measured | simulated step s |")
    print("|---|---:|---:|---:|---:|")
    for c, v in sim.items():
        s = d["configs"][c]
        s["simulated_step_s"], s["simulated_x_openrlhf"] = v["step_s"], v["x_openrlhf"]
        s["simulated_over_measured"] = round(v["x_openrlhf"] / s["x_openrlhf"], 3) if s.get("x_openrlhf") else None
        print(f"| {c} | {s['x_openrlhf']:.2f} | {v['x_openrlhf']:.2f} | {s['simulated_over_measured']:.3f} | "
              f"{v['step_s']:.1f} |")
    # the run's own provenance stays; the re-simulation's is recorded beside it
    d["resimulation"] = {"cost_model": args.cost_model, "plain_cost_model": args.plain_cost_model,
                         "suffix_cost_model": args.suffix_cost_model, **provenance()}
    write_json(args.json, d, stamp=False)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
