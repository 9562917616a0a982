"""Admission order benchmark (simulated cluster): deferred trajectories longest-predicted first.

    python tools/bench_admission_order.py --traces ../shared/traces/tau_airline_dev.json \
        --split validation --json benchmarks/results/dispatch/admission_order.json

Why: WAR defers new trajectories while the engines' KV is short and offers them again as room
frees. In arrival order (``fifo``) the step's longest trajectory may start last and end the
step alone (the dispatch suite's worst cell: the straggler waited 29 s for admission).
``admission_order: longest_first`` offers first the one its GRPO siblings predict longest
(``dispatch/remaining_work.py``; Seer, arXiv 2511.14617, runs a group's longest first).

Regimes: the tau trace file's ``--split`` half (tasks replicated as in ``bench_dispatch``), a
warm-up step (the previous RL step, from which the predictor is fitted) then the measured step,
``--engines`` engines x ``--per-engine`` trajectories, KV per engine = the measured step's live
context per engine / pressure, for every pressure of ``--pressures`` and tool speed of
``--tools`` (fast: 0.1 s + 0.1 ms per environment token; slow: 1 s + 1 ms; jitter 0.5). In
each, for every seed (tool delay draws), the routers and both admission orders run on the same
trajectories and delays: sticky, verl_kv_aware, dynamo_kv, war (fifo) and
``war_longest_first`` (``admission_order: longest_first``). Reports the step (makespan), its
tail share (time after 90% of trajectories ended), the last trajectory's admission wait and the
deferrals; median over seeds with the spread.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_dispatch import TOOL_SPEEDS  # noqa: E402
from bench_thrashing import regime  # noqa: E402

from war_openrlhf.metrics import spread, write_json  # noqa: E402
from war_openrlhf.simulation.cluster import SimConfig, prepare_trajectories, simulate  # noqa: E402
from war_openrlhf.traces import load_chat_traces, tokenize_traces  # noqa: E402

ROUTERS = ("sticky", "verl_kv_aware", "dynamo_kv")
CONFIGS = {  # name -> (policy, kwargs)
    **{r: (r, {}) for r in ROUTERS},
    "war": ("war", {}),
    "war_longest_first": ("war", {"admission_order": "longest_first"}),
}
METRICS = ("makespan_s", "tail10_share", "last_admission_wait_s", "deferrals")


def run(args) -> dict:
    from tqdm import tqdm

    base = tokenize_traces(load_chat_traces(args.traces))
    pressures = [float(x) for x in args.pressures.split(",")]
    tools = args.tools.split(",")
    seeds = [int(x) for x in args.seeds.split(",")]
    cells, runs = [], []
    bar = tqdm(total=len(pressures) * len(tools) * len(seeds) * len(CONFIGS), desc="simulations",
               disable=args.quiet)
    for pressure in pressures:
        trajs, cap, info = regime(base, args.split, args.engines, args.per_engine, pressure, args.preset)
        prepared = prepare_trajectories(trajs)
        for speed in tools:
            tool_s, env_s, _ = TOOL_SPEEDS[speed]
            cell = dict(info, tools=speed, tool_delay_s=tool_s, per_env_token_s=env_s)
            rows = {}
            for seed in seeds:
                cfg = SimConfig(num_engines=args.engines, preset=args.preset, kv_capacity_tokens=cap,
                                tool_delay_s=tool_s, per_env_token_s=env_s, delay_jitter=0.5, seed=seed,
                                steps=2, warmup_steps=1)
                for name, (pol, kw) in CONFIGS.items():
                    d = simulate(prepared, pol, cfg, **kw).to_dict()
                    crit = d["critical_paths"][-1]
                    r = {"config": name, "pressure": pressure, "tools": speed, "seed": seed,
                         "makespan_s": d["makespan_s"], "tail10_share": crit.get("tail10_share"),
                         "last_admission_wait_s": crit.get("admission_wait_s", 0.0),
                         "last_trajectory": crit.get("trajectory"), "deferrals": d["deferrals"],
                         "hit_rate": d["hit_rate"]}
                    runs.append(r)
                    rows.setdefault(name, []).append(r)
                    bar.update(1)
            summary = {name: {m: spread([x[m] for x in rs]) for m in METRICS} for name, rs in rows.items()}
            best = min(ROUTERS, key=lambda n: summary[n]["makespan_s"]["median"])
            for name in CONFIGS:
                summary[name]["x_best_router"] = (summary[best]["makespan_s"]["median"]
                                                  / summary[name]["makespan_s"]["median"])
            cells.append({"workload": cell, "best_router": best, "summary": summary})
    bar.close()
    return {"benchmark": "admission_order", "timed": False, "preset": args.preset, "seeds": seeds,
            "configs": list(CONFIGS), "cells": cells, "runs": runs}


def table(d: dict) -> str:
    lines = ["| pressure | tools | config | step s (min-max) | x best router | tail 10% share | "
             "last trajectory's admission wait s | deferrals |",
             "|---:|---|---|---:|---:|---:|---:|---:|"]
    for c in d["cells"]:
        w = c["workload"]
        for name, r in c["summary"].items():
            m = r["makespan_s"]
            lines.append(f"| {w['pressure']:g} | {w['tools']} | {name} | {m['median']:.1f} "
                         f"({m['min']:.1f}-{m['max']:.1f}) | {r['x_best_router']:.2f} | "
                         f"{r['tail10_share']['median']:.2f} | {r['last_admission_wait_s']['median']:.1f} | "
                         f"{r['deferrals']['median']:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", required=True, help="tau-bench trace file (OpenAI chat format)")
    ap.add_argument("--split", choices=["tuning", "validation"], default="validation")
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--per-engine", type=int, default=32, help="trajectories per engine")
    ap.add_argument("--pressures", default="2,4")
    ap.add_argument("--tools", default="fast,slow")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--preset", default="h100_qwen7b")
    ap.add_argument("--json")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    for t in args.tools.split(","):
        if t not in TOOL_SPEEDS:
            raise SystemExit(f"--tools: unknown speed {t!r} (choose from {', '.join(TOOL_SPEEDS)})")
    d = run(args)
    print(table(d))
    out = write_json(args.json, d)
    if out:
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
