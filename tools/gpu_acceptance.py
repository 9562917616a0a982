#!/usr/bin/env python
"""GPU acceptance: the engine path of a war-train run, checked on one GPU of your node.

    python tools/gpu_acceptance.py --model /models/Qwen2.5-0.5B-Instruct --json gpu_acceptance.json

About 10 minutes on one GPU with vLLM 0.29.0 installed (``scripts/install.sh``). Each step runs
in its own process (a failing step never hides the next) and the file gathers them:

``engine_path``   war-train's engine arguments (bf16, CUDA graphs, sleep mode, WAR's drafting behind
                  OpenRLHF's worker extension) on ``--model``: greedy with drafting on equals off
                  over ``--prompts`` prompts of ``--new-tokens`` tokens, drafts accepted; a
                  colocated CUDA-IPC weight sync (``--train.colocate_all``'s path) of perturbed
                  weights changes the output and the original weights restore it; a sleep/wake
                  round trip keeps the greedy output and the suffix index
                  (:func:`war_openrlhf.preflight.check_engine`)
``sampling``      speculation does not change the sampled distribution at temperature 1 and top-p
                  0.8 in bf16 (``tools/check_spec_sampling.py``: chi-square and exact-model checks)
``engine_tax``    what the speculative config costs an engine that does not draft: plain vLLM vs a
                  WAR engine with drafting off vs the switch, batch 1-64, bf16 with CUDA graphs
                  (``tools/bench_engine_tax.py --device cuda``)

Exit status 1 when a step failed. On a machine without CUDA it stops at once with the reason
(the CPU checks are ``war-train --preflight`` and the test suite).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STEPS = ("engine_path", "sampling", "engine_tax")


def step_commands(args: argparse.Namespace, workdir: Path) -> dict[str, list[str]]:
    """Each step's command line (a fresh Python process each)."""
    py = sys.executable
    engine = (f"import json, sys; from pathlib import Path; from war_openrlhf.preflight import check_engine; "
              f"c = check_engine(Path({str(workdir)!r}), Path({str(args.model)!r}), prompts_n={args.prompts}, "
              f"new_tokens={args.new_tokens}); print(c.line()); "
              f"print('RESULT ' + json.dumps(dict(status=c.status, detail=c.detail))); "
              f"sys.exit(0 if c.status == 'ok' else 1)")
    return {
        "engine_path": [py, "-c", engine],
        "sampling": [py, str(ROOT / "tools" / "check_spec_sampling.py"), "--model", str(args.model),
                     "--dtype", "bfloat16", "--settings", "1.0:1.0,1.0:0.8", "--json",
                     str(workdir / "sampling.json")],
        "engine_tax": [py, str(ROOT / "tools" / "bench_engine_tax.py"), "--device", "cuda", "--model",
                       str(args.model), "--batches", "1,4,16,64", "--repeats", str(args.repeats),
                       "--new-tokens", "128", "--json", str(workdir / "engine_tax.json")],
    }


def run_step(name: str, cmd: list[str], workdir: Path, timeout_s: float) -> dict:
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out = 124, f"timed out after {timeout_s:.0f} s\n" + str(exc.stdout or "")[-2000:]
    result: dict = {"step": name, "status": "ok" if rc == 0 else "fail", "seconds": round(time.perf_counter() - t0, 1),
                    "command": " ".join(cmd), "tail": out[-1500:]}
    for line in out.splitlines():
        if line.startswith("RESULT "):
            result.update(json.loads(line[len("RESULT "):]))
    side = {"sampling": "sampling.json", "engine_tax": "engine_tax.json"}.get(name)
    if side and (workdir / side).is_file():
        result["result"] = json.loads((workdir / side).read_text())
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="local HF model directory (a small instruct model)")
    ap.add_argument("--json", type=Path, default=Path("gpu_acceptance.json"))
    ap.add_argument("--steps", default=",".join(STEPS), help="comma-separated subset of " + ", ".join(STEPS))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--step-timeout-s", type=float, default=900.0)
    args = ap.parse_args(argv)
    steps = [s for s in args.steps.split(",") if s]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        ap.error(f"--steps: unknown {', '.join(unknown)} (known: {', '.join(STEPS)})")
    if not (args.model / "config.json").is_file():
        ap.error(f"--model: {args.model} is not a local HF model directory (no config.json)")
    from war_openrlhf.device import cuda_available

    if not cuda_available():
        print("gpu_acceptance: no CUDA device here; run it on a GPU node (CPU checks: war-train --preflight)")
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="war_gpu_acceptance_"))
    commands = step_commands(args, workdir)
    results = []
    for name in steps:
        r = run_step(name, commands[name], workdir, args.step_timeout_s)
        detail = r.get("detail") or (r["tail"].strip().splitlines() or [""])[-1]
        print(f"[{'OK  ' if r['status'] == 'ok' else 'FAIL'}] {name:<12} {r['seconds']:.0f} s  {detail}", flush=True)
        results.append(r)
    import torch

    report = {"benchmark": "gpu_acceptance", "model": str(args.model), "gpu": torch.cuda.get_device_name(0),
              "torch": torch.__version__, "steps": results}
    args.json.write_text(json.dumps(report, indent=2))
    failed = [r["step"] for r in results if r["status"] != "ok"]
    print(f"gpu_acceptance: {len(results) - len(failed)} ok, {len(failed)} failed"
          f"{' (' + ', '.join(failed) + ')' if failed else ''}; results in {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
