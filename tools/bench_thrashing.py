"""KV thrashing benchmark (simulated cluster): engines that keep less KV than they report.

    python tools/bench_thrashing.py --traces ../shared/traces/tau_airline_dev.json \
        --split validation --json benchmarks/results/dispatch/thrashing.json \
        --plot docs/img/thrashing.png

Why: a router that pins trajectories to an engine (sticky, verl's and Dynamo's cache scores)
keeps feeding a saturated engine, whose LRU then evicts every parked trajectory before it
returns; WAR's admission budget avoids that when the engines' KV reports are right. When
they are not -- another tenant's requests on the engines, blocks a report counts that the
prefix cache cannot keep -- only a measurement can tell: WAR compares what its block model
said each returning turn would find cached with what the engine reports it found
(``thrash_bound``), and shrinks its model of a thrashing engine's KV.

Regime: the tau trace file's ``--split`` half (tasks replicated as in ``bench_dispatch``), a
warm-up step then the measured step, ``--engines`` engines at ``--per-engine`` trajectories
each, KV per engine = the measured step's live context per engine / ``--pressure``, fast tools
(0.1 s + 0.1 ms per environment token, jitter 0.5). For every ``--reported-kv-scale`` (the
engines report that multiple of the KV they really keep; 1 = the truth) and every seed (tool
delay draws), the policies run on the same trajectories and delays in turn: sticky,
verl_kv_aware, dynamo_kv, war (its defaults: no thrashing verdict) and war with
``thrash_bound: 0.3`` (``war_thrash_verdict``). Reports each one's step (makespan), prefix hit rate, evicted blocks and WAR's
verdicts; the median over seeds with the spread.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_dispatch import TOOL_SPEEDS, suite_trajectories  # noqa: E402

from war_openrlhf.metrics import spread, write_json  # noqa: E402
from war_openrlhf.simulation.cluster import SimConfig, prepare_trajectories, simulate  # noqa: E402
from war_openrlhf.simulation.cost_model import get_preset  # noqa: E402
from war_openrlhf.traces import group_trajectories, load_chat_traces, tokenize_traces  # noqa: E402

CONFIGS = {  # name -> (policy, kwargs)
    "sticky": ("sticky", {}),
    "verl_kv_aware": ("verl_kv_aware", {}),
    "dynamo_kv": ("dynamo_kv", {}),
    "war": ("war", {}),
    "war_thrash_verdict": ("war", {"thrash_bound": 0.3}),
}


def regime(base, split: str, engines: int, per_engine: int, pressure: float, preset: str):
    """(warm-up + measured trajectories, KV capacity per engine, workload description)."""
    probe, _ = suite_trajectories("tau", split, base, 1)
    group_size = max(len(g) for g in group_trajectories(probe).values())
    n_groups = max(1, math.ceil(per_engine * engines / group_size))
    trajs, _ = suite_trajectories("tau", split, base, n_groups)
    groups = list(group_trajectories(trajs).values())
    measured = [t for g in groups[len(groups) // 2:] for t in g]
    footprint = sum(len(t.turns[-1].context_token_ids) + len(t.turns[-1].response_token_ids)
                    for t in measured)
    longest = max(len(x.context_token_ids) + len(x.response_token_ids) for t in trajs for x in t.turns)
    bs = get_preset(preset).block_size
    cap = max(int(footprint / engines / pressure) // bs * bs, -(-longest // bs) * bs)
    info = {"source": "tau", "split": split, "engines": engines, "pressure": pressure,
            "trajectories": len(measured), "warmup_trajectories": len(trajs) - len(measured),
            "group_size": group_size, "kv_capacity_tokens_per_engine": cap,
            "per_engine_live_over_kv": footprint / engines / cap, "tools": "fast",
            "tool_delay_s": TOOL_SPEEDS["fast"][0], "per_env_token_s": TOOL_SPEEDS["fast"][1]}
    return trajs, cap, info


def run(args) -> dict:
    from tqdm import tqdm

    base = tokenize_traces(load_chat_traces(args.traces))
    trajs, cap, info = regime(base, args.split, args.engines, args.per_engine, args.pressure, args.preset)
    prepared = prepare_trajectories(trajs)
    scales = [float(x) for x in args.reported_kv_scale.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    tool_s, env_s, _ = TOOL_SPEEDS["fast"]
    runs = []
    bar = tqdm(total=len(scales) * len(seeds) * len(CONFIGS), desc="simulations", disable=args.quiet)
    for scale in scales:
        for seed in seeds:
            cfg = SimConfig(num_engines=args.engines, preset=args.preset, kv_capacity_tokens=cap,
                            tool_delay_s=tool_s, per_env_token_s=env_s, delay_jitter=0.5, seed=seed,
                            steps=2, warmup_steps=1, reported_kv_scale=scale)
            for name, (pol, kw) in CONFIGS.items():
                d = simulate(prepared, pol, cfg, **kw).to_dict()
                pm = d["policy_metrics"]
                runs.append({"config": name, "reported_kv_scale": scale, "seed": seed,
                             "makespan_s": d["makespan_s"], "hit_rate": d["hit_rate"],
                             "oracle_hit_rate": d["oracle_hit_rate"], "evicted_blocks": d["evicted_blocks"],
                             "deferrals": d["deferrals"], "engine_changes": d["engine_changes"],
                             "thrash_verdicts": pm.get("thrash_verdicts"), "kv_scale_min": pm.get("kv_scale_min"),
                             "reuse_loss": pm.get("reuse_loss")})
                bar.update(1)
    bar.close()
    summary = {}
    for scale in scales:
        rows = {}
        for name in CONFIGS:
            rs = [r for r in runs if r["config"] == name and r["reported_kv_scale"] == scale]
            rows[name] = {m: spread([r[m] for r in rs]) for m in ("makespan_s", "hit_rate", "evicted_blocks")}
            if CONFIGS[name][0] == "war":
                rows[name]["thrash_verdicts"] = spread([r["thrash_verdicts"] for r in rs])
                rows[name]["kv_scale_min"] = spread([r["kv_scale_min"] for r in rs])
        best = min((n for n in CONFIGS if CONFIGS[n][0] != "war"), key=lambda n: rows[n]["makespan_s"]["median"])
        for name in CONFIGS:
            rows[name]["x_sticky"] = rows["sticky"]["makespan_s"]["median"] / rows[name]["makespan_s"]["median"]
        rows["war"]["x_best_other"] = rows[best]["makespan_s"]["median"] / rows["war"]["makespan_s"]["median"]
        rows["war"]["best_other"] = best
        summary[f"{scale:g}"] = rows
    return {"benchmark": "thrashing", "timed": False, "workload": info, "preset": args.preset,
            "reported_kv_scales": scales, "seeds": seeds, "configs": list(CONFIGS), "summary": summary,
            "runs": runs}


def table(d: dict) -> str:
    w = d["workload"]
    lines = [f"tau {w['split']} half, {w['engines']} engines x {w['trajectories'] // w['engines']} "
             f"trajectories, KV pressure {w['pressure']:g} ({w['kv_capacity_tokens_per_engine']} tokens per "
             f"engine), fast tools; median of {len(d['seeds'])} seeds (min-max)",
             "| reported KV / real | config | step s | x sticky | prefix hit | evicted blocks | WAR verdicts |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for scale, rows in d["summary"].items():
        for name, r in rows.items():
            m = r["makespan_s"]
            verdicts = f"{r['thrash_verdicts']['median']:.0f}" if "thrash_verdicts" in r else ""
            lines.append(f"| {scale} | {name} | {m['median']:.1f} ({m['min']:.1f}-{m['max']:.1f}) | "
                         f"{r['x_sticky']:.2f} | {r['hit_rate']['median']:.3f} | "
                         f"{r['evicted_blocks']['median']:.0f} | {verdicts} |")
    return "\n".join(lines)


def plot(d: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scales = list(d["summary"])
    names = d["configs"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        med = [d["summary"][s][name]["makespan_s"]["median"] for s in scales]
        lo = [m - d["summary"][s][name]["makespan_s"]["min"] for m, s in zip(med, scales)]
        hi = [d["summary"][s][name]["makespan_s"]["max"] - m for m, s in zip(med, scales)]
        ax.bar(np.arange(len(scales)) + i * width, med, width, yerr=[lo, hi], label=name, capsize=2)
    ax.set_xticks(np.arange(len(scales)) + 0.4 - width / 2)
    ax.set_xticklabels([f"reported KV = {s} x real" for s in scales])
    ax.set_ylabel("simulated step (s)")
    w = d["workload"]
    ax.set_title(f"tau {w['split']}, {w['engines']} engines, pressure {w['pressure']:g}, fast tools")
    ax.legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", required=True, help="tau-bench trace file (OpenAI chat format)")
    ap.add_argument("--split", choices=["tuning", "validation"], default="validation")
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--per-engine", type=int, default=32, help="trajectories per engine")
    ap.add_argument("--pressure", type=float, default=4.0)
    ap.add_argument("--reported-kv-scale", default="1,2,4",
                    help="comma-separated multiples of the real KV that the engines report")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--preset", default="h100_qwen7b")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    d = run(args)
    print(table(d))
    out = write_json(args.json, d)
    if out:
        print(f"wrote {out}")
    if args.plot:
        plot(d, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
