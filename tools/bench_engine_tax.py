#!/usr/bin/env python
"""The engine tax: what an engine that carries a speculative config costs when nothing is drafted.

Engines, all in this process (vLLM's in-process engine core), on the same model, prompts and
forced lengths, measured in rotating order within each repeat:

  plain      vLLM without a speculative config (``speculation: none``; OpenRLHF's engines)
  war_off    WAR's engine with drafting switched off (what the load-aware switch runs at high load)
  war_auto   WAR's engine with the load-aware switch deciding (its index empty: nothing to draft)

Greedy (``--temperature``), ``--new-tokens`` forced per request, batch sizes ``--batches``;
``--logprobs`` asks the sampled token's logprob as the rollout pool does; ``--engine-process``
runs each engine core in its own process, as the rollout's engines do (vLLM's async scheduling
of plain engines then overlaps scheduling with the forward pass; a speculative config turns
it off). Tokens/s per (config,
batch) is the median of ``--repeats`` runs with min-max; the tax is ``1 - war / plain`` on the
medians, and per repeat (the same prompts back to back, so the machine's slow phases hit both).

  python tools/bench_engine_tax.py --json benchmarks/results/engine/engine_tax.json
  python tools/bench_engine_tax.py --device cuda --model /models/Qwen2.5-0.5B-Instruct --json tax_gpu.json
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
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
if "--engine-process" in sys.argv:  # as the rollout's engines run: each engine core in its own process
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # every engine in this process: rotating order
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from war_openrlhf.metrics import format_table, spread, write_json  # noqa: E402

CONFIGS = ("plain", "war_off", "war_auto")


def build(name: str, model: Path, k: int, *, cuda: bool = False, memory: float = 0.25):
    """One engine of the comparison, with the vLLM arguments a rollout engine of that kind gets
    (``vllm_engine_kwargs``); on CUDA bf16 with CUDA graphs and ``memory`` of the GPU each (the
    three share one GPU), on CPU float32 and eager."""
    from vllm import LLM

    from war_openrlhf.engine import EngineConfig
    from war_openrlhf.engine.launch import vllm_engine_kwargs
    from war_openrlhf.engine.rpc import RPC_INSTALL_INDEX

    speculation = {"plain": "none", "war_off": "off", "war_auto": "auto"}[name]
    cfg = EngineConfig(model=str(model), dtype="bfloat16" if cuda else "float32", max_model_len=2048,
                       enforce_eager=not cuda, speculation=speculation, num_speculative_tokens=k,
                       gpu_memory_utilization=memory)
    kwargs = vllm_engine_kwargs(cfg, cuda=cuda)
    llm = LLM(**kwargs)
    if cfg.drafting.has_war_index:  # an empty replica; the switch's mode as the config says
        llm.collective_rpc(RPC_INSTALL_INDEX, args=({}, {}, speculation))
    return llm


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / ".cache" / "war_tiny_model")
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--logprobs", action="store_true", help="ask the sampled token's logprob (as the pool does)")
    ap.add_argument("--engine-process", action="store_true",
                    help="each engine core in its own process (the rollout engines' setup)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="cuda: bf16 engines with CUDA graphs sharing one GPU (--gpu-memory each)")
    ap.add_argument("--gpu-memory", type=float, default=0.25, help="gpu_memory_utilization of each engine (CUDA)")
    args = ap.parse_args(argv)

    import numpy as np
    from vllm import SamplingParams

    from war_openrlhf.fixtures.tiny_model import build_tiny_model

    from war_openrlhf.device import cuda_available

    cuda = cuda_available() if args.device == "auto" else args.device == "cuda"
    model = args.model if (args.model / "config.json").is_file() else build_tiny_model(args.model)
    configs = args.configs.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    engines = {name: build(name, model, args.k, cuda=cuda, memory=args.gpu_memory) for name in configs}
    rng = np.random.default_rng(0)
    sp = SamplingParams(temperature=args.temperature, max_tokens=args.new_tokens, min_tokens=args.new_tokens,
                        ignore_eos=True, logprobs=0 if args.logprobs else None)
    runs: dict[tuple[str, int], list[float]] = {(c, b): [] for c in configs for b in batches}
    for llm in engines.values():  # first-use costs stay out of the runs
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], sp, use_tqdm=False)
    for r in range(args.repeats):
        for b in batches:
            prompts = [{"prompt_token_ids": rng.integers(10, 400, size=args.prompt_tokens).tolist()} for _ in range(b)]
            order = configs[r % len(configs):] + configs[:r % len(configs)]  # rotating
            for name in order:
                engines[name].reset_prefix_cache()
                t0 = time.perf_counter()
                outs = engines[name].generate(prompts, sp, use_tqdm=False)
                seconds = time.perf_counter() - t0
                runs[(name, b)].append(sum(len(o.outputs[0].token_ids) for o in outs) / seconds)
    rows = []
    for b in batches:
        row = {"batch": b}
        for name in configs:
            s = spread(runs[(name, b)])
            row[name] = s
            row[f"{name}_tok_s"] = s["median"]
        if "plain" in configs:
            for name in configs:
                if name != "plain":
                    per_run = [w / p for w, p in zip(runs[(name, b)], runs[("plain", b)])]
                    row[f"{name}_x_plain"] = spread(per_run)
                    row[f"{name}_x_plain_median"] = row[f"{name}_x_plain"]["median"]
                    row[f"{name}_tax_pct"] = 100.0 * (1.0 - row[f"{name}_x_plain"]["median"])
        rows.append(row)
    pooled = {}  # every batch's paired ratios together: the tax the engine pays whatever the load
    if "plain" in configs:
        for name in configs:
            if name != "plain":
                ratios = [w / p for b in batches for w, p in zip(runs[(name, b)], runs[("plain", b)])]
                q = np.percentile(ratios, [25, 50, 75])
                boot = np.median(rng.choice(ratios, size=(2000, len(ratios))), axis=1)
                pooled[name] = {"pairs": len(ratios), "x_plain_median": float(q[1]), "x_plain_iqr": [float(q[0]), float(q[2])],
                                "x_plain_median_90ci": [float(np.percentile(boot, 5)), float(np.percentile(boot, 95))],
                                "tax_pct": 100.0 * (1.0 - float(q[1]))}
                print(f"{name}: pooled over {len(ratios)} pairs, x plain {q[1]:.3f} (IQR {q[0]:.3f}-{q[2]:.3f}, "
                      f"90% CI of the median {pooled[name]['x_plain_median_90ci'][0]:.3f}-"
                      f"{pooled[name]['x_plain_median_90ci'][1]:.3f}): tax {pooled[name]['tax_pct']:.1f}%")
    cols = [("batch", "batch", "")] + [(f"{n}_tok_s", f"{n} tok/s", ".0f") for n in configs]
    cols += [(f"{n}_tax_pct", f"{n} tax %", ".1f") for n in configs if n != "plain"]
    print(format_table(rows, cols))
    kind = "CUDA engine (bf16, CUDA graphs)" if cuda else "CPU engine"
    regime = (f"one {kind} per config ({'own engine-core process' if args.engine_process else 'in-process engine core'}), "
              f"temperature {args.temperature:g}{', logprobs' if args.logprobs else ''}, forced lengths, "
              "prefix cache reset before each run, empty index (nothing to draft)")
    write_json(args.json, {"benchmark": "engine_tax", "regime": regime,
                           "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                           "rows": rows, "pooled": pooled})
    for llm in engines.values():
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
