#!/usr/bin/env python
"""One engine's decode throughput vs batch size, with and without speculation.

Configs, one real vLLM engine each (started one after the other, same prompts):

  off           vLLM without speculative decoding
  vllm_suffix   vLLM's per-engine suffix method (its cache warmed by the earlier round)
  war_off       WAR's engine with drafting forced off (what the switch chooses when off)
  war_on        WAR's replica, forced on (pre-filled with the earlier round's records)
  war_auto      WAR's replica with the load-aware switch deciding per step

The "earlier round" is the same prompts' greedy outputs with every ``--perturb``-th
token changed (GRPO siblings that agree most of the way); the measured round decodes
the prompts greedily, so drafts are partly accepted, partly rejected. The tool also
writes the step-latency table the switch learnt and where it landed per batch size.

Example:
  python tools/bench_engine.py --json results/bench_engine.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("VLLM_CACHE_ROOT", str(ROOT / ".cache" / "vllm"))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
# engine core and worker in this process: on a 2-core machine the 3-process layout
# (driver, engine core busy loop, worker) makes step times noisy
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)

from war_openrlhf.metrics import format_table, write_json  # noqa: E402
from war_openrlhf.metrics.vllm_metrics import spec_decode_counters  # noqa: E402

CONFIGS = ("off", "vllm_suffix", "war_off", "war_on", "war_auto")


def _perturb(tokens, every, vocab):
    bad = list(tokens)
    for j in range(every // 2, len(bad), every):
        bad[j] = (bad[j] + 1) % vocab
    return bad


_spec = spec_decode_counters


def prompt_sets(prompts, batches, repeats):
    """Disjoint prompt sets per (batch size, repeat): no config may learn from the
    measured rounds themselves, only from the earlier round."""
    sets, i = {}, 0
    for b in batches:
        for r in range(repeats):
            sets[(b, r)] = list(range(i, i + b))
            i += b
    return sets


def run_config(name, model, prompts, earlier, batches, new_tokens, k, repeats, engine_args):
    from vllm import LLM, SamplingParams

    from war_openrlhf.engine.rpc import (RPC_APPLY_LOG, RPC_INDEX_STATS, RPC_INSTALL_INDEX,
                                         RPC_SEED_VLLM_SUFFIX_CACHE, war_engine_kwargs)
    from war_openrlhf.engine.wire import entries_to_wire
    from war_openrlhf.speculation import CompletedSequence, CompletedSequenceLog, SuffixIndexConfig

    kwargs = dict(engine_args)
    if name == "vllm_suffix":
        kwargs["speculative_config"] = {"method": "suffix", "num_speculative_tokens": k}
        kwargs["worker_extension_cls"] = war_engine_kwargs()["worker_extension_cls"]  # only to seed its cache
    elif name.startswith("war"):
        kwargs.update(war_engine_kwargs(num_speculative_tokens=k))
    t0 = time.perf_counter()
    llm = LLM(model=str(model), **kwargs)
    start_s = time.perf_counter() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    try:
        if name == "vllm_suffix":  # vLLM's own cache holds the earlier round, as if it had generated it
            import numpy as np

            items = [{"prompt": np.asarray(p, dtype="<i4").tobytes(), "response": np.asarray(e, dtype="<i4").tobytes()}
                     for p, e in zip(prompts, earlier)]
            llm.collective_rpc(RPC_SEED_VLLM_SUFFIX_CACHE, args=(items,))
        if name.startswith("war"):
            mode = {"war_on": "on", "war_off": "off"}.get(name, "auto")
            llm.collective_rpc(RPC_INSTALL_INDEX, args=({}, {}, mode))
            log = CompletedSequenceLog()
            for i, (p, e) in enumerate(zip(prompts, earlier)):
                log.append(CompletedSequence.create(f"earlier{i}", "g", 0, p, e))
            llm.collective_rpc(RPC_APPLY_LOG, args=(entries_to_wire(log.read(0)),))
        llm.generate([{"prompt_token_ids": [7, 8, 9, 10]}], sp, use_tqdm=False)  # warm-up
        sets = prompt_sets(prompts, batches, repeats)
        rows = []
        for b in batches:
            best = None
            before = _spec(llm)
            sw0 = llm.collective_rpc(RPC_INDEX_STATS, args=(False,))[0]["switch"] if name.startswith("war") else None
            for r in range(repeats):
                batch = [{"prompt_token_ids": prompts[i]} for i in sets[(b, r)]]
                llm.reset_prefix_cache()
                t0 = time.perf_counter()
                outs = llm.generate(batch, sp, use_tqdm=False)
                dt = time.perf_counter() - t0
                toks = sum(len(o.outputs[0].token_ids) for o in outs)
                best = max(best or 0.0, toks / dt)
            after = _spec(llm)
            row = {"config": name, "batch": b, "tokens_per_s": best,
                   "draft_tokens": after["num_draft_tokens"] - before["num_draft_tokens"],
                   "accepted_tokens": after["num_accepted_tokens"] - before["num_accepted_tokens"]}
            if name.startswith("war"):
                st = llm.collective_rpc(RPC_INDEX_STATS, args=(True,))[0]
                sw1 = st["switch"]
                steps = sw1["steps"] - sw0["steps"]
                spec = sw1["spec_step_fraction"] * sw1["steps"] - sw0["spec_step_fraction"] * sw0["steps"]
                row["spec_step_fraction"] = spec / steps if steps else 0.0
                row["switch_gain"] = st["switch"]["expected_gain"]
                row["switch_reason"] = st["switch"]["decision_reason"]
                row["table"] = st["switch"]["table"]
            rows.append(row)
            print(f"  {name:12s} batch {b:3d}: {best:8.0f} tok/s", flush=True)
        return start_s, rows
    finally:
        _shutdown(llm)


def _shutdown(llm):
    import gc

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / ".cache" / "war_tiny_llama",
                    help="model directory (built locally if missing)")
    ap.add_argument("--batches", default="1,2,4,8,16,32")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--perturb", type=int, default=8, help="every n-th token of the earlier round changed")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    from vllm import LLM, SamplingParams

    from war_openrlhf.fixtures.tiny_model import build_tiny_model

    batches = [int(b) for b in args.batches.split(",")]
    model = build_tiny_model(args.model) if not (args.model / "config.json").exists() else args.model
    engine_args = dict(enforce_eager=True, dtype="float32", max_model_len=1024, max_num_seqs=max(batches),
                       seed=0, disable_log_stats=False)
    import numpy as np

    rng = np.random.default_rng(0)
    n_prompts = sum(batches) * args.repeats
    prompts = [rng.integers(10, 500, size=int(rng.integers(16, 48))).tolist() for _ in range(n_prompts)]
    # the earlier round: greedy outputs of the same prompts, perturbed
    ref = LLM(model=str(model), **engine_args)
    try:
        outs = ref.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True),
                            use_tqdm=False)
        earlier = [_perturb(o.outputs[0].token_ids, args.perturb, 512) for o in outs]
    finally:
        _shutdown(ref)

    results, starts = {}, {}
    for name in [c.strip() for c in args.configs.split(",") if c.strip()]:
        if name not in CONFIGS:
            print(f"error: --configs: unknown config '{name}' (known: {', '.join(CONFIGS)})", file=sys.stderr)
            return 2
        starts[name], results[name] = run_config(name, model, prompts, earlier, batches, args.new_tokens,
                                                 args.k, args.repeats, engine_args)

    table = []
    for i, b in enumerate(batches):
        row = {"batch": b}
        for name, rows in results.items():
            row[name] = rows[i]["tokens_per_s"]
        if "war_auto" in results:
            row["auto_spec_frac"] = results["war_auto"][i]["spec_step_fraction"]
        if {"war_off", "war_on", "war_auto"} <= set(results):
            row["auto_vs_best_fixed"] = row["war_auto"] / max(row["war_off"], row["war_on"])
        if {"off", "war_auto"} <= set(results):
            row["auto_vs_off"] = row["war_auto"] / row["off"]
        table.append(row)
    cols = [("batch", "batch", "d")] + [(n, f"{n} tok/s", ".0f") for n in results]
    cols += [("auto_spec_frac", "auto: spec frac", ".2f"), ("auto_vs_best_fixed", "auto / best(war on, war off)", ".2f"),
             ("auto_vs_off", "auto / plain off", ".2f")]
    print(format_table(table, cols))
    curve = results.get("war_auto", [{}])[-1].get("table")
    out = write_json(args.json, {"benchmark": "engine_batch_sweep", "k": args.k, "new_tokens": args.new_tokens,
                                 "perturb_every": args.perturb, "engine_start_s": starts, "table": table,
                                 "results": results, "switch_curve": curve})
    if out:
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
