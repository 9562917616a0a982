"""Decision-cost benchmark of the dispatch policies (not a test; timings are machine-dependent).

    python tools/bench_dispatch_decision.py [--engines 32] [--trajectories 64] [--max-context 65536] \
        [--repeats 3] [--json benchmarks/results/dispatch_decision/bench_dispatch_decision.json]

Workload: groups of 8 trajectories share an 8k-token prompt; every turn appends a 300-token
response and a 700-token tool output, until the context reaches --max-context (64k: ~57 turns).
Turns are interleaved across trajectories (one round = one turn of every live trajectory);
engine snapshots carry loads that either drift (--loads walk, default: each engine's request
count moves by -1/0/+1 per decision, queued_tokens = 400 per request) or are redrawn i.i.d. in
[0, 64) every decision (--loads iid, a stress case that makes WAR move most trajectories). Reports p50/p99 of choose() per policy, overall and for
contexts >= 32k tokens, and WAR's on_turn_finished() cost (O(context blocks), outside choose).
Every call is timed by wall time and by this thread's CPU time (the clocks' own cost
subtracted); CPU time leaves out the time the scheduler gives to other work on a shared
machine. --repeats runs, policies in turn within each; the JSON keeps every run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from war_openrlhf.dispatch import EngineState, TurnRequest, make_policy  # noqa: E402
from war_openrlhf.metrics import spread, timed_call, timer_overhead_us, write_json  # noqa: E402

POLICY_ORDER = ["round_robin", "least_loaded", "sticky", "sglang_cache_aware", "dynamo_kv",
                "verl_kv_aware", "war"]


def run(name, engines, trajectories, max_context, seed=0, group_size=8, prompt=8192,
        response=300, tool=700, loads_model="walk", overhead=(0.0, 0.0)):
    rng = np.random.default_rng(seed)
    walk = rng.integers(16, 48, engines).astype(np.int64)
    pol = make_policy(name, engines)
    ngroups = max(1, trajectories // group_size)
    prompts = [rng.integers(0, 150000, prompt, dtype=np.int32) for _ in range(ngroups)]
    # Pre-generate each trajectory's full token stream; a turn's context is a prefix of it.
    streams, bounds = [], []
    for t in range(trajectories):
        body = rng.integers(0, 150000, max_context - prompt, dtype=np.int32)
        streams.append(np.concatenate([prompts[t % ngroups], body]))
        b, n = [], prompt
        while n + response <= max_context:
            b.append(n)
            n += response + tool
        bounds.append(b)
    choose_us, big_us, finish_us = [], [], []
    choose_cpu, big_cpu, finish_cpu = [], [], []
    ow, oc = overhead
    nturns = max(len(b) for b in bounds)
    for turn in range(nturns):
        for t in range(trajectories):
            if turn >= len(bounds[t]):
                continue
            n = bounds[t][turn]
            ctx = streams[t][:n]
            req = TurnRequest(f"t{t}", f"g{t % ngroups}", ctx, turn, turn * response,
                              len(bounds[t]) * response)
            if loads_model == "iid":  # stress: independent loads every turn -> many moves
                loads = rng.integers(0, 64, engines)
            else:  # persistent loads drifting by -1/0/+1 request per decision
                walk = np.clip(walk + rng.integers(-1, 2, engines), 0, 64)
                loads = walk
            snap = [EngineState(i, int(loads[i]), 0, int(loads[i]) * 400, 2_000_000,
                                int(rng.integers(0, 4))) for i in range(engines)]
            eid, dt, dc = timed_call(pol.choose, req, snap)
            dt, dc = max(0.0, dt - ow), max(0.0, dc - oc)
            choose_us.append(dt)
            choose_cpu.append(dc)
            if n >= 32768:
                big_us.append(dt)
                big_cpu.append(dc)
            resp = streams[t][n:n + response]
            _, dt, dc = timed_call(pol.on_turn_finished, req, eid, resp)
            finish_us.append(max(0.0, dt - ow))
            finish_cpu.append(max(0.0, dc - oc))
    for t in range(trajectories):
        pol.on_trajectory_finished(f"t{t}")
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else float("nan")
    return {
        "policy": name, "moves": getattr(pol, "moves", None), "turns": len(choose_us),
        "p50_us": pct(choose_us, 50), "p99_us": pct(choose_us, 99),
        "p50_us_ctx>=32k": pct(big_us, 50), "p99_us_ctx>=32k": pct(big_us, 99),
        "finish_p50_us": pct(finish_us, 50), "finish_p99_us": pct(finish_us, 99),
        "cpu_p50_us": pct(choose_cpu, 50), "cpu_p99_us": pct(choose_cpu, 99),
        "cpu_p50_us_ctx>=32k": pct(big_cpu, 50), "cpu_p99_us_ctx>=32k": pct(big_cpu, 99),
        "cpu_finish_p50_us": pct(finish_cpu, 50), "cpu_finish_p99_us": pct(finish_cpu, 99),
    }


METRICS = ("p50_us", "p99_us", "p50_us_ctx>=32k", "p99_us_ctx>=32k", "finish_p50_us", "finish_p99_us")
METRICS = METRICS + tuple(f"cpu_{m}" for m in METRICS)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=32)
    ap.add_argument("--trajectories", type=int, default=64)
    ap.add_argument("--max-context", type=int, default=65536)
    ap.add_argument("--policies", nargs="*", default=POLICY_ORDER)
    ap.add_argument("--loads", choices=["walk", "iid"], default="walk")
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs of every policy on the same workload, policies in turn within a run; "
                         "the table shows the median (min-max), the JSON every run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    print(f"loads={args.loads} engines={args.engines} trajectories={args.trajectories} "
          f"max_context={args.max_context} repeats={args.repeats}")
    overhead = timer_overhead_us()
    runs = {name: [] for name in args.policies}
    for r in range(args.repeats):
        for name in args.policies:
            runs[name].append(run(name, args.engines, args.trajectories, args.max_context,
                                  seed=args.seed, loads_model=args.loads, overhead=overhead))
        print(f"run {r + 1}/{args.repeats} done", flush=True)
    results = {}
    for name, rs in runs.items():
        results[name] = {"policy": name, "turns": rs[0]["turns"], "moves": [x["moves"] for x in rs],
                         **{m: spread([x[m] for x in rs]) for m in METRICS}, "runs": rs}

    def cell(d):
        return f"{d['median']:.1f} ({d['min']:.1f}-{d['max']:.1f})"

    print(f"median of {args.repeats} runs (min-max), microseconds of CPU time (wall time p50 last)")
    print(f"{'policy':20s} {'turns':>6s} {'p50 us':>20s} {'p99 us':>20s} {'p50 >=32k':>20s} "
          f"{'p99 >=32k':>20s} {'finish p50':>20s} {'wall p50':>20s}")
    for name, d in results.items():
        print(f"{name:20s} {d['turns']:6d} {cell(d['cpu_p50_us']):>20s} {cell(d['cpu_p99_us']):>20s} "
              f"{cell(d['cpu_p50_us_ctx>=32k']):>20s} {cell(d['cpu_p99_us_ctx>=32k']):>20s} "
              f"{cell(d['cpu_finish_p50_us']):>20s} {cell(d['p50_us']):>20s}"
              + (f"  moves={d['moves'][0]}" if d["moves"][0] is not None else ""))
    out = write_json(args.json, {
        "benchmark": "dispatch_decision", "timed": True, "repeats": args.repeats,
        "workload": {"engines": args.engines, "trajectories": args.trajectories,
                     "max_context": args.max_context, "loads": args.loads, "seed": args.seed,
                     "group_size": 8, "prompt_tokens": 8192, "response_tokens": 300, "tool_tokens": 700},
        "timer_overhead_us": {"wall": overhead[0], "cpu": overhead[1]},
        "policies": args.policies, "results": results})
    if out:
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
