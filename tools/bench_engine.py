#!/usr/bin/env python
"""One engine's decode throughput vs batch size, with and without speculation.

Configs, one real vLLM engine each (all started first, in one process; each repeat of a batch
size then runs every configuration in rotating order on the same prompts):

  off           vLLM without speculative decoding
  vllm_suffix   vLLM's per-engine suffix method (its cache warmed by the earlier round)
  war_off       WAR's engine with drafting forced off (what the switch chooses when off)
  war_on        WAR's replica, forced on (pre-filled with the earlier round's records), drafts cut
                where a token stops paying for its verification (the switch's cost-aware rule)
  war_on_fixed_rule  the same with WAR's fixed rule (2x the match length, min prob 0.1)
  war_on_vllm_rule  the same with vLLM's draft rule (depth 24, max_spec_factor 1, min prob
                0.1: vLLM's suffix defaults): same records, same rule, so the difference
                to vllm_suffix is what WAR's drafter machinery costs
  war_auto      WAR's replica with the load-aware switch deciding per step

The "earlier round" is the same prompts' greedy outputs with every ``--perturb``-th
token changed (GRPO siblings that agree most of the way); the measured round decodes
the prompts greedily, so drafts are partly accepted, partly rejected. The tool also
writes the step-latency table the switch learnt and where it landed per batch size.
Tokens/s per batch size is the median of ``--repeats`` runs on disjoint prompts; the JSON keeps
every run (``tokens_per_s_runs``) and the min-max.

Example:
  python tools/bench_engine.py --json benchmarks/results/engine/bench_engine.json
  python tools/bench_engine.py --fit-costs benchmarks/results/engine/cost_cpu_peaked.json \
      --model .cache/war_tiny_llama_peaked_32768 --max-len 32768 --repeats 3
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
# (driver, engine core busy loop, worker) makes step times noisy (3-5x between identical
# runs of --fit-costs; in-process, the spread is what the fit's report shows)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)

from war_openrlhf.metrics import format_table, spread, write_json  # noqa: E402
from war_openrlhf.metrics.vllm_metrics import SPEC_COUNTERS, engine_spec_decode_counters  # noqa: E402

CONFIGS = ("off", "vllm_suffix", "war_off", "war_on", "war_on_vllm_rule", "war_on_fixed_rule", "war_auto")
# vLLM 0.29's SpeculativeConfig suffix defaults (suffix_decoding_max_tree_depth, _max_spec_factor,
# _min_token_prob): WAR's index configured to draft by the same rule.
VLLM_SUFFIX_RULE = {"max_tree_depth": 24, "max_spec_factor": 1.0, "min_token_prob": 0.1}


def _perturb(tokens, every, vocab):
    bad = list(tokens)
    for j in range(every // 2, len(bad), every):
        bad[j] = (bad[j] + 1) % vocab
    return bad


def prompt_sets(prompts, batches, repeats):
    """Disjoint prompt sets per (batch size, repeat): no config may learn from the
    measured rounds themselves, only from the earlier round."""
    sets, i = {}, 0
    for b in batches:
        for r in range(repeats):
            sets[(b, r)] = list(range(i, i + b))
            i += b
    return sets


def start_config(name, model, prompts, earlier, k, engine_args):
    """``(llm, start seconds)``: configuration ``name``'s engine, its drafter holding the earlier
    round (vLLM's own cache or WAR's index), warmed up."""
    from vllm import LLM, SamplingParams

    from war_openrlhf.engine.rpc import (RPC_APPLY_LOG, RPC_INSTALL_INDEX,
                                         RPC_SEED_VLLM_SUFFIX_CACHE, war_engine_kwargs)
    from war_openrlhf.engine.wire import entries_to_wire
    from war_openrlhf.speculation import CompletedSequence, CompletedSequenceLog

    kwargs = dict(engine_args)
    if name == "vllm_suffix":
        kwargs["speculative_config"] = {"method": "suffix", "num_speculative_tokens": k}
        kwargs["worker_extension_cls"] = war_engine_kwargs()["worker_extension_cls"]  # only to seed its cache
    elif name.startswith("war"):
        kwargs.update(war_engine_kwargs(num_speculative_tokens=k))
    t0 = time.perf_counter()
    llm = LLM(model=str(model), **kwargs)
    start_s = time.perf_counter() - t0
    try:
        if name == "vllm_suffix":  # vLLM's own cache holds the earlier round, as if it had generated it
            import numpy as np

            items = [{"prompt": np.asarray(p, dtype="<i4").tobytes(), "response": np.asarray(e, dtype="<i4").tobytes()}
                     for p, e in zip(prompts, earlier)]
            llm.collective_rpc(RPC_SEED_VLLM_SUFFIX_CACHE, args=(items,))
        if name.startswith("war"):
            mode = {"war_on": "on", "war_on_vllm_rule": "on", "war_on_fixed_rule": "on", "war_off": "off"}.get(name, "auto")
            index_config = VLLM_SUFFIX_RULE if name == "war_on_vllm_rule" else {}
            # a fixed draft rule: the index's own min_token_prob, no cost-aware cut-off
            switch_config = {"cost_aware_drafts": False} if name in ("war_on_vllm_rule", "war_on_fixed_rule") else {}
            llm.collective_rpc(RPC_INSTALL_INDEX, args=(index_config, switch_config, mode))
            log = CompletedSequenceLog()
            for i, (p, e) in enumerate(zip(prompts, earlier)):
                log.append(CompletedSequence.create(f"earlier{i}", "g", 0, p, e))
            llm.collective_rpc(RPC_APPLY_LOG, args=(entries_to_wire(log.read(0)),))
        llm.generate([{"prompt_token_ids": [7, 8, 9, 10]}], SamplingParams(temperature=0.0, max_tokens=4),
                     use_tqdm=False)  # warm-up
    except BaseException:
        _shutdown(llm)
        raise
    return llm, start_s


def _drafter_columns(row: dict, trace: dict, steps: int, wall_s: float) -> None:
    """The drafter's time per step and its share of the engine's time at this batch (its mean per
    step x the engine's steps / the batch's wall time) from an engine's step trace."""
    row["drafter_step_us"] = trace["drafter_us"]
    row["engine_steps"] = steps
    row["drafter_share"] = trace["drafter_us"]["mean"] * 1e-6 * steps / wall_s if wall_s and steps else None


