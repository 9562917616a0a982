"""End-to-end dispatch benchmark: every policy on the same simulated cluster and workload.

    # one regime, the whole trace file
    python tools/bench_dispatch.py --traces ../shared/traces/tau_airline_dev.json \
        --engines 8 --load high --json results/bench_dispatch_e8_high.json
    # the matrix nothing was tuned on (validation tasks of the file + generated workloads)
    python tools/bench_dispatch.py --suite --traces ../shared/traces/tau_airline_dev.json \
        --json results/dispatch_suite.json --plot docs/img/dispatch_suite.png
    # the same matrix on the tuning half / tuning seed (what a policy may be tuned on)
    python tools/bench_dispatch.py --suite --split tuning --traces FILE --json OUT.json
    # summarise parts of a matrix run separately (e.g. --suite-engines 4,8 and 32)
    python tools/bench_dispatch.py --suite-from a.json b.json --json all.json --plot all.png

Simulator: :mod:`war_openrlhf.simulation.cluster` (cost preset ``--preset``, default
``h100_qwen7b``). A run is one synchronous GRPO step measured after a warm-up step of other
groups (the previous RL step: policies that learn online are measured warm, as in a running
job; the weight sync between them empties the prefix caches; ``--no-warmup`` measures a cold
step). The step ends when the last trajectory ends; the output shows that trajectory per
policy (its engine, and its time split into admission wait, tools, queue, prefill, decode).

Loads (trajectories per engine, KV capacity per engine):

* ``low``: 4 trajectories per engine (one group of 4 trials), the preset's KV capacity (0.9 M
  tokens for h100_qwen7b): the live context of an engine is a few percent of its KV.
* ``high``: 32 trajectories per engine (8 groups), and a KV capacity per engine set to
  1 / ``--pressure`` (default 2) of the live-context footprint per engine, i.e. the sum over
  trajectories of their peak context (final context + response) divided by the engines.
  A real engine's KV always holds one max-length sequence: where the pressure would leave
  less, the KV is raised to the longest sequence and the output says so.

When more trajectories are needed than the file has, the tasks are replicated: replica r
(r >= 1) of a task is a new group (ids ``<id>#r<r>``) whose tokens equal the original's
except one token right after the prefix common to every task's prompt (the shared system
prompt), so replicas share the system prompt like distinct tasks do, each replica's trials
share their group prefix, and nothing else is shared across replicas.

``--suite``: sources (``--sources``: ``tau`` = the trace file, ``gen:NAME`` = a workload of
:mod:`war_openrlhf.simulation.workloads`) x engines 4/8/32 x pressure 1/2/4 x tools fast
(0.1 s + 0.1 ms per environment token; generated latencies x 0.1) / slow (1 s + 1 ms;
generated latencies as drawn), load high. ``--split validation`` (default) uses the odd
half of the file's tasks (sorted by id) and generator seed 0; ``--split tuning`` the even
half and seed 1. Report validation; tune on tuning only. It prints one table (war / best
peer per cell, the ceiling, war's critical path), the minimum over cells and the targets,
and plots war / best peer against each cell's contention-free ceiling.

Policy kwargs (the policies' code is not touched): ``least_loaded`` gets
``n_samples_per_prompt = group size`` (OpenRLHF adds n per prompt to the snapshot load);
``war`` runs with its defaults unless ``--war-kwargs JSON`` is given (reported in the output);
``--war-turn-priority longest_first`` runs war's engines with vLLM's priority scheduling and each
turn's priority from its trajectory's predicted remaining turns (``war_sim`` in the output), the
peers' engines unchanged. ``--suite --draws N`` runs every cell on N workload draws
(:func:`draw_seeds`) and compares each policy's mean step (:func:`merge_draws`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from war_openrlhf.metrics import write_json  # noqa: E402
from war_openrlhf.simulation.cluster import (SimConfig, contention_free_makespan,  # noqa: E402
                                             prepare_trajectories, simulate)
from war_openrlhf.simulation.cost_model import get_preset  # noqa: E402
from war_openrlhf.traces import (Turn, TokenizedTrajectory, group_trajectories,  # noqa: E402
                                 load_chat_traces, task_halves, tokenize_traces)

POLICY_ORDER = ["round_robin", "least_loaded", "sticky", "sglang_cache_aware", "dynamo_kv",
                "verl_kv_aware", "war"]
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


def build_workload(base, engines: int, load: str, preset: str, pressure: float,
                   warmup: bool = False):
    """The measured step's trajectories (and, with ``warmup``, a previous step of as many
    other groups in front of them: ``(warmup + measured, group_size, cap, info)``)."""
    groups = list(group_trajectories(base).values())
    group_size = max(len(g) for g in groups)
    want_traj = LOADS[load] * engines
    want_groups = max(1, math.ceil(want_traj / group_size))
    steps = 2 if warmup else 1
    copies = math.ceil(steps * want_groups / len(groups))
    pool = replicate(base, copies) if copies > 1 else list(base)
    pgroups = list(group_trajectories(pool).values())[:steps * want_groups]
    before = [t for g in pgroups[:len(pgroups) - want_groups] for t in g]
    chosen = [t for g in pgroups[len(pgroups) - want_groups:] for t in g]
    footprint = sum(len(t.turns[-1].context_token_ids) + len(t.turns[-1].response_token_ids)
                    for t in chosen)
    cost = get_preset(preset)
    bs = cost.block_size
    cap_preset = cost.kv_capacity_tokens
    # a real engine's KV always holds one max-length sequence
    longest = max(len(x.context_token_ids) + len(x.response_token_ids) for t in chosen for x in t.turns)
    floor = -(-longest // bs) * bs
    if load == "high":
        cap = max(bs, int(footprint / engines / pressure) // bs * bs)
        cap = min(cap, cap_preset)
    else:
        cap = cap_preset
    floored = cap < floor
    cap = max(cap, floor)
    info = {
        "load": load, "engines": engines, "trajectories": len(chosen), "groups": want_groups,
        "group_size": group_size, "replicas": copies,
        "trajectories_per_engine": len(chosen) / engines,
        "kv_capacity_tokens_per_engine": cap,
        "kv_floored_to_longest_sequence": floored, "longest_sequence_tokens": longest,
        "live_context_tokens": footprint,
        "live_context_per_engine": footprint / engines,
        "aggregate_live_over_one_engine_kv": footprint / cap,
        "per_engine_live_over_kv": footprint / engines / cap,
        "response_tokens": int(sum(len(tr.response_token_ids) for t in chosen for tr in t.turns)),
        "turns": int(sum(len(t.turns) for t in chosen)),
        "warmup_trajectories": len(before),
    }
    return before + chosen, group_size, cap, info


def run_policies(prepared, cfg: dict, group_size: int, war_kwargs=None, pbar=None, war_sim=None):
    """Every policy of POLICY_ORDER on the same trajectories and SimConfig(**cfg), and the
    contention-free ceiling of the measured step: ``(rows, ceiling)``, each row with its
    ratios to least_loaded and to the best other policy. ``war_sim``: SimConfig fields that
    differ for ``war`` alone (``turn_priority``: the engines a WAR pool would start)."""
    rows = {}
    for pol in POLICY_ORDER:
        kw = {}
        sim = dict(cfg)
        if pol == "least_loaded":  # OpenRLHF adds n per prompt to the snapshot load
            kw = {"n_samples_per_prompt": group_size}
        elif pol == "war":
            kw = dict(war_kwargs or {})
            sim.update(war_sim or {})
        t0 = time.perf_counter()
        d = simulate(prepared, pol, SimConfig(**sim), **kw).to_dict()
        d["policy_kwargs"] = kw
        d["sim_overrides"] = {k: v for k, v in sim.items() if cfg.get(k) != v}
        d["sim_wall_s"] = time.perf_counter() - t0
        rows[pol] = d
        if pbar is not None:
            pbar.update(1)
    # Ceiling: every trajectory alone on its own engine, unlimited KV, the same tool delays --
    # the makespan no dispatcher can beat.
    bound = contention_free_makespan(prepared, SimConfig(**cfg))
    ll = rows["least_loaded"]
    ceiling = {"makespan_s": bound,
               "throughput_tok_s": ll["generated_tokens"] / bound if bound else float("nan"),
               "x_least_loaded": ll["makespan_s"] / bound if bound else float("nan")}
    for pol, d in rows.items():
        peers = [rows[q]["throughput_tok_s"] for q in rows if q != pol]
        d["x_least_loaded"] = (d["throughput_tok_s"] / ll["throughput_tok_s"]
                               if ll["throughput_tok_s"] else float("nan"))
        d["x_best_peer"] = d["throughput_tok_s"] / max(peers) if peers else float("nan")
    return rows, ceiling


def run_all(trajs, group_size, cap, args, engines, war_kwargs, pbar=None):
    cfg = dict(num_engines=engines, preset=args.preset, kv_capacity_tokens=cap,
               tool_delay_s=args.tool_delay, per_env_token_s=args.per_env_token,
               delay_jitter=args.jitter, seed=args.seed,
               steps=2 if args.warmup else 1, warmup_steps=1 if args.warmup else 0)
    return run_policies(prepare_trajectories(trajs), cfg, group_size, war_kwargs, pbar, _war_sim(args))


def _war_sim(args) -> dict:
    """SimConfig fields for ``war`` alone, from the command line."""
    return {"turn_priority": args.war_turn_priority} if args.war_turn_priority != "none" else {}


def print_table(rows, info, ceiling):
    print(f"\n### {info['engines']} engines, load {info['load']}: {info['trajectories']} "
          f"trajectories ({info['trajectories_per_engine']:.0f}/engine, {info['turns']} turns, "
          f"{info['response_tokens']:,} response tokens), KV {info['kv_capacity_tokens_per_engine']:,} "
          f"tokens/engine; live context {info['live_context_tokens']:,} tokens = "
          f"{info['aggregate_live_over_one_engine_kv']:.1f}x one engine's KV "
          f"({info['per_engine_live_over_kv']:.2f}x per engine)"
          + (f"; KV raised to the longest sequence ({info['longest_sequence_tokens']:,} tokens): "
             f"a real engine always holds one" if info["kv_floored_to_longest_sequence"] else ""))
    print("\n| policy | makespan s | tok/s | hit rate | oracle | imbalance | p99 turn s | "
          "dec p50 us | dec p99 us | moves | x least_loaded | x best peer |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for pol, d in rows.items():
        print(f"| {pol} | {d['makespan_s']:.2f} | {d['throughput_tok_s']:,.0f} | "
              f"{d['hit_rate']:.3f} | {d['oracle_hit_rate']:.3f} | {d['load_imbalance']:.2f} | "
              f"{d['turn_latency_p99_s']:.2f} | {d['decision_p50_us']:.1f} | "
              f"{d['decision_p99_us']:.1f} | {d['engine_changes']} | {d['x_least_loaded']:.3f} | "
              f"{d['x_best_peer']:.3f} |")
    print("\nCritical path (the trajectory that finished last, where its time went):\n")
    print("| policy | trajectory | turns | last engine | its busy / mean | admission wait s | "
          "tools s | queue s | prefill s | decode s | prefilled tokens | tail 10% share | trajectory p99 s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for pol, d in rows.items():
        for cp in d.get("critical_paths", []):
            print(f"| {pol} | {cp['trajectory']} | {cp['turns']} | {cp['engine']} | "
                  f"{cp['engine_busy_over_mean']:.2f} | {cp['admission_wait_s']:.2f} | "
                  f"{cp['tool_s']:.2f} | {cp['queue_s']:.2f} | {cp['prefill_s']:.2f} | "
                  f"{cp['decode_s']:.2f} | {cp['prefill_tokens']:,} | {cp['tail10_share']:.2f} | "
                  f"{cp['trajectory_p99_s']:.2f} |")
    print(f"\nContention-free ceiling (one engine per trajectory, unlimited KV, same delays): "
          f"makespan {ceiling['makespan_s']:.2f} s, {ceiling['throughput_tok_s']:,.0f} tok/s = "
          f"{ceiling['x_least_loaded']:.2f}x least_loaded: no dispatcher can exceed it.")


# ---- the suite: a matrix of workloads and regimes that nothing was tuned on -----------------
SUITE_ENGINES = (4, 8, 32)
SUITE_PRESSURES = (1.0, 2.0, 4.0)
#: tool speed -> (seconds per tool call, seconds per environment token, scale of a generated
#: workload's own tool latencies)
TOOL_SPEEDS = {"fast": (0.1, 1e-4, 0.1), "slow": (1.0, 1e-3, 1.0)}
#: the generator's seeds: policies may be tuned on the tuning seed, the suite reports the other
GENERATOR_SEEDS = {"tuning": 1, "validation": 0}


def split_by_task(trajs, split: str):
    """Half of the tasks (GRPO groups): sorted group ids, even positions = ``tuning``, odd =
    ``validation``. A task's trials never straddle the halves."""
    keep = task_halves(group_trajectories(trajs))[split]
    return [t for t in trajs if t.group_id in keep]


