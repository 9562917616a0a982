#!/usr/bin/env python
"""The per-turn cost of a rollout path: WAR's pool against OpenRLHF's agent executor, one engine.

Both paths drive the same engine actor (a plain vLLM engine, ``speculation: none``) with the same
workload: ``--episodes`` episodes of ``--turns`` turns, every turn forced to ``--tokens`` tokens,
tools answering at once (``examples/trace_replay`` with zero delays), so that what differs is
the path a turn takes between two engine requests:

  openrlhf  OpenRLHF's ``SamplesGenerator`` -> ``generate_responses`` on the engine actor ->
            ``MultiTurnAgentExecutor`` inside it (agent, tokenizer and engine in one process)
  war       WAR's ``RolloutPool`` in this process: agent on its episode's thread, a dispatch
            decision, the turn on the engine's turn channel (``turn_transport: direct``), log
            shipping and stats in the background
  war_loop  the same pool with every agent on the pool's event loop (``agent_runner: loop``: no
            thread hop per reset/step, as OpenRLHF runs agents on its actor's loop)
  war_ray   the same pool with a Ray actor call per turn (``turn_transport: ray``)
  war_hosted  the same pool with every episode run beside its engine (``episode_host: engine``,
            agents on the engine actor's loop as OpenRLHF runs them): the pool places each episode
            and sends it whole, no pool hop per turn

Two measurements, each path in rotating order, ``--repeats`` times:

- *latency* (episodes one at a time): per turn, the wall time minus the engine's own time in
  vLLM (``WarEngine``'s ``request_seconds``: submission to final output): what a trajectory
  waits per turn beyond generation, on its critical path;
- *throughput* (all episodes at once): turns per second of the whole batch.

For ``war``, ``war_loop`` and ``war_hosted``, the driver is profiled (cProfile) in one extra run per mode, its CPU time per turn
grouped by where it goes (Ray client, asyncio, agent thread hops, dispatch, log shipping, ...).

  python tools/bench_turn_path.py --json benchmarks/results/pool/turn_path.json
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from war_openrlhf.metrics import format_table, spread, write_json  # noqa: E402

AGENT = ROOT / "examples" / "trace_replay" / "agent.py"
PATHS = ("openrlhf", "war", "war_loop", "war_ray", "war_hosted")
#: the pool paths whose driver is profiled
PROFILED = ("war", "war_loop", "war_hosted")
#: where the pool's driver CPU goes, by the file a function lives in (first match wins)
GROUPS = (("ray client", ("/ray/",)), ("asyncio & threads", ("asyncio/", "threading.py", "concurrent/futures")),
          ("agent & tools", ("trace_replay", "openrlhf/utils/agent")),
          ("tokenizer", ("tokenizers", "transformers/")),
          ("dispatch", ("war_openrlhf/dispatch/",)), ("log shipping & index log", ("log_shipper", "speculation/")),
          ("episode loop", ("rollout/episode", "rollout/trajectory", "rollout/agents")),
          ("turn router & pool", ("rollout/turn_router", "rollout/pool", "rollout/engine_client", "rollout/supervisor",
                                  "rollout/turn_result", "engine/stats")),
          ("numpy", ("numpy/",)),
          ("turn channel: sockets & msgpack", ("engine/turn_channel", "_socket.socket", "msgpack")))

#: built-ins that block (their profiled time is waiting for the engine, not driver CPU)
WAITS = ("poll", "select", "acquire", "sleep", "wait", "recv")


def require_positive(args, names) -> None:
    """Refuse (naming the option) any of ``names`` below 1, before anything starts."""
    for name in names:
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")


def rows_for(episodes: int, turns: int, tokens: int) -> list[dict]:
    """``trace_replay`` rows: one task per episode, one trial of ``turns`` forced turns, no tool delay."""
    trial = {"lengths": [tokens] * turns, "delays": [0.0] * turns, "observations": [" ok."] * turns}
    return [{"prompt": f"Episode {i}: answer in {turns} turns.", "label": json.dumps({"task": i, "trials": [trial]})}
            for i in range(episodes)]


def engine_seconds(handle) -> tuple[int, float]:
    import ray

    s = ray.get(handle.stats.remote())
    return int(s["requests_served"]), float(s["request_seconds"])


def run_openrlhf(handle, rows, tokenizer, max_len):
    from war_openrlhf.baselines.openrlhf_rollout import run_openrlhf_rollout

    _, st = run_openrlhf_rollout([handle], [r["prompt"] for r in rows], [r["label"] for r in rows],
                                 tokenizer=tokenizer, n_samples_per_prompt=1, max_new_tokens=None, max_len=max_len,
                                 temperature=1.0)
    return st["wall_s"]


def pool_config(model, max_len, turn_transport="direct", agent_runner="thread", episode_host="driver"):
    from war_openrlhf.rollout import RolloutConfig

    engine = dict(model=str(model), dtype="float32", max_model_len=max_len, enforce_eager=True, speculation="none")
    return RolloutConfig(num_engines=1, agent_func_path=str(AGENT), n_samples_per_prompt=1, max_turns=1024,
                         max_context_tokens=max_len, temperature=1.0, progress=False, warm_up=False, engine=engine,
                         turn_transport=turn_transport, agent_runner=agent_runner, episode_host=episode_host)


def make_pool(cfg, handle, tokenizer):
    from war_openrlhf.rollout import RolloutPool
    from war_openrlhf.rollout.agents import load_agent_class

    return RolloutPool(cfg, [handle], tokenizer=tokenizer, agent_cls=load_agent_class(AGENT))


def run_war(pool, rows):
    t0 = time.perf_counter()
    pool.run_batch([r["prompt"] for r in rows], [r["label"] for r in rows])
    return time.perf_counter() - t0


def measure(path, handle, pools, rows, tokenizer, max_len, sequential):
    """(wall s, engine request s, requests) of one run: all episodes at once, or one at a time
    (each its own batch: the batch's fixed costs are spread over the episode's turns)."""
    n0, s0 = engine_seconds(handle)
    batches = [[r] for r in rows] if sequential else [rows]
    wall = 0.0
    for b in batches:
        wall += run_openrlhf(handle, b, tokenizer, max_len) if path == "openrlhf" else run_war(pools[path], b)
    n1, s1 = engine_seconds(handle)
    return wall, s1 - s0, n1 - n0


def profile_pool(pool, rows, sequential) -> dict:
    """The driver's time per turn of one pool run, by group (cProfile's own time per function, the
    event loop's thread; agent threads show in the process's CPU total only)."""
    prof = cProfile.Profile()
    cpu0 = time.process_time()
    prof.enable()
    for b in ([[r] for r in rows] if sequential else [rows]):
        run_war(pool, b)
    prof.disable()
    cpu = time.process_time() - cpu0
    groups: dict[str, float] = {}
    top = []
    for (file, line, fn), (_cc, ncalls, tottime, _ct, _callers) in pstats.Stats(prof).stats.items():
        if file == "~" and any(w in fn for w in WAITS):
            name = "waiting (blocked, not CPU)"
        else:
            where = fn if file == "~" else file  # a built-in: its name says what it is
            name = next((g for g, keys in GROUPS if any(k in where for k in keys)), "other")
            top.append((tottime, f"{file.split('site-packages/')[-1]}:{line}({fn})", ncalls))
        groups[name] = groups.get(name, 0.0) + tottime
    top = [{"function": f, "calls": n, "seconds": t} for t, f, n in sorted(top, reverse=True)[:40]]
    return {"process_cpu_s": cpu, "profiled_s_by_group": groups, "top_functions": top}


MODES = ("latency", "throughput")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=16, help="throughput: episodes run at once")
    ap.add_argument("--turns", type=int, default=16, help="throughput: turns per episode")
    ap.add_argument("--latency-episodes", type=int, default=2, help="latency: episodes run one after the other")
    ap.add_argument("--latency-turns", type=int, default=128, help="latency: turns per episode")
    ap.add_argument("--tokens", type=int, default=4, help="forced tokens per turn")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    require_positive(args, ("episodes", "turns", "latency_episodes", "latency_turns", "tokens", "repeats"))

    import ray
    from transformers import AutoTokenizer

    from war_openrlhf.engine.actors import create_war_engines
    from war_openrlhf.fixtures.tiny_model import build_tiny_model

    model = build_tiny_model(ROOT / ".cache" / "war_tiny_llama")
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    max_len = 2048
    work = {"latency": rows_for(args.latency_episodes, args.latency_turns, args.tokens),
            "throughput": rows_for(args.episodes, args.turns, args.tokens)}
    turns = {"latency": args.latency_episodes * args.latency_turns, "throughput": args.episodes * args.turns}
    ray.init(num_cpus=4 + (os.cpu_count() or 1), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    try:
        cfg = pool_config(model, max_len)
        handle = create_war_engines(1, cfg.engine, agent_func_path=str(AGENT))[0]
        pools = {"war": make_pool(cfg, handle, tokenizer),
                 "war_loop": make_pool(pool_config(model, max_len, agent_runner="loop"), handle, tokenizer),
                 "war_ray": make_pool(pool_config(model, max_len, "ray"), handle, tokenizer),
                 "war_hosted": make_pool(pool_config(model, max_len, agent_runner="loop", episode_host="engine"),
                                         handle, tokenizer)}
        for path in PATHS:  # first-use costs (imports, the executor's agent module) stay out of the runs
            measure(path, handle, pools, work["throughput"][:2], tokenizer, max_len, sequential=False)
        runs = {(p, m): [] for p in PATHS for m in MODES}
        for r in range(args.repeats):
            for mode in MODES:
                for path in PATHS[r % len(PATHS):] + PATHS[:r % len(PATHS)]:
                    wall, eng_s, requests = measure(path, handle, pools, work[mode], tokenizer, max_len,
                                                    mode == "latency")
                    if requests != turns[mode]:
                        raise SystemExit(f"{path}: the engine served {requests} requests for {turns[mode]} turns")
                    runs[(path, mode)].append({"wall_s": wall, "engine_s": eng_s})
                    print(f"  {mode} {path} run {r}: {wall:.2f} s, engine {eng_s:.2f} s", file=sys.stderr, flush=True)
        profiles = {(path, mode): profile_pool(pools[path], work[mode], mode == "latency")
                    for path in PROFILED for mode in MODES}
        for pool in pools.values():
            pool.shutdown()
    finally:
        ray.shutdown()

    rows_out = []
    for mode in MODES:
        n = turns[mode]
        for path in PATHS:
            rs = runs[(path, mode)]
            row = {"mode": mode, "path": path, "turns": n,
                   "wall_per_turn_us": spread([1e6 * x["wall_s"] / n for x in rs]),
                   "turns_per_s": spread([n / x["wall_s"] for x in rs])}
            if mode == "latency":
                row["path_per_turn_us"] = spread([1e6 * (x["wall_s"] - x["engine_s"]) / n for x in rs])
                row["engine_per_turn_us"] = spread([1e6 * x["engine_s"] / n for x in rs])
            for k in list(row):
                if isinstance(row[k], dict):
                    row[f"{k}_median"] = row[k]["median"]
            rows_out.append(row)
    lat = {r["path"]: r for r in rows_out if r["mode"] == "latency"}
    ratio = lat["war"]["path_per_turn_us_median"] / lat["openrlhf"]["path_per_turn_us_median"]
    ratios = {p: lat[p]["path_per_turn_us_median"] / lat["openrlhf"]["path_per_turn_us_median"]
              for p in PATHS if p != "openrlhf"}
    profile_rows = [{"path": path, "mode": mode, "group": g, "driver_cpu_per_turn_us": 1e6 * s / turns[mode]}
                    for (path, mode), p in profiles.items()
                    for g, s in sorted(p["profiled_s_by_group"].items(), key=lambda kv: -kv[1])]
    for (path, mode), p in profiles.items():
        profile_rows.append({"path": path, "mode": mode, "group": "process CPU total (every thread)",
                             "driver_cpu_per_turn_us": 1e6 * p["process_cpu_s"] / turns[mode]})
    print(format_table(rows_out, [("mode", "mode", ""), ("path", "path", ""),
                                  ("wall_per_turn_us_median", "wall us/turn", ".0f"),
                                  ("path_per_turn_us_median", "path us/turn", ".0f"),
                                  ("turns_per_s_median", "turns/s", ".1f")]))
    print("path per turn x openrlhf's (latency): " + ", ".join(f"{p} {r:.2f}" for p, r in ratios.items()))
    print(format_table(profile_rows, [("path", "path", ""), ("mode", "mode", ""), ("group", "group", ""),
                                      ("driver_cpu_per_turn_us", "driver us/turn", ".0f")]))
    write_json(args.json, {
        "benchmark": "turn_path",
        "regime": (f"one plain CPU engine shared by both paths, {args.tokens} forced tokens a turn, tools instant; "
                   f"latency: {args.latency_episodes} episodes x {args.latency_turns} turns one after the other, "
                   f"throughput: {args.episodes} episodes x {args.turns} turns at once"),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "rows": rows_out, "profile": profile_rows, "war_path_x_openrlhf_path": ratio, "path_x_openrlhf_path": ratios,
        "top_functions": {f"{path}/{mode}": p["top_functions"] for (path, mode), p in profiles.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
