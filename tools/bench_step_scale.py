#!/usr/bin/env python
"""One rollout step of thousands of episodes: does the pool hold them, and what does a turn cost it?

A GPU user runs hundreds to thousands of episodes per step (400-800 prompts x 8-16 samples).
This runs ``--episodes`` episodes (``--group`` samples per prompt) in ONE batch of a WAR pool
over ``--engines`` CPU engines (the default engine kind: WAR's drafting engines, index replicas
fed by the log), every turn forced to ``--tokens`` tokens, tools answering at once
(``examples/trace_replay`` with zero delays), for each ``--agent-runners`` setting in rotating
order, ``--repeats`` times (``thread`` / ``loop``: the pool's ``agent_runner``, every turn
dispatched from the pool; ``hosted``: ``episode_host: engine``, each episode placed by the pool
and run beside its engine, its agent on the engine actor's loop; any of them with ``_unfrozen``
appended: ``freeze_heap: false``, the driver's heap not frozen while the batch runs). It checks and records:

- every episode comes back, ended by its own last turn (``end_reason`` counts; 0 lost);
- the pool's CPU per turn: the driver process's CPU time (every thread: event loop, agent
  threads, Ray's core worker) over the batch, divided by its turns;
- the log's lag: records the slowest replica has not been sent, sampled every 0.2 s;
- the driver's resident memory and threads, sampled the same way (peak above the idle pool,
  per live episode);
- where the driver's event-loop thread spends a turn (cProfile of one extra run per runner,
  grouped as ``tools/bench_turn_path.py`` groups it).

  python tools/bench_step_scale.py --json benchmarks/results/pool/step_scale.json
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench_turn_path import AGENT, GROUPS, WAITS, require_positive, rows_for  # noqa: E402

from war_openrlhf.metrics import format_table, spread, write_json  # noqa: E402

RUNNERS = ("thread", "loop", "hosted")
#: a runner's name with this suffix: the same runner with ``freeze_heap: false`` (the ablation)
UNFROZEN = "_unfrozen"
#: the pool's CPU per turn the issue asks for at 4,096 episodes on 2 engines (median of the runs)
TARGET_US = 200.0


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


class Sampler:
    """Samples the driver's memory, threads and the log's lag every ``interval_s`` on a thread of its own."""

    def __init__(self, pool, interval_s: float = 0.2) -> None:
        self.pool, self.interval_s = pool, interval_s
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        t0 = time.perf_counter()
        while not self._stop.wait(self.interval_s):
            try:
                lag = self.pool.shipper.unsent_records()
            except Exception:  # noqa: BLE001 - the log changed under the read: the next sample
                continue
            self.samples.append({"t_s": time.perf_counter() - t0, "rss_mib": _rss_mib(),
                                 "threads": threading.active_count(), "log_lag_records": lag})

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def run_step(pool, prompts, labels, group: int) -> dict:
    """One batch; what it returned and what it cost the driver."""
    rss0 = _rss_mib()
    cpu0, t0 = time.process_time(), time.perf_counter()
    with Sampler(pool) as sampler:
        result = pool.run_batch(prompts, labels, n_samples_per_prompt=group)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    s = sampler.samples or [{"rss_mib": _rss_mib(), "threads": threading.active_count(), "log_lag_records": 0}]
    return {"wall_s": wall, "driver_cpu_s": cpu, "turns": result.turns, "episodes": len(result.trajectories),
            "end_reasons": dict(result.end_reasons), "generated_tokens": result.generated_tokens,
            "peak_rss_mib": max(x["rss_mib"] for x in s), "rss_before_mib": rss0,
            "peak_threads": max(x["threads"] for x in s),
            "peak_log_lag_records": max(x["log_lag_records"] for x in s),
            "median_log_lag_records": statistics.median(x["log_lag_records"] for x in s)}


def profile_step(pool, prompts, labels, group: int) -> dict:
    prof = cProfile.Profile()
    prof.enable()
    result = pool.run_batch(prompts, labels, n_samples_per_prompt=group)
    prof.disable()
    groups: dict[str, float] = {}
    for (file, _line, fn), (_cc, _n, tottime, _ct, _callers) in pstats.Stats(prof).stats.items():
        if file == "~" and any(w in fn for w in WAITS):
            name = "waiting (blocked, not CPU)"
        else:
            name = next((g for g, keys in GROUPS if any(k in file for k in keys)), "other")
        groups[name] = groups.get(name, 0.0) + tottime
    return {"turns": result.turns, "us_per_turn": {g: 1e6 * s / result.turns for g, s in groups.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=4096, help="episodes in the one batch")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt (GRPO group size)")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--turns", type=int, default=3, help="turns per episode")
    ap.add_argument("--tokens", type=int, default=2, help="forced tokens per turn")
    ap.add_argument("--agent-runners", default=",".join(RUNNERS), help="comma-separated: thread, loop, hosted (each also with _unfrozen)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    require_positive(args, ("episodes", "group", "engines", "turns", "tokens", "repeats"))
    if args.episodes % args.group:
        raise SystemExit(f"--episodes ({args.episodes}) must be a multiple of --group ({args.group})")
    runners = [r.strip() for r in args.agent_runners.split(",") if r.strip()]
    bad = [r for r in runners if r.removesuffix(UNFROZEN) not in RUNNERS]
    if bad or not runners:
        raise SystemExit(f"--agent-runners: {bad or 'empty'} not among {', '.join(RUNNERS)}")

    import ray
    from transformers import AutoTokenizer

    from war_openrlhf.engine.actors import create_war_engines
    from war_openrlhf.fixtures.tiny_model import build_tiny_model
    from war_openrlhf.rollout import RolloutConfig, RolloutPool
    from war_openrlhf.rollout.agents import load_agent_class

    model = build_tiny_model(ROOT / ".cache" / "war_tiny_llama")
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    rows = rows_for(args.episodes // args.group, args.turns, args.tokens)
    prompts, labels = [r["prompt"] for r in rows], [r["label"] for r in rows]
    engine = dict(model=str(model), dtype="float32", max_model_len=1024, enforce_eager=True)
    ray.init(num_cpus=4 + (os.cpu_count() or 1), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    runs: dict[str, list[dict]] = {r: [] for r in runners}
    profiles = {}
    try:
        base = RolloutConfig(num_engines=args.engines, agent_func_path=str(AGENT), n_samples_per_prompt=args.group,
                             max_turns=args.turns + 1, max_context_tokens=1024, temperature=1.0, progress=False,
                             warm_up=False, engine=engine)
        handles = create_war_engines(args.engines, base.engine, agent_func_path=str(AGENT))
        agent_cls = load_agent_class(AGENT)
        from dataclasses import replace

        settings = {"thread": dict(agent_runner="thread"), "loop": dict(agent_runner="loop"),
                    "hosted": dict(agent_runner="loop", episode_host="engine")}
        pools = {r: RolloutPool(replace(base, **settings[r.removesuffix(UNFROZEN)],
                                        freeze_heap=not r.endswith(UNFROZEN)),
                                handles, tokenizer=tokenizer, agent_cls=agent_cls)
                 for r in runners}
        for r in runners:  # first-use costs stay out of the runs
            pools[r].run_batch(prompts[:2], labels[:2], n_samples_per_prompt=args.group)
        for k in range(args.repeats):
            for r in runners[k % len(runners):] + runners[:k % len(runners)]:
                run = run_step(pools[r], prompts, labels, args.group)
                runs[r].append(run)
                print(f"  {r} run {k}: {run['wall_s']:.1f} s, {run['turns']} turns, "
                      f"{1e6 * run['driver_cpu_s'] / run['turns']:.0f} us driver CPU/turn, "
                      f"end {run['end_reasons']}", file=sys.stderr, flush=True)
        for r in runners:
            profiles[r] = profile_step(pools[r], prompts, labels, args.group)
        for pool in pools.values():
            pool.shutdown()
    finally:
        ray.shutdown()

    expected_turns = args.episodes * args.turns
    rows_out = []
    for r in runners:
        rs = runs[r]
        lost = [args.episodes - x["episodes"] + sum(n for why, n in x["end_reasons"].items() if why != "done")
                for x in rs]
        rows_out.append({
            "agent_runner": r, "episodes": args.episodes, "turns": expected_turns,
            "episodes_lost_or_failed": max(lost), "all_turns_served": all(x["turns"] == expected_turns for x in rs),
            "wall_s": spread([x["wall_s"] for x in rs]),
            "turns_per_s": spread([x["turns"] / x["wall_s"] for x in rs]),
            "driver_cpu_per_turn_us": spread([1e6 * x["driver_cpu_s"] / x["turns"] for x in rs]),
            "peak_rss_above_idle_mib": spread([x["peak_rss_mib"] - x["rss_before_mib"] for x in rs]),
            "peak_rss_above_idle_kib_per_episode": spread([1024 * (x["peak_rss_mib"] - x["rss_before_mib"])
                                                           / args.episodes for x in rs]),
            "peak_threads": spread([float(x["peak_threads"]) for x in rs]),
            "peak_log_lag_records": spread([float(x["peak_log_lag_records"]) for x in rs]),
            "median_log_lag_records": spread([float(x["median_log_lag_records"]) for x in rs]),
            "runs": rs})
    profile_rows = [{"agent_runner": r, "group": g, "driver_us_per_turn": us}
                    for r, p in profiles.items() for g, us in sorted(p["us_per_turn"].items(), key=lambda kv: -kv[1])]
    best = min(rows_out, key=lambda x: x["driver_cpu_per_turn_us"]["median"])
    target_met = (best["driver_cpu_per_turn_us"]["median"] <= TARGET_US
                  and all(x["episodes_lost_or_failed"] == 0 and x["all_turns_served"] for x in rows_out))
    print(format_table([{**x, **{f"{k}_median": x[k]["median"] for k in ("wall_s", "driver_cpu_per_turn_us",
                                                                      "peak_threads", "peak_log_lag_records",
                                                                      "peak_rss_above_idle_mib")}}
                        for x in rows_out],
                       [("agent_runner", "runner", ""), ("episodes_lost_or_failed", "lost", "d"),
                        ("wall_s_median", "wall s", ".1f"), ("driver_cpu_per_turn_us_median", "driver us/turn", ".0f"),
                        ("peak_threads_median", "threads", ".0f"), ("peak_log_lag_records_median", "log lag", ".0f"),
                        ("peak_rss_above_idle_mib_median", "RSS +MiB", ".0f")]))
    print(format_table(profile_rows, [("agent_runner", "runner", ""), ("group", "group", ""),
                                      ("driver_us_per_turn", "us/turn", ".0f")]))
    write_json(args.json, {
        "benchmark": "step_scale",
        "regime": (f"{args.episodes} episodes ({args.episodes // args.group} prompts x {args.group}) in one batch on "
                   f"{args.engines} CPU engines (WAR drafting engines, default switch), {args.turns} turns of "
                   f"{args.tokens} forced tokens each, tools instant, ample KV"),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "rows": rows_out, "profile": profile_rows, "target_us_per_turn": TARGET_US, "target_met": target_met})
    return 0


if __name__ == "__main__":
    sys.exit(main())