def _with_delays(trajs, scale: float):
    """Generated trajectories with their recorded tool latencies times ``scale``."""
    from dataclasses import replace

    return [replace(t, tool_delays_s=tuple(d * scale for d in t.tool_delays_s)) for t in trajs]


def suite_trajectories(source: str, split: str, base_traces, n_groups: int, generator_seed: int | None = None):
    """``2 * n_groups`` groups of ``source``: the first half is the warm-up step (the previous RL
    step), the second the measured one. ``source`` is ``tau`` (the trace file's ``split``
    half, tasks replicated as in :func:`replicate`) or ``gen:NAME`` (a named generator spec at
    the split's seed, or ``generator_seed``)."""
    if source == "tau":
        half = split_by_task(base_traces, split)
        groups = list(group_trajectories(half).values())
        copies = math.ceil(2 * n_groups / len(groups))
        pool = replicate(half, copies) if copies > 1 else list(half)
        pgroups = list(group_trajectories(pool).values())[:2 * n_groups]
        return [t for g in pgroups for t in g], None
    from war_openrlhf.simulation import workloads

    name = source.split(":", 1)[1]
    spec = workloads.NAMED_SPECS[name]
    trajs = workloads.generate_workload(
        workloads.scaled(spec, 2 * n_groups,
                         seed=GENERATOR_SEEDS[split] if generator_seed is None else generator_seed))
    return trajs, name