def sweep(llms: dict, prompts, batches, new_tokens, repeats) -> dict:
    """Every configuration's rows (one per batch size), the configurations of each repeat in
    rotating order (a slow minute of the machine lands on all of them alike): tokens/s per run,
    drafts and accepted tokens, and for WAR's engines the switch's share of drafting steps and
    the drafter's time per step and share of the engine's time."""
    from vllm import SamplingParams

    from war_openrlhf.engine.rpc import RPC_INDEX_STATS

    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    names = list(llms)
    sets = prompt_sets(prompts, batches, repeats)
    rows = {n: [] for n in names}
    for bi, b in enumerate(batches):
        rates = {n: [] for n in names}
        wall = dict.fromkeys(names, 0.0)
        # each engine's own spec-decode counters (the process-wide registry holds only the last
        # engine started), read around each of its runs
        counted = {n: dict.fromkeys(SPEC_COUNTERS, 0.0) for n in names}
        sw0 = {n: llms[n].collective_rpc(RPC_INDEX_STATS, args=(True,))[0]["switch"]  # resets the step trace
               for n in names if n.startswith("war")}
        if "vllm_suffix" in llms:  # vLLM's own drafter is timed in the same step trace
            llms["vllm_suffix"].collective_rpc(RPC_INDEX_STATS, args=(True,))
        for r in range(repeats):
            shift = (bi + r) % len(names)
            for name in names[shift:] + names[:shift]:
                llm = llms[name]
                batch = [{"prompt_token_ids": prompts[i]} for i in sets[(b, r)]]
                llm.reset_prefix_cache()
                c0 = engine_spec_decode_counters(llm)
                t0 = time.perf_counter()
                outs = llm.generate(batch, sp, use_tqdm=False)
                dt = time.perf_counter() - t0
                c1 = engine_spec_decode_counters(llm)
                for key in SPEC_COUNTERS:
                    counted[name][key] += c1[key] - c0[key]
                wall[name] += dt
                rates[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
        for name in names:
            llm = llms[name]
            tps = spread(rates[name])
            c = counted[name]
            row = {"config": name, "batch": b, "tokens_per_s": tps["median"], "tokens_per_s_min": tps["min"],
                   "tokens_per_s_max": tps["max"], "tokens_per_s_runs": tps["runs"],
                   "draft_tokens": c["num_draft_tokens"], "accepted_tokens": c["num_accepted_tokens"],
                   "drafts": c["num_drafts"], "wall_s": wall[name]}
            # tokens a request gains per verification (a step in which it carried a draft)
            row["tokens_per_verification_step"] = (1 + row["accepted_tokens"] / row["drafts"]
                                                   if row["drafts"] else None)
            # the runs behind the counters: per decode step of a request, drafting or not, follows from
            # them (vllm_metrics.request_step_yield; the docs' table derives it there)
            row["repeats"] = repeats
            if name.startswith("war"):
                st = llm.collective_rpc(RPC_INDEX_STATS, args=(True,))[0]
                sw1 = st["switch"]
                steps = sw1["steps"] - sw0[name]["steps"]
                spec = sw1["spec_step_fraction"] * sw1["steps"] - sw0[name]["spec_step_fraction"] * sw0[name]["steps"]
                row["spec_step_fraction"] = spec / steps if steps else 0.0
                row["switch_gain"] = sw1["expected_gain"]
                row["switch_reason"] = sw1["decision_reason"]
                row["table"] = sw1["table"]
                _drafter_columns(row, st["step_trace"], steps, wall[name])
            if name == "vllm_suffix":  # vLLM's own drafter, timed in the same step trace
                trace = llm.collective_rpc(RPC_INDEX_STATS, args=(True,))[0].get("step_trace")
                if trace and trace["steps"]:
                    _drafter_columns(row, trace, trace["steps"], wall[name])
            rows[name].append(row)
            print(f"  {name:18s} batch {b:3d}: {tps['median']:8.0f} tok/s ({tps['min']:.0f}-{tps['max']:.0f})",
                  flush=True)
    return rows


def _fit_engine_kwargs(max_len, seed):
    """The measured engine: as it serves on this node (bf16 + CUDA graphs on a GPU, float32
    eager on CPU; ``WAR_FIT_DTYPE`` overrides the dtype)."""
    from war_openrlhf.device import cuda_available
    from war_openrlhf.engine.launch import cost_fit_engine_kwargs

    return cost_fit_engine_kwargs(max_len, seed, cuda=cuda_available(), dtype=os.environ.get("WAR_FIT_DTYPE"))


def measure_step_costs(model, max_len, repeats, bind="0", seed=0):
    """Runs of engine steps with known work, on one engine without speculation (what a cost
    model is fitted to): ``b`` fresh prompts of ``c`` tokens each (prefix caching off), each
    generating ``m + 1`` tokens (``m = 0``: prefill only). A run's time is the engine core's
    own (first request scheduled to last token, from vLLM's per-request timestamps: no
    front-end or process-hop noise); its work follows from vLLM's schedule: the prompts are
    prefilled in chunks of ``max_num_batched_tokens``, then ``m`` decode steps of ``b``
    sequences. Returns ``(runs, engine limits)``."""
    import numpy as np
    from vllm import LLM, SamplingParams

    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind  # as the rollout's engines: one core each
    llm = LLM(model=str(model), **_fit_engine_kwargs(max_len, seed))
    try:
        cfg = llm.llm_engine.vllm_config
        chunk = int(cfg.scheduler_config.max_num_batched_tokens)
        limits = {"max_num_batched_tokens": chunk, "max_num_seqs": int(cfg.scheduler_config.max_num_seqs),
                  "block_size": int(cfg.cache_config.block_size),
                  "kv_capacity_tokens": int(cfg.cache_config.num_gpu_blocks or 0) * int(cfg.cache_config.block_size)}
        rng = np.random.default_rng(seed)
        vocab = llm.llm_engine.model_config.get_vocab_size()

        def run(b, c, m):
            batch = [{"prompt_token_ids": rng.integers(10, vocab - 10, size=c).tolist()} for _ in range(b)]
            sp = SamplingParams(temperature=0.0, max_tokens=m + 1, ignore_eos=True)
            outs = llm.generate(batch, sp, use_tqdm=False)
            metrics = [o.metrics for o in outs]
            if any(x is None or not x.last_token_ts for x in metrics):
                raise RuntimeError("vLLM returned no per-request timestamps (disable_log_stats must be False)")
            seconds = max(x.last_token_ts for x in metrics) - min(x.scheduled_ts for x in metrics)
            return step_run(b, c, m, chunk, seconds)

        run(1, 64, 4)  # warm-up
        shapes = fit_shapes(max_len)
        samples = {shape: [] for shape in shapes}
        for _ in range(repeats):  # shapes interleaved, so slow phases of the machine hit all of them
            for shape in shapes:
                samples[shape].append(run(*shape))
        # the median run of each shape (robust to this machine's stalls)
        return [sorted(v, key=lambda r: r.seconds)[len(v) // 2] for v in samples.values()], limits
    finally:
        _shutdown(llm)


def fit_shapes(max_len):
    """(sequences, prompt tokens, decode steps) the cost fit measures: prefills of 256-16k tokens,
    48 decode steps of 1-16 sequences over 64-8k token prompts (those that fit ``max_len``)."""
    shapes = [(1, c, 0) for c in (256, 1024, 4096, 8192, 16384) if c < max_len - 64]
    shapes += [(b, c, 48) for b in (1, 2, 4, 8, 16) for c in (64, 2048, 8192)
               if c < max_len - 80 and b * c <= 65536]
    return shapes


def step_run(b, c, m, chunk, seconds):
    """The work of one measured shape as the fit sees it: ``b`` prompts of ``c`` tokens prefilled in
    chunks of ``chunk``, then ``m`` decode steps of ``b`` sequences, in ``seconds``."""
    from war_openrlhf.simulation.fit import StepRun

    steps, ctx, pairs = _prefill_work(b, c, chunk)
    ctx += sum(b * (c + k) for k in range(1, m + 1))
    return StepRun("prefill" if m == 0 else "decode", steps + m, b * m, ctx, b * c, seconds, pairs)


def _prefill_work(b, c, chunk):
    """(steps, context tokens read, attention pairs) of prefilling ``b`` prompts of ``c`` tokens
    back to back in chunks of ``chunk`` tokens, as vLLM's scheduler does."""
    left, computed, steps, ctx, pairs = [c] * b, [0] * b, 0, 0, 0.0
    i = 0
    while i < b:
        budget = chunk
        steps += 1
        while i < b and budget > 0:
            n = min(left[i], budget)
            pairs += n * (computed[i] + n / 2)
            computed[i] += n
            ctx += computed[i]
            left[i] -= n
            budget -= n
            if left[i] == 0:
                i += 1
    return steps, ctx, pairs


def measure_spec_costs(model, max_len, repeats, bind="0", seed=0, k=8):
    """Runs of a drafting engine (vLLM's ``suffix`` method, K=``k``) with known work: ``b`` fresh
    prompts of ``c`` tokens, ``m + 1`` tokens each, run once to fill the suffix cache, then
    measured greedy (drafts mostly accepted) and at temperature 1 (partly): the engine's spec
    counters give the steps that drafted, the draft tokens verified and the tokens accepted."""
    import numpy as np
    from vllm import LLM, SamplingParams

    from war_openrlhf.metrics.vllm_metrics import spec_decode_counters
    from war_openrlhf.simulation.fit import SpecRun, StepRun

    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
    llm = LLM(model=str(model), **_fit_engine_kwargs(max_len, seed),
              speculative_config={"method": "suffix", "num_speculative_tokens": k})
    try:
        chunk = int(llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens)
        rng = np.random.default_rng(seed + 1)
        vocab = llm.llm_engine.model_config.get_vocab_size()
        m = 48

        def run(batch, temperature):
            sp = SamplingParams(temperature=temperature, max_tokens=m + 1, ignore_eos=True, seed=seed)
            before = spec_decode_counters(llm)
            outs = llm.generate(batch, sp, use_tqdm=False)
            after = spec_decode_counters(llm)
            seconds = max(o.metrics.last_token_ts for o in outs) - min(o.metrics.scheduled_ts for o in outs)
            return seconds, {key: after[key] - before[key] for key in after}

        llm.generate([{"prompt_token_ids": [7, 8, 9, 10]}], SamplingParams(max_tokens=4), use_tqdm=False)
        # long contexts too: a draft token attends its request's context (draft_context_token_s)
        shapes = [(b, c) for b in (1, 2, 4, 8) for c in (64, 2048, 8192) if c < max_len - m - 8 and b * c <= 32768]
        samples = {(b, c, t): [] for b, c in shapes for t in (0.0, 1.0)}
        for _ in range(repeats):
            for b, c in shapes:
                batch = [{"prompt_token_ids": rng.integers(10, vocab - 10, size=c).tolist()} for _ in range(b)]
                run(batch, 0.0)  # the suffix cache now holds these prompts' greedy outputs
                for t in (0.0, 1.0):
                    seconds, d = run(batch, t)
                    accepted = d["num_accepted_tokens"]
                    request_steps = b * m - accepted  # each decode request-step yields 1 + accepted
                    psteps, pctx, pairs = _prefill_work(b, c, chunk)
                    steps = request_steps / b
                    plain = StepRun("spec", psteps + steps, request_steps, pctx + request_steps * (c + m / 2),
                                    b * c, seconds, pairs)
                    samples[(b, c, t)].append(SpecRun(plain, d["num_drafts"] / b, d["num_draft_tokens"],
                                                      d["num_draft_tokens"] * (c + m / 2)))
        return [sorted(v, key=lambda r: r.plain.seconds)[len(v) // 2] for v in samples.values()]
    finally:
        _shutdown(llm)


def fit_costs(args) -> int:
    """--fit-costs: measure step costs on one engine, fit the simulator's cost model, write it."""
    from war_openrlhf.simulation.fit import fit_cost_model, fit_spec_costs

    runs, limits = measure_step_costs(args.model, args.max_len, args.repeats, bind=args.bind)
    model, report = fit_cost_model(runs, name=f"fitted:{args.model.name}", **limits)
    spec_runs = measure_spec_costs(args.model, args.max_len, args.repeats, bind=args.bind)
    model, spec_report = fit_spec_costs(model, spec_runs)
    report["spec"] = spec_report
    rows = [{"kind": r["kind"], "steps": r["steps"], "decode_seqs": r["decode_seqs"],
             "prefill": r["prefill_tokens"], "measured_ms": 1e3 * r["seconds"], "predicted_ms": 1e3 * r["predicted_s"],
             "ratio": r["ratio"]} for r in report["runs"]]
    print(format_table(rows, [("kind", "run", ""), ("steps", "steps", ".0f"), ("decode_seqs", "decode seqs", ".0f"),
                              ("prefill", "prefill tokens", ".0f"), ("measured_ms", "measured ms", ".1f"),
                              ("predicted_ms", "fitted ms", ".1f"), ("ratio", "fitted/measured", ".3f")]))
    print("fitted:", {k: f"{v:.3g}" for k, v in report["costs"].items()}, "limits:", limits,
          f"max relative error {report['max_relative_error']:.1%}")
    spec_rows = [{"steps": r["steps"], "drafts": r["spec_steps"], "draft_tokens": r["draft_tokens"],
                  "measured_ms": 1e3 * r["seconds"], "predicted_ms": 1e3 * r["predicted_s"], "ratio": r["ratio"]}
                 for r in spec_report["runs"]]
    print(format_table(spec_rows, [("steps", "steps", ".0f"), ("drafts", "drafting steps", ".1f"),
                                   ("draft_tokens", "draft tokens", ".0f"), ("measured_ms", "measured ms", ".1f"),
                                   ("predicted_ms", "fitted ms", ".1f"), ("ratio", "fitted/measured", ".3f")]))
    print("drafting:", {k: f"{v:.3g}" for k, v in spec_report["costs"].items()},
          f"max relative error {spec_report['max_relative_error']:.1%}")
    out = write_json(args.fit_costs, {"benchmark": "engine_step_costs", "model": str(args.model),
                                      "max_model_len": args.max_len, "cost_model": model.to_dict(), "fit": report})
    print(f"wrote {out}")
    return 0


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
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs per batch size (disjoint prompts); tokens/s is their median, every run kept")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--fit-costs", type=Path, metavar="OUT.json",
                    help="instead of the sweep: measure step costs (prefill, decode at several batch sizes and "
                         "context lengths) on --model without speculation, fit the simulator's cost model to them "
                         "and write it (a preset for bench_rollout.py --cost-model)")
    ap.add_argument("--max-len", type=int, default=1024, help="--fit-costs: the engine's max_model_len")
    ap.add_argument("--bind", default="0", help="--fit-costs: VLLM_CPU_OMP_THREADS_BIND of the measured engine "
                                                "(default core 0: rollout engines get one core each)")
    args = ap.parse_args(argv)
    if args.fit_costs is not None:
        return fit_costs(args)

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

    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        print(f"error: --configs: unknown config '{unknown[0]}' (known: {', '.join(CONFIGS)})", file=sys.stderr)
        return 2
    llms, starts = {}, {}
    try:  # every configuration's engine up at once (in-process engine cores), measured in rotation
        for name in names:
            llms[name], starts[name] = start_config(name, model, prompts, earlier, args.k, engine_args)
        results = sweep(llms, prompts, batches, args.new_tokens, args.repeats)
    finally:
        for llm in llms.values():
            _shutdown(llm)

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
