"""End-to-end dispatch benchmark: every policy on the same simulated cluster and workload.

    python tools/bench_dispatch.py --traces ../shared/traces/tau_airline_dev.json \
        --engines 8 --load high --json results/bench_dispatch_e8_high.json
    python tools/bench_dispatch.py --traces FILE --sweep --plot results/bench_dispatch_sweep.png \
        --json results/bench_dispatch_sweep.json

Simulator: :mod:`war_openrlhf.simulation.cluster` (cost preset ``--preset``, default
``h100_qwen7b``). One synchronous GRPO step: all trajectories start at t=0, the step ends
when the last one ends.

Loads (trajectories per engine, KV capacity per engine):

* ``low``: 4 trajectories per engine (one group of 4 trials), the preset's KV capacity (0.9 M
  tokens for h100_qwen7b): the live context of an engine is a few percent of its KV.
* ``high``: 32 trajectories per engine (8 groups), and a KV capacity per engine set to
  1 / ``--pressure`` (default 2) of the live-context footprint per engine, i.e. the sum over
  trajectories of their peak context (final context + response) divided by the engines.
  On tau-bench (1.3-12k-token contexts) that is ~100k tokens instead of 0.9 M: it stands for the
  same pressure with SWE-style 30-60k-token contexts on a real 0.9 M-token H100. The output
  states the aggregate live context / one engine's KV capacity.

When more trajectories are needed than the 35 tasks x 4 trials of the file, the tasks are
replicated: replica r (r >= 1) of a task is a new group (ids ``<id>#r<r>``) whose tokens equal
the original's except one token right after the prefix common to every task's prompt (the
shared system prompt), so replicas share the system prompt like distinct tasks do, each
replica's trials share their group prefix, and nothing else is shared across replicas.

Policy kwargs (the policies' code is not touched): ``least_loaded`` gets
``n_samples_per_prompt = group size`` (OpenRLHF adds n per prompt to the snapshot load);
``war`` runs with its defaults unless ``--war-kwargs JSON`` is given (reported in the output).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from war_openrlhf.simulation.cluster import SimConfig, prepare_trajectories, simulate  # noqa: E402
from war_openrlhf.simulation.cost_model import get_preset  # noqa: E402
from war_openrlhf.traces import (Turn, TokenizedTrajectory, group_trajectories,  # noqa: E402
                                 load_chat_traces, tokenize_traces)

POLICY_ORDER = ["round_robin", "least_loaded", "sticky", "sglang_cache_aware", "dynamo_kv", "war"]
LOADS = {"low": 4, "high": 32}  # trajectories per engine
SALT_BASE = 200_000  # above the Qwen2.5 vocabulary (151,665 ids)


def _stream(traj):
    last = traj.turns[-1]
    return np.concatenate([last.context_token_ids, last.response_token_ids]).astype(np.int32)


def salt_position(trajs) -> int:
    """Length of the prefix common to every trajectory's first context."""
    firsts = [np.asarray(t.turns[0].context_token_ids) for t in trajs]
    p = min(len(f) for f in firsts)
    ref = firsts[0]
    for f in firsts[1:]:
        neq = np.flatnonzero(ref[:p] != f[:p])
        if len(neq):
            p = int(neq[0])
    return p


def replicate(trajs, copies: int):
    """``copies`` replicas of every group (replica 0 = the original trajectories)."""
    p = salt_position(trajs)
    out = list(trajs)
    for r in range(1, copies):
        for t in trajs:
            s = _stream(t).copy()
            if p < len(s):
                s[p] = SALT_BASE + r
            s.flags.writeable = False
            turns = []
            for turn in t.turns:
                c = len(turn.context_token_ids)
                n = len(turn.response_token_ids)
                turns.append(Turn(s[:c], s[c:c + n], turn.env_token_count))
            out.append(TokenizedTrajectory(f"{t.trajectory_id}#r{r}", f"{t.group_id}#r{r}",
                                           turns))
    return out