def draw_seeds(split: str, draw: int, seed: int) -> tuple:
    """``(generator seed, tool-jitter seed)`` of draw ``draw`` of a cell: the generator's seeds
    of a split keep its parity (validation even, tuning odd), so no draw of one split is a draw
    of the other; the trace file's tasks stay the split's, their tool delays drawn anew."""
    return GENERATOR_SEEDS[split] + 2 * draw, seed + draw


def run_cell(source, split, base_traces, engines, pressure, tools, per_engine, args, bar=None):
    """One cell: every policy on the same warm-up + measured step, and the contention-free
    ceiling of the measured step; with ``args.draws`` > 1, that many draws of the cell's
    workload (:func:`draw_seeds`), every policy on each, merged by :func:`merge_draws`."""
    draws = [_run_draw(source, split, base_traces, engines, pressure, tools, per_engine, args, d, bar)
             for d in range(args.draws)]
    return draws[0] if len(draws) == 1 else merge_draws(draws)


def merge_draws(draws: list) -> dict:
    """One cell's runs over several workload draws as one run: each policy's step is its mean
    step over the draws and its throughput all draws' tokens over all their steps (so the ratio
    of two policies' throughputs is the ratio of their mean steps); the ceiling likewise; every
    other field is the first draw's. Each draw's step, throughput and ceiling are kept
    (``draws``), and the cell names its draws' seeds."""
    first = draws[0]
    rows = {}
    for pol in first["results"]:
        per = [d["results"][pol] for d in draws]
        steps = [r["makespan_s"] for r in per]
        row = dict(per[0])
        row["makespan_s"] = float(np.mean(steps))
        row["throughput_tok_s"] = sum(r["generated_tokens"] for r in per) / sum(steps)
        row["draws"] = [{"makespan_s": r["makespan_s"], "throughput_tok_s": r["throughput_tok_s"]} for r in per]
        rows[pol] = row
    ll = rows["least_loaded"]
    for pol, row in rows.items():
        peers = [rows[q]["throughput_tok_s"] for q in rows if q != pol]
        row["x_least_loaded"] = row["throughput_tok_s"] / ll["throughput_tok_s"]
        row["x_best_peer"] = row["throughput_tok_s"] / max(peers) if peers else float("nan")
    bound = float(np.mean([d["ceiling"]["makespan_s"] for d in draws]))
    ceiling = {"makespan_s": bound, "x_least_loaded": ll["makespan_s"] / bound,
               "throughput_tok_s": ll["throughput_tok_s"] * ll["makespan_s"] / bound,
               "draws": [d["ceiling"] for d in draws]}
    info = dict(first["workload"])
    info["draws"] = [d["workload"]["draw_seeds"] for d in draws]
    return {"workload": info, "results": rows, "ceiling": ceiling}


