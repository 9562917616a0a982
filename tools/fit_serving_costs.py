#!/usr/bin/env python
"""Fit the simulator's machine model to the engines as a rollout runs them.

    python tools/fit_serving_costs.py --model .cache/war_tiny_llama_peaked_32768 --max-len 16384 \\
        --json benchmarks/results/engine/cost_serving_cpu_peaked.json

``bench_engine.py --fit-costs`` prices a step of one vLLM engine inside its own process with the
machine to itself: the engine core's compute. A rollout pays more per step: its engines are Ray
actors, each with vLLM's front-end and engine-core processes, WAR's drafting hooks, and on a CPU
node they share the host's cores with each other and with the driver. This tool measures the
same step shapes (prefills of 256-16k tokens; 48 decode steps of 1-16 sequences over 64-8k token
contexts) through the rollout's own engine actors (``create_war_engines``, one core each,
drafting forced off), timed where the engine actor sees each request start and end, in two
phases per repeat and shape, in rotating order:

* ``alone``: engine 0 runs the shape while the others idle: the cost model's step costs are
  fitted to these (``simulation.fit.fit_cost_model``, as ``--fit-costs`` does);
* ``together``: every engine runs the shape at once: ``contention`` is the median over shapes of
  (seconds together) / (seconds alone): how much a step slows when all the engines compute at
  once. The simulator scales each step by it in proportion to the other engines busy
  (``CostModel.contention``; 1 = independent accelerators, as GPUs are).

The drafting costs (``spec_step_s``, ``draft_token_s``, ``draft_context_token_s``) are taken from an in-process fit
(``--spec-costs FILE`` from ``bench_engine.py --fit-costs``) when given.

``--engine-kind``: ``speculative`` (the default) measures WAR's drafting engines, which carry a
speculative config even with drafting off; ``plain`` measures engines without one, as OpenRLHF
runs its own (in vLLM 0.29 a speculative config alone changes the engine, e.g. it switches
async scheduling off). The simulator prices each configuration with the fit of the engines it
ran on (``bench_rollout.engine_kind``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _run_shape(handles, b: int, c: int, m: int, rng, vocab: int) -> list[float]:
    """Each engine in ``handles`` runs ``b`` fresh prompts of ``c`` tokens, ``m + 1`` tokens each,
    all at once; per engine, seconds from its first request's start to its last one's end as the
    engine actor times them."""
    import ray

    sp = {"temperature": 0.0, "max_tokens": m + 1, "ignore_eos": True}
    refs = [[h.generate_tokens.remote(rng.integers(10, vocab - 10, size=c).astype("int32"), sp) for _ in range(b)]
            for h in handles]
    out = []
    for engine_refs in refs:
        results = ray.get(engine_refs)
        out.append(max(r["seconds"] for r in results))
    return out


def measure(handles, max_len: int, repeats: int, chunk: int, vocab: int, seed: int = 0):
    """``(alone runs, together seconds per shape)``: StepRuns of engine 0 alone (the median of
    ``repeats``) and, per shape, the median over repeats and engines of the seconds with every
    engine running it."""
    import numpy as np
    from bench_engine import fit_shapes, step_run
    from tqdm import tqdm

    rng = np.random.default_rng(seed)
    _run_shape(handles, 1, 64, 4, rng, vocab)  # warm-up
    todo = fit_shapes(max_len)
    alone = {s: [] for s in todo}
    together = {s: [] for s in todo}
    with tqdm(total=len(todo) * repeats, desc="shapes", unit="shape") as bar:
        for rep in range(repeats):
            for i, s in enumerate(todo):
                phases = ("alone", "together") if (rep + i) % 2 == 0 else ("together", "alone")
                for phase in phases:  # rotating order: a slow phase of the machine hits both
                    if phase == "alone":
                        alone[s].append(_run_shape(handles[:1], *s, rng, vocab)[0])
                    else:
                        together[s].extend(_run_shape(handles, *s, rng, vocab))
                bar.update()
    runs = [step_run(b, c, m, chunk, statistics.median(secs)) for (b, c, m), secs in alone.items()]
    ratios = {f"{b}x{c}+{m}": statistics.median(together[(b, c, m)]) / statistics.median(alone[(b, c, m)])
              for (b, c, m) in todo}
    return runs, ratios, {f"{b}x{c}+{m}": {"alone": alone[(b, c, m)], "together": together[(b, c, m)]}
                          for (b, c, m) in todo}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--max-len", type=int, default=16384)
    ap.add_argument("--engines", type=int, default=2, help="engines, as the rollout runs them (default 2)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--spec-costs", type=Path, default=None,
                    help="an in-process fit (bench_engine.py --fit-costs) whose drafting costs to keep")
    ap.add_argument("--engine-kind", choices=("speculative", "plain"), default="speculative",
                    help="speculative: WAR's drafting engines, drafting off; plain: no speculative config, as "
                         "OpenRLHF's own engines")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args(argv)
    import ray

    from war_openrlhf.engine.actors import create_war_engines
    from war_openrlhf.engine.config import EngineConfig
    from war_openrlhf.metrics import format_table, write_json
    from war_openrlhf.simulation.cost_model import get_preset
    from war_openrlhf.simulation.fit import fit_cost_model

    ray.init(num_cpus=4 * args.engines + (os.cpu_count() or 1), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    plain = args.engine_kind == "plain"
    cfg = EngineConfig(model=str(args.model), dtype="float32", max_model_len=args.max_len, enforce_eager=True,
                       speculation="none" if plain else "auto")
    t0 = time.time()
    handles = create_war_engines(args.engines, cfg, placement_group=True)
    try:
        if not plain:
            ray.get([h.set_speculation.remote("off") for h in handles])
        info = ray.get(handles[0].stats.remote())
        limits = {"kv_capacity_tokens": int(info["kv_capacity_tokens"]), "block_size": int(info["kv_block_size"]),
                  "max_num_seqs": int(info["max_num_seqs"]), "max_num_batched_tokens": int(info["max_num_batched_tokens"])}
        vocab = int(json.loads((args.model / "config.json").read_text())["vocab_size"])
        runs, ratios, raw = measure(handles, args.max_len, args.repeats, limits["max_num_batched_tokens"], vocab)
    finally:
        for h in handles:
            ray.kill(h)
        ray.shutdown()
    contention = statistics.median(ratios.values())
    model, report = fit_cost_model(runs, name=f"serving{'-plain' if plain else ''}:{args.model.name}", **limits)
    extra = {"contention": round(contention, 4)}
    if args.spec_costs is not None:
        spec = get_preset(str(args.spec_costs))
        extra.update(spec_step_s=spec.spec_step_s, draft_token_s=spec.draft_token_s,
                     draft_context_token_s=spec.draft_context_token_s)
    model = model.with_overrides(**extra)
    rows = [{"shape": k, "alone_ms": 1e3 * statistics.median(v["alone"]),
             "together_ms": 1e3 * statistics.median(v["together"]), "ratio": ratios[k]} for k, v in raw.items()]
    print(format_table(rows, [("shape", "b x prompt + decode steps", ""), ("alone_ms", "alone ms", ".1f"),
                              ("together_ms", f"all {args.engines} at once ms", ".1f"), ("ratio", "ratio", ".3f")]))
    print("fitted:", {k: f"{v:.3g}" for k, v in report["costs"].items()},
          f"contention {contention:.3f}, max relative error of the fit {report['max_relative_error']:.1%}")
    out = write_json(args.json, {"benchmark": "engine_step_costs_serving", "model": str(args.model),
                                 "engine_kind": args.engine_kind,
                                 "max_model_len": args.max_len, "engines": args.engines, "repeats": args.repeats,
                                 "cost_model": model.to_dict(), "fit": report, "contention_by_shape": ratios,
                                 "runs_s": raw, "spec_costs_from": None if args.spec_costs is None else str(args.spec_costs),
                                 "wall_s": round(time.time() - t0, 1)})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
