"""End-to-end rollout benchmark: OpenRLHF 0.11.2's own rollout path vs the WAR pool.

    python tools/bench_rollout.py --task arithmetic_calculator --engines 2 --load low \
        --json results/bench_rollout_arith_low.json

One process, the same prompts (the task's ``dataset.generate(n, seed)``), the same model and
the same engine count, one synchronous rollout step per run (all episodes start together; the
step ends when the last one ends). Configurations:

* ``baseline``: OpenRLHF's path (:mod:`war_openrlhf.baselines.openrlhf_rollout`): its
  ``RolloutRayActor`` engines with vLLM's default configuration, its least-loaded dispatch of
  whole prompts (n samples each), its ``MultiTurnAgentExecutor`` inside the engine actor.
* ``war``: the WAR pool, ``war`` dispatch per turn, speculation ``auto`` (load-aware switch).
* ``spec_only``: the WAR pool with OpenRLHF's placement (``least_loaded``: a prompt's samples
  stay on one engine), speculation ``auto``.
* ``sched_only``: the WAR pool, ``war`` dispatch, speculation ``off``.
* ``pool_plain``: the WAR pool with OpenRLHF's placement and speculation off: the pool's own
  overhead against OpenRLHF's executor, with neither mechanism.

The WAR configurations share one set of engines (started once): before each run every
engine's prefix cache is reset (as after a weight update), the new pool starts every engine's
suffix index afresh, and the speculation mode is set. The per-turn token budget is OpenRLHF's: ``max_len`` minus the context so far.
``--repeats`` runs every configuration that many times in rotating order and reports the
median run. Loads: ``low`` = ``--low-prompts`` prompts per engine, ``high`` =
``--high-prompts`` (x ``--n-samples`` episodes each).

Model (``--model``): ``random`` (default) is the random-init tiny model built locally, or a
model directory (a real model). On a
CUDA machine the same command runs the real engines (CUDA vLLM) unchanged; pass a real model
directory with ``--model``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TASKS = ("arithmetic_calculator", "sql_qa", "doc_lookup")
CONFIGS = ("baseline", "war", "spec_only", "sched_only", "pool_plain")
WAR_CONFIGS = {  # name -> (dispatch policy, speculation mode)
    "war": ("war", "auto"),
    "spec_only": ("least_loaded", "auto"),
    "sched_only": ("war", "off"),
    "pool_plain": ("least_loaded", "off"),
}


def load_task(name: str):
    """(dataset module, agent file) of an example task."""
    if name not in TASKS:
        raise SystemExit(f"--task: unknown task {name!r}; known: {', '.join(TASKS)}")
    d = ROOT / "examples" / name
    spec = importlib.util.spec_from_file_location(f"war_bench_{name}_dataset", d / "dataset.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod, d / "agent.py"


def resolve_model(arg: str) -> Path:
    if arg == "random":
        from war_openrlhf.fixtures.tiny_model import build_tiny_model

        return build_tiny_model(ROOT / ".cache" / "war_tiny_llama")
    p = Path(arg)
    if not (p / "config.json").is_file():
        raise SystemExit(f"--model: {arg} is neither 'random' nor a model directory")
    return p


def _engine_totals(stats):
    from war_openrlhf.engine.stats import COUNTERS

    return {k: sum(getattr(s, k) for s in stats) for k in COUNTERS}


def run_war(handles, cfg_kwargs, name, prompts, labels, n, tokenizer, agent_cls):
    import ray

    from war_openrlhf.rollout import RolloutConfig, RolloutPool

    policy, mode = WAR_CONFIGS[name]
    ray.get([h.reset_prefix_cache.remote() for h in handles])  # the pool resets the suffix index
    ray.get([h.set_speculation.remote(mode) for h in handles])
    kw = dict(cfg_kwargs)
    if policy == "least_loaded":
        kw["dispatch_kwargs"] = {"n_samples_per_prompt": n}
    cfg = RolloutConfig(dispatch_policy=policy, n_samples_per_prompt=n, **kw)
    pool = RolloutPool(cfg, handles, tokenizer=tokenizer, agent_cls=agent_cls)
    before = _engine_totals(asyncio.run(pool.engine_stats()))
    res = pool.run_batch(prompts, labels)
    after = _engine_totals(res.engine_stats)
    d = {k: after[k] - before[k] for k in after}
    drafts = d["spec_drafts"]
    spec = [s.spec_step_fraction for s in res.engine_stats]
    return {
        "wall_s": res.wall_s, "generated_tokens": res.generated_tokens, "tokens_per_s": res.tokens_per_s,
        "trajectories": len(res.trajectories), "turns": res.turns,
        "prefix_hit_rate": res.prefix_hit_rate,
        "engine_prefix_hit_rate": d["prefix_cache_hits"] / d["prefix_cache_queries"] if d["prefix_cache_queries"] else None,
        "tokens_per_engine_step": d["generation_tokens"] / d["steps"] if d["steps"] else None,
        "mean_accepted_per_draft": d["spec_accepted_tokens"] / drafts if drafts else 0.0,
        "speculating_fraction": [None if f is None else round(f, 3) for f in spec],
        "engine_turns": res.engine_turns, "deferrals": res.deferrals, "end_reasons": res.end_reasons,
        "mean_reward": res.summary()["mean_reward"],
    }


def run_baseline(engines, prompts, labels, n, tokenizer, max_len, temperature):
    from war_openrlhf.baselines.openrlhf_rollout import run_openrlhf_rollout

    exps, st = run_openrlhf_rollout(engines, prompts, labels, tokenizer=tokenizer, n_samples_per_prompt=n,
                                    max_new_tokens=None, max_len=max_len, temperature=temperature)
    rewards = [float(e.rewards[0]) for e in exps if e.rewards is not None]
    return {"wall_s": st["wall_s"], "generated_tokens": st["action_tokens"], "tokens_per_s": st["tokens_per_s"],
            "trajectories": st["trajectories"], "prefix_hit_rate": None,
            "engine_turns": st.get("trajectories_per_engine"),
            "mean_reward": sum(rewards) / len(rewards) if rewards else None}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", default="arithmetic_calculator", choices=TASKS)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--load", choices=("low", "high"), default="low")
    ap.add_argument("--json", required=True)
    ap.add_argument("--model", default="random")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--n-samples", type=int, default=4)
    ap.add_argument("--low-prompts", type=int, default=1, help="prompts per engine at low load")
    ap.add_argument("--high-prompts", type=int, default=8, help="prompts per engine at high load")
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-speculative-tokens", type=int, default=8)
    args = ap.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for c in configs:
        if c not in CONFIGS:
            raise SystemExit(f"--configs: unknown configuration {c!r}; known: {', '.join(CONFIGS)}")
    if args.engines < 1 or args.repeats < 1:
        raise SystemExit("--engines and --repeats must be >= 1")

    import ray
    from transformers import AutoTokenizer

    from war_openrlhf.device import cuda_available
    from war_openrlhf.engine.actors import create_war_engines
    from war_openrlhf.engine.config import EngineConfig
    from war_openrlhf.rollout import load_agent_class

    dataset, agent_file = load_task(args.task)
    model = resolve_model(args.model)
    per_engine = args.low_prompts if args.load == "low" else args.high_prompts
    rows = dataset.generate(per_engine * args.engines, args.seed)
    prompts, labels = [r["prompt"] for r in rows], [r["label"] for r in rows]
    n = args.n_samples
    cuda = cuda_available()
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    agent_cls = load_agent_class(agent_file)
    # CPU: logical CPUs for both engine sets (the WAR engines' placement group keeps its bundles)
    ray.init(num_cpus=None if cuda else 2 * args.engines + (os.cpu_count() or 1), include_dashboard=False,
             log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    dtype = "bfloat16" if cuda else "float32"
    cfg_kwargs = dict(num_engines=args.engines, agent_func_path=str(agent_file), max_turns=64,
                      max_context_tokens=args.max_len, max_new_tokens_per_turn=args.max_len - 2,
                      temperature=args.temperature, seed=None, progress=False,
                      engine=dict(model=str(model), dtype=dtype, max_model_len=args.max_len,
                                  enforce_eager=not cuda, num_speculative_tokens=args.num_speculative_tokens))
    results = {c: [] for c in configs}
    war_names = [c for c in configs if c in WAR_CONFIGS]
    t_all = time.time()
    if war_names:
        from war_openrlhf.rollout import RolloutConfig

        ecfg = RolloutConfig(**cfg_kwargs).engine
        handles = create_war_engines(args.engines, ecfg, placement_group=True)
        run_war(handles, cfg_kwargs, war_names[0], prompts[:args.engines], labels[:args.engines], 1, tokenizer,
                agent_cls)  # warm-up
        for r in range(args.repeats):
            order = war_names[r % len(war_names):] + war_names[:r % len(war_names)]
            for name in order:
                out = run_war(handles, cfg_kwargs, name, prompts, labels, n, tokenizer, agent_cls)
                results[name].append(out)
                print(f"  {name} run {r}: {out['tokens_per_s']:.0f} tok/s, {out['wall_s']:.1f} s", file=sys.stderr)
        for h in handles:
            ray.get(h.shutdown.remote())
            ray.kill(h)
    if "baseline" in configs:
        from war_openrlhf.baselines.openrlhf_rollout import start_openrlhf_engines, stop_openrlhf_engines

        engines = start_openrlhf_engines(args.engines, model, agent_func_path=str(agent_file),
                                         max_model_len=args.max_len, seed=0)
        run_baseline(engines, prompts[:args.engines], labels[:args.engines], 1, tokenizer, args.max_len,
                     args.temperature)  # warm-up
        for r in range(args.repeats):
            out = run_baseline(engines, prompts, labels, n, tokenizer, args.max_len, args.temperature)
            results["baseline"].append(out)
            print(f"  baseline run {r}: {out['tokens_per_s']:.0f} tok/s, {out['wall_s']:.1f} s", file=sys.stderr)
        stop_openrlhf_engines(engines)
    ray.shutdown()

    def median_run(runs):
        return sorted(runs, key=lambda x: x["tokens_per_s"])[len(runs) // 2]

    summary = {c: median_run(results[c]) for c in configs if results[c]}
    base = summary.get("baseline", {}).get("tokens_per_s")
    for c, d in summary.items():
        d["x_baseline"] = d["tokens_per_s"] / base if base else None
        d["tokens_per_s_runs"] = [round(x["tokens_per_s"], 1) for x in results[c]]
    out = {"command": " ".join(["python"] + sys.argv), "machine": platform.platform(), "cuda": cuda,
           "task": args.task, "engines": args.engines, "load": args.load, "prompts": len(prompts),
           "n_samples": n, "episodes": len(prompts) * n, "model": str(model), "max_len": args.max_len,
           "temperature": args.temperature, "repeats": args.repeats, "wall_s": time.time() - t_all,
           "summary": summary, "runs": results}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    print(f"\n### {args.task}, {args.engines} engines, load {args.load}: {len(prompts)} prompts x {n} samples "
          f"= {len(prompts) * n} episodes (median of {args.repeats})\n")
    print("| config | step s | tok/s | x baseline | prefix hit | tokens/engine step | accepted/draft | "
          "speculating | mean reward |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|")
    for c, d in summary.items():
        def f(v, fmt):
            return "n/a" if v is None else format(v, fmt)
        print(f"| {c} | {d['wall_s']:.2f} | {d['tokens_per_s']:,.0f} | {f(d['x_baseline'], '.2f')} | "
              f"{f(d.get('prefix_hit_rate'), '.3f')} | {f(d.get('tokens_per_engine_step'), '.2f')} | "
              f"{f(d.get('mean_accepted_per_draft'), '.2f')} | {d.get('speculating_fraction', 'n/a')} | "
              f"{f(d.get('mean_reward'), '.3f')} |")
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