def _run_draw(source, split, base_traces, engines, pressure, tools, per_engine, args, draw, bar=None):
    """One draw of a cell (``run_cell``)."""
    gen_seed, jitter_seed = draw_seeds(split, draw, args.seed)
    probe, _ = suite_trajectories(source, split, base_traces, 1, gen_seed)
    group_size = max(len(g) for g in group_trajectories(probe).values())
    n_groups = max(1, math.ceil(per_engine * engines / group_size))
    trajs, _ = suite_trajectories(source, split, base_traces, n_groups, gen_seed)
    tool_s, env_s, scale = TOOL_SPEEDS[tools]
    generated = hasattr(trajs[0], "tool_delays_s")
    if generated:
        trajs = _with_delays(trajs, scale)
    groups = list(group_trajectories(trajs).values())
    measured = [t for g in groups[len(groups) // 2:] for t in g]
    group_size = max(len(g) for g in groups)
    cost = get_preset(args.preset)
    footprint = sum(len(t.turns[-1].context_token_ids) + len(t.turns[-1].response_token_ids)
                    for t in measured)
    longest = max(len(x.context_token_ids) + len(x.response_token_ids)
                  for t in trajs for x in t.turns)
    bs = cost.block_size
    cap = int(footprint / engines / pressure) // bs * bs
    floor = -(-longest // bs) * bs
    floored = cap < floor  # a real engine's KV always holds one max-length sequence
    cap = min(max(cap, floor), max(cost.kv_capacity_tokens, floor))
    cfg = dict(num_engines=engines, preset=args.preset, kv_capacity_tokens=cap,
               tool_delay_s=tool_s, per_env_token_s=env_s, delay_jitter=args.jitter,
               seed=jitter_seed, steps=2, warmup_steps=1)
    rows, ceiling = run_policies(prepare_trajectories(trajs), cfg, group_size, pbar=bar,
                                 war_sim=_war_sim(args))
    info = {"source": source, "split": split, "engines": engines, "pressure": pressure,
            "tools": tools, "tool_delay_s": tool_s, "per_env_token_s": env_s,
            "generated_delay_scale": scale if generated else None, "load": "high",
            "trajectories": len(measured), "warmup_trajectories": len(trajs) - len(measured),
            "group_size": group_size, "trajectories_per_engine": len(measured) / engines,
            "kv_capacity_tokens_per_engine": cap, "kv_floored_to_longest_sequence": floored,
            "longest_sequence_tokens": longest, "live_context_tokens": footprint,
            "per_engine_live_over_kv": footprint / engines / cap,
            "turns": int(sum(len(t.turns) for t in measured))}
    info["draw_seeds"] = {"generator": None if source == "tau" else gen_seed, "tool_jitter": jitter_seed}
    return {"workload": info, "results": rows, "ceiling": ceiling}


def _best_peer(results):
    peers = {p: d["throughput_tok_s"] for p, d in results.items() if p != "war"}
    name = max(peers, key=peers.get)
    return name, peers[name]


def suite_summary(runs):
    """Per cell war / best peer, and the three targets over the cells."""
    cells = []
    for r in runs:
        res = r["results"]
        peer, peer_tps = _best_peer(res)
        cells.append({"cell": r["workload"], "best_peer": peer,
                      "war_over_best_peer": res["war"]["throughput_tok_s"] / peer_tps,
                      "war_x_least_loaded": res["war"]["x_least_loaded"],
                      "best_peer_x_least_loaded": res[peer]["x_least_loaded"],
                      "ceiling_x_least_loaded": r["ceiling"]["x_least_loaded"]})
    ratios = [c["war_over_best_peer"] for c in cells]
    roomy = [c for c in cells if c["ceiling_x_least_loaded"] >= 1.2]
    very = [c for c in cells if c["ceiling_x_least_loaded"] >= 1.8]
    out = {"cells": len(cells), "min_war_over_best_peer": min(ratios),
           "geomean_war_over_best_peer": float(np.exp(np.mean(np.log(ratios)))),
           "cells_ceiling_ge_1_2": len(roomy),
           "min_war_over_best_peer_where_ceiling_ge_1_2":
               min((c["war_over_best_peer"] for c in roomy), default=None),
           "cells_ceiling_ge_1_8": len(very),
           "min_war_x_least_loaded_where_ceiling_ge_1_8":
               min((c["war_x_least_loaded"] for c in very), default=None)}
    def where(c):
        w = c["cell"]
        return {k: w[k] for k in ("source", "engines", "pressure", "tools")}

    # the cell behind each minimum, and how many cells meet each target (prose quotes these)
    out["min_war_over_best_peer_cell"] = where(min(cells, key=lambda c: c["war_over_best_peer"]))
    if roomy:
        out["min_war_over_best_peer_where_ceiling_ge_1_2_cell"] = where(
            min(roomy, key=lambda c: c["war_over_best_peer"]))
        out["cells_war_ge_1_1_best_peer_where_ceiling_ge_1_2"] = sum(c["war_over_best_peer"] >= 1.1 for c in roomy)
    if very:
        out["min_war_x_least_loaded_where_ceiling_ge_1_8_cell"] = where(
            min(very, key=lambda c: c["war_x_least_loaded"]))
        out["cells_war_ge_1_6_least_loaded_where_ceiling_ge_1_8"] = sum(c["war_x_least_loaded"] >= 1.6 for c in very)
    out["cells_war_ge_0_98_best_peer"] = sum(r >= 0.98 for r in ratios)
    out["targets"] = {
        "min war/best peer >= 0.98": out["min_war_over_best_peer"] >= 0.98,
        "war >= 1.1x best peer where ceiling >= 1.2": (
            out["min_war_over_best_peer_where_ceiling_ge_1_2"] is None
            or out["min_war_over_best_peer_where_ceiling_ge_1_2"] >= 1.1),
        "war >= 1.6x least_loaded where ceiling >= 1.8": (
            out["min_war_x_least_loaded_where_ceiling_ge_1_8"] is None
            or out["min_war_x_least_loaded_where_ceiling_ge_1_8"] >= 1.6)}
    return cells, out


def print_suite(cells, summary, split):
    print(f"\n### Dispatch suite ({split} data): simulated step throughput, load high "
          f"(32 trajectories/engine unless stated), KV = live context / pressure")
    print("\n| workload | engines | pressure | tools | KV tokens/engine | ceiling x LL | "
          "war x LL | best peer | peer x LL | war / best peer | war's last trajectory |")
    print("|---|---:|---:|---|---:|---:|---:|---|---:|---:|---|")
    for c, r in cells:
        w = c["cell"]
        cp = r["results"]["war"]["critical_paths"][0]
        kv = f"{w['kv_capacity_tokens_per_engine']:,}" + ("*" if w["kv_floored_to_longest_sequence"] else "")
        print(f"| {w['source']} | {w['engines']} | {w['pressure']:g} | {w['tools']} | {kv} | "
              f"{c['ceiling_x_least_loaded']:.2f} | {c['war_x_least_loaded']:.3f} | "
              f"{c['best_peer']} | {c['best_peer_x_least_loaded']:.3f} | "
              f"{c['war_over_best_peer']:.3f} | {cp['dominant'][:-2]} "
              f"(engine {cp['engine']}, busy {cp['engine_busy_over_mean']:.2f}x mean) |")
    print("\n`*`: KV raised to hold the longest sequence (a real engine always holds one "
          "max-length sequence), so the pressure there is lower than stated.")
    print(f"\nmin over {summary['cells']} cells of war / best peer: "
          f"{summary['min_war_over_best_peer']:.3f} (geometric mean "
          f"{summary['geomean_war_over_best_peer']:.3f})")
    for k, v in summary["targets"].items():
        print(f"- target {k}: {'met' if v else 'MISSED'}")
    for k in ("min_war_over_best_peer_cell", "min_war_over_best_peer_where_ceiling_ge_1_2_cell",
              "min_war_x_least_loaded_where_ceiling_ge_1_8_cell"):
        if k in summary:
            print(f"  {k[:-5]}: {summary[k]}")
    print(f"  cells war >= 0.98 x best peer: {summary['cells_war_ge_0_98_best_peer']} of {summary['cells']}; "
          f"war >= 1.1x best peer where ceiling >= 1.2: "
          f"{summary.get('cells_war_ge_1_1_best_peer_where_ceiling_ge_1_2', 0)} of {summary['cells_ceiling_ge_1_2']}; "
          f"war >= 1.6x least_loaded where ceiling >= 1.8: "
          f"{summary.get('cells_war_ge_1_6_least_loaded_where_ceiling_ge_1_8', 0)} of {summary['cells_ceiling_ge_1_8']}")


def plot_suite(cells, path, split):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    sources = sorted({c["cell"]["source"] for c, _ in cells})
    marks = {4: "o", 8: "s", 32: "^"}
    for i, src in enumerate(sources):
        labelled = False
        for e, m in marks.items():
            pts = [c for c, _ in cells if c["cell"]["source"] == src and c["cell"]["engines"] == e]
            if not pts:
                continue
            kw = dict(color=f"C{i}", marker=m, s=28, label=None if labelled else src)
            labelled = True
            axes[0].scatter([c["ceiling_x_least_loaded"] for c in pts],
                            [c["war_over_best_peer"] for c in pts], **kw)
            axes[1].scatter([c["ceiling_x_least_loaded"] for c in pts],
                            [c["war_x_least_loaded"] for c in pts], **kw)
    axes[0].axhline(0.98, color="r", lw=1, ls="--", label="0.98 (target floor)")
    axes[0].axhline(1.0, color="k", lw=0.6)
    axes[0].set_xlabel("contention-free ceiling (x least_loaded)")
    axes[0].set_ylabel("war / best peer (step throughput)")
    axes[0].set_title("war against the best peer of each cell")
    lim = max(c["ceiling_x_least_loaded"] for c, _ in cells) * 1.05
    axes[1].plot([1, lim], [1, lim], color="k", lw=0.6, label="ceiling")
    axes[1].set_xlabel("contention-free ceiling (x least_loaded)")
    axes[1].set_ylabel("war (x least_loaded)")
    axes[1].set_title("how much of the room war takes")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Dispatch suite, {split} data (markers: o 4, s 8, ^ 32 engines)")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def _cell_key(run) -> tuple:
    w = run["workload"]
    return (w["source"], w["engines"], w["pressure"], w["tools"])


def _without_timings(x):
    """A result without its wall-clock fields (what two runs of a deterministic cell share)."""
    if isinstance(x, dict):
        return {k: _without_timings(v) for k, v in x.items() if "decision" not in k and "wall" not in k}
    if isinstance(x, list):
        return [_without_timings(v) for v in x]
    return x


def merge_suite(args):
    """Summarise suite JSON files written by earlier runs (e.g. a matrix run in parts, or a run
    stopped early and completed by another): a cell in two files is kept once, and only if
    both hold the same result (the simulation is deterministic), else the merge stops."""
    from war_openrlhf.metrics import read_json

    runs, heads, seen, dropped = [], [], {}, 0
    for path in args.suite_from:
        try:
            data = read_json(path)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"--suite-from: cannot read {path}: {exc}")
        if not isinstance(data, dict) or not data.get("suite") or "runs" not in data:
            raise SystemExit(f"--suite-from: {path} is not a --suite result (no suite/runs)")
        for run in data["runs"]:
            key = _cell_key(run)
            if key in seen:
                first, first_path = seen[key]
                if _without_timings(first) != _without_timings(run):
                    raise SystemExit(f"--suite-from: cell {key} differs between {first_path} and {path}")
                dropped += 1
                continue
            seen[key] = (run, path)
            runs.append(run)
        heads.append(data)
    if dropped:
        print(f"--suite-from: {dropped} cell(s) found in two files with identical results, kept once")
    splits = {h.get("split") for h in heads}
    if len(splits) != 1:
        raise SystemExit(f"--suite-from: the files mix splits {sorted(map(str, splits))}")
    split = splits.pop()
    out = {k: v for k, v in heads[0].items() if k not in ("command", "git", "machine", "written_at")}
    out["merged_from"] = [{"path": str(p), **{k: h.get(k) for k in ("command", "git", "machine", "written_at")}}
                          for p, h in zip(args.suite_from, heads)]
    out["runs"] = runs
    cells, summary = suite_summary(runs)
    out["summary"], out["cells"] = summary, cells
    write_json(args.json, out)
    print_suite(list(zip(cells, runs)), summary, split)
    print(f"\nwrote {args.json}")
    if args.plot:
        plot_suite(list(zip(cells, runs)), args.plot, split)


def _cell_job(job):
    """One suite cell in a worker process (a deterministic simulation: the same result as in
    the parent)."""
    src, split, base, e, p, t, per_engine, args = job
    return run_cell(src, split, base, e, p, t, per_engine, args)


def _run_cells_in_workers(combos, base, args, out):
    """The cells in ``args.workers`` processes, largest first (engines x sources' turns), the
    runs kept in the matrix order; completed cells are written as they finish."""
    from concurrent.futures import ProcessPoolExecutor, as_completed

    from tqdm import tqdm

    size = {"gen:swe_like": 8}  # ~40 turns to 64k: the slowest cells to simulate
    order = sorted(range(len(combos)), key=lambda i: -combos[i][1] * size.get(combos[i][0], 1))
    runs = [None] * len(combos)
    with ProcessPoolExecutor(max_workers=args.workers) as pool, \
            tqdm(total=len(combos), desc="suite cells", file=sys.stderr) as bar:
        futs = {pool.submit(_cell_job, (*combos[i][:1], args.split, base, *combos[i][1:],
                                        args.per_engine, args)): i for i in order}
        for fut in as_completed(futs):
            runs[futs[fut]] = fut.result()
            bar.update(1)
            out["runs"] = [r for r in runs if r is not None]
            write_json(args.json, out)  # partial results survive (completed cells only)
    return runs


def run_suite(args):
    from tqdm import tqdm

    sources = args.sources.split(",")
    base = tokenize_traces(load_chat_traces(args.traces)) if "tau" in sources else None
    engines = [int(x) for x in args.suite_engines.split(",")]
    pressures = [float(x) for x in args.suite_pressures.split(",")]
    from war_openrlhf.simulation.workloads import NAMED_SPECS

    for src in sources:
        if src != "tau" and not (src.startswith("gen:") and src[4:] in NAMED_SPECS):
            raise SystemExit(f"--sources: unknown source {src!r}; known: tau, "
                             + ", ".join(f"gen:{n}" for n in NAMED_SPECS))
    tools = args.suite_tools.split(",")
    for t in tools:
        if t not in TOOL_SPEEDS:
            raise SystemExit(f"--suite-tools: unknown tool speed {t!r}; known: {sorted(TOOL_SPEEDS)}")
    combos = [(src, e, p, t) for src in sources for e in engines for p in pressures for t in tools]
    out = {"benchmark": "dispatch_suite", "simulated": True, "suite": True, "split": args.split, "preset": get_preset(args.preset).to_dict(),
           "delay_jitter": args.jitter, "seed": args.seed, "tool_speeds": TOOL_SPEEDS,
           "generator_seed": GENERATOR_SEEDS[args.split], "draws": args.draws, "war_sim": _war_sim(args),
           "runs": []}
    if args.workers > 1:
        out["runs"] = _run_cells_in_workers(combos, base, args, out)
    else:
        with tqdm(total=len(combos) * len(POLICY_ORDER) * args.draws, desc="suite", file=sys.stderr) as bar:
            for src, e, p, t in combos:
                out["runs"].append(run_cell(src, args.split, base, e, p, t, args.per_engine, args, bar))
                write_json(args.json, out)  # partial results survive
    cells, summary = suite_summary(out["runs"])
    out["summary"] = summary
    out["cells"] = cells
    write_json(args.json, out)
    print_suite(list(zip(cells, out["runs"])), summary, args.split)
    print(f"\nwrote {args.json}")
    if args.plot:
        plot_suite(list(zip(cells, out["runs"])), args.plot, args.split)



def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", help="trace file (OpenAI chat format); needed unless --suite "
                    "runs generated sources only")
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
    ap.add_argument("--draws", type=int, default=1,
                    help="--suite: workload draws per cell (generated sources: generator seeds of the "
                         "split's parity; the trace file: tool-delay seeds); each policy's step is its "
                         "mean over the draws")
    ap.add_argument("--war-turn-priority", choices=["none", "longest_first"], default="none",
                    help="war's engines schedule by vLLM request priority, each turn's from its "
                         "trajectory's predicted remaining turns (the pool's turn_priority)")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false",
                    help="measure a cold first step (default: a warm-up step of other groups "
                         "runs first, as the previous RL step, and is not measured)")
    ap.add_argument("--suite", action="store_true",
                    help="the matrix: sources x engines x pressure x tool speed (see --sources)")
    ap.add_argument("--split", choices=sorted(GENERATOR_SEEDS), default="validation",
                    help="--suite data: the trace file's tasks are split in halves (and the "
                         "generator has one seed per half); report validation, tune on tuning")
    ap.add_argument("--sources", default="tau,gen:tau_like,gen:swe_like,gen:math_tool,"
                    "gen:search_agent,gen:chatty_long_responses",
                    help="--suite workloads: tau (the trace file) and gen:NAME generator specs")
    ap.add_argument("--suite-engines", default=",".join(map(str, SUITE_ENGINES)))
    ap.add_argument("--suite-pressures", default=",".join(f"{p:g}" for p in SUITE_PRESSURES))
    ap.add_argument("--suite-tools", default=",".join(TOOL_SPEEDS))
    ap.add_argument("--per-engine", type=int, default=LOADS["high"],
                    help="--suite: trajectories per engine in the measured step")
    ap.add_argument("--workers", type=int, default=1,
                    help="--suite: simulate cells in this many processes (results are the same)")
    ap.add_argument("--suite-from", nargs="+", metavar="JSON",
                    help="summarise (table, plot, --json) earlier --suite results instead of "
                         "running: e.g. a matrix run in parts")
    args = ap.parse_args(argv)
    if args.suite_from:
        return merge_suite(args)
    if args.draws < 1:
        raise SystemExit(f"--draws must be >= 1, got {args.draws}")
    if args.draws > 1 and not args.suite:
        raise SystemExit("--draws applies to --suite runs only")
    if args.suite:
        if "tau" in args.sources.split(",") and not args.traces:
            raise SystemExit("--suite with source tau needs --traces FILE")
        return run_suite(args)
    if not args.traces:
        raise SystemExit("--traces is required (unless --suite runs generated sources only)")
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
    out = {"benchmark": "dispatch_sim", "simulated": True,
           "preset": get_preset(args.preset).to_dict(), "tool_delay_s": args.tool_delay,
           "per_env_token_s": args.per_env_token, "delay_jitter": args.jitter,
           "seed": args.seed, "war_kwargs": war_kwargs, "war_sim": _war_sim(args), "runs": []}
    tables = []
    with tqdm(total=len(combos) * len(POLICY_ORDER), desc="simulations", file=sys.stderr) as bar:
        for engines, load in combos:
            trajs, gsize, cap, info = build_workload(base, engines, load, args.preset,
                                                     args.pressure, warmup=args.warmup)
            rows, ceiling = run_all(trajs, gsize, cap, args, engines, war_kwargs, bar)
            out["runs"].append({"workload": info, "results": rows, "ceiling": ceiling})
            tables.append((rows, info, ceiling))
    for rows, info, ceiling in tables:
        print_table(rows, info, ceiling)
    write_json(args.json, out)
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