def build_workload(base, engines: int, load: str, preset: str, pressure: float):
    groups = list(group_trajectories(base).values())
    group_size = max(len(g) for g in groups)
    want_traj = LOADS[load] * engines
    want_groups = max(1, math.ceil(want_traj / group_size))
    copies = math.ceil(want_groups / len(groups))
    pool = replicate(base, copies) if copies > 1 else list(base)
    pgroups = list(group_trajectories(pool).values())
    # Interleave replicas' groups (r0 g0.., r1 g0..) is unnecessary: take groups in order.
    chosen = [t for g in pgroups[:want_groups] for t in g]
    footprint = sum(len(t.turns[-1].context_token_ids) + len(t.turns[-1].response_token_ids)
                    for t in chosen)
    cap_preset = get_preset(preset).kv_capacity_tokens
    if load == "high":
        cap = max(16, int(footprint / engines / pressure) // 16 * 16)
        cap = min(cap, cap_preset)
    else:
        cap = cap_preset
    info = {
        "load": load, "engines": engines, "trajectories": len(chosen), "groups": want_groups,
        "group_size": group_size, "replicas": copies,
        "trajectories_per_engine": len(chosen) / engines,
        "kv_capacity_tokens_per_engine": cap,
        "live_context_tokens": footprint,
        "live_context_per_engine": footprint / engines,
        "aggregate_live_over_one_engine_kv": footprint / cap,
        "per_engine_live_over_kv": footprint / engines / cap,
        "response_tokens": int(sum(len(tr.response_token_ids) for t in chosen for tr in t.turns)),
        "turns": int(sum(len(t.turns) for t in chosen)),
    }
    return chosen, group_size, cap, info


def run_all(trajs, group_size, cap, args, engines, war_kwargs, pbar=None):
    prepared = prepare_trajectories(trajs)
    rows = {}
    for pol in POLICY_ORDER:
        kw = {}
        if pol == "least_loaded":
            kw = {"n_samples_per_prompt": group_size}
        elif pol == "war":
            kw = dict(war_kwargs)
        cfg = SimConfig(num_engines=engines, preset=args.preset, kv_capacity_tokens=cap,
                        tool_delay_s=args.tool_delay, per_env_token_s=args.per_env_token,
                        delay_jitter=args.jitter, seed=args.seed)
        t0 = time.perf_counter()
        res = simulate(prepared, pol, cfg, **kw)
        d = res.to_dict()
        d["policy_kwargs"] = kw
        d["sim_wall_s"] = time.perf_counter() - t0
        rows[pol] = d
        if pbar is not None:
            pbar.update(1)
    # Ceiling: every trajectory alone on its own engine, the preset's (unlimited here) KV, the
    # same tool delays -- the makespan no dispatcher on `engines` engines can beat.
    free = SimConfig(num_engines=len(prepared), preset=args.preset,
                     tool_delay_s=args.tool_delay, per_env_token_s=args.per_env_token,
                     delay_jitter=args.jitter, seed=args.seed)
    bound = simulate(prepared, "sticky", free)
    ll = rows["least_loaded"]["throughput_tok_s"]
    ceiling = {"makespan_s": bound.makespan_s, "throughput_tok_s": bound.throughput_tok_s,
               "hit_rate": bound.hit_rate,
               "x_least_loaded": bound.throughput_tok_s / ll if ll else float("nan")}
    for pol, d in rows.items():
        peers = [rows[q]["throughput_tok_s"] for q in rows if q != pol]
        d["x_least_loaded"] = d["throughput_tok_s"] / ll if ll else float("nan")
        d["x_best_peer"] = d["throughput_tok_s"] / max(peers) if peers else float("nan")
    return rows, ceiling


def print_table(rows, info, ceiling):
    print(f"\n### {info['engines']} engines, load {info['load']}: {info['trajectories']} "
          f"trajectories ({info['trajectories_per_engine']:.0f}/engine, {info['turns']} turns, "
          f"{info['response_tokens']:,} response tokens), KV {info['kv_capacity_tokens_per_engine']:,} "
          f"tokens/engine; live context {info['live_context_tokens']:,} tokens = "
          f"{info['aggregate_live_over_one_engine_kv']:.1f}x one engine's KV "
          f"({info['per_engine_live_over_kv']:.2f}x per engine)")
    print("\n| policy | makespan s | tok/s | hit rate | oracle | imbalance | p99 turn s | "
          "dec p50 us | dec p99 us | moves | x least_loaded | x best peer |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for pol, d in rows.items():
        print(f"| {pol} | {d['makespan_s']:.2f} | {d['throughput_tok_s']:,.0f} | "
              f"{d['hit_rate']:.3f} | {d['oracle_hit_rate']:.3f} | {d['load_imbalance']:.2f} | "
              f"{d['turn_latency_p99_s']:.2f} | {d['decision_p50_us']:.1f} | "
              f"{d['decision_p99_us']:.1f} | {d['engine_changes']} | {d['x_least_loaded']:.3f} | "
              f"{d['x_best_peer']:.3f} |")
    print(f"\nContention-free ceiling (one engine per trajectory, unlimited KV, same delays): "
          f"makespan {ceiling['makespan_s']:.2f} s, {ceiling['throughput_tok_s']:,.0f} tok/s = "
          f"{ceiling['x_least_loaded']:.2f}x least_loaded: no dispatcher can exceed it.")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", required=True)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--load", choices=sorted(LOADS), default="high")
    ap.add_argument("--json", required=True)
    ap.add_argument("--sweep", action="store_true", help="engines {4,8,32} x loads {low,high}")
    ap.add_argument("--plot", help="PNG of throughput vs engines per policy (with --sweep)")
    ap.add_argument("--preset", default="h100_qwen7b")
    ap.add_argument("--pressure", type=float, default=2.0,
                    help="high load: live context per engine / KV capacity per engine")
    ap.add_argument("--tool-delay", type=float, default=1.0)
    ap.add_argument("--per-env-token", type=float, default=1e-3)
    ap.add_argument("--jitter", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--war-kwargs", default="{}", help="JSON kwargs for the war policy")
    args = ap.parse_args(argv)
    get_preset(args.preset)
    if args.engines <= 0:
        raise SystemExit("--engines must be positive")
    if args.pressure <= 0:
        raise SystemExit("--pressure must be positive")
    war_kwargs = json.loads(args.war_kwargs)

    from tqdm import tqdm

    base = tokenize_traces(load_chat_traces(args.traces))
    combos = ([(e, l) for l in ("low", "high") for e in (4, 8, 32)] if args.sweep
              else [(args.engines, args.load)])
    out = {"command": " ".join(["python"] + sys.argv), "machine": platform.platform(),
           "preset": get_preset(args.preset).to_dict(), "tool_delay_s": args.tool_delay,
           "per_env_token_s": args.per_env_token, "delay_jitter": args.jitter,
           "seed": args.seed, "war_kwargs": war_kwargs, "runs": []}
    tables = []
    with tqdm(total=len(combos) * len(POLICY_ORDER), desc="simulations", file=sys.stderr) as bar:
        for engines, load in combos:
            trajs, gsize, cap, info = build_workload(base, engines, load, args.preset,
                                                     args.pressure)
            rows, ceiling = run_all(trajs, gsize, cap, args, engines, war_kwargs, bar)
            out["runs"].append({"workload": info, "results": rows, "ceiling": ceiling})
            tables.append((rows, info, ceiling))
    for rows, info, ceiling in tables:
        print_table(rows, info, ceiling)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"\nwrote {args.json}")
    if args.sweep and args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        for ax, load in zip(axes, ("low", "high")):
            runs = [r for r in out["runs"] if r["workload"]["load"] == load]
            es = [r["workload"]["engines"] for r in runs]
            for pol in POLICY_ORDER:
                ax.plot(es, [r["results"][pol]["throughput_tok_s"] for r in runs], marker="o",
                        label=pol, lw=2.5 if pol == "war" else 1.2)
            ax.set_xscale("log", base=2)
            ax.set_xticks(es)
            ax.set_xticklabels([str(e) for e in es])
            ax.set_xlabel("engines")
            ax.set_ylabel("generated tokens / s (one GRPO step)")
            ax.set_title(f"load {load} ({LOADS[load]} trajectories/engine)")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.suptitle(f"Simulated rollout throughput, preset {args.preset}")
        fig.tight_layout()
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
