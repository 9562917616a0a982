#!/usr/bin/env python
"""Fit the simulator's machine model to the steps a real rollout's engines ran.

    WAR_STEP_RECORD_DIR=runs/steps python tools/bench_rollout.py ... # or any war-train / rollout run
    python tools/fit_rollout_costs.py --records runs/steps --kind speculative --engines 2 \\
        --json benchmarks/results/engine/cost_rollout.json

With ``WAR_STEP_RECORD_DIR`` set, every vLLM engine core the run starts (WAR's engines and
OpenRLHF's own alike) writes each step's work and time there (``engine/step_record.py``). This
tool fits the cost model to them (``simulation/fit_steps.py``): the base step costs on the
steps that verified no draft, the host's ``contention`` from when the engines stepped together
and alone, the drafting costs on the steps that verified drafts. ``--kind`` picks the engines:
``war_index`` (WAR's drafting engines), ``vllm_suffix`` (vLLM's own suffix method), ``plain``
(no speculative config: OpenRLHF's own, WAR's ``speculation: none``) or ``speculative`` (every
engine with a speculative config, whoever drafts; records written before they named their
drafter); a run of several configurations records them all. Each ``--records`` directory
is one run on one host; several are fitted together.

The result is a cost-model file for ``bench_rollout.py --cost-model`` / ``--plain-cost-model`` /
``--suffix-cost-model`` and ``war-predict --cost-model``. Fit on runs of other work than the runs you predict (another
split of the tasks, another seed), or the check proves nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    from war_openrlhf.simulation.fit_steps import ENGINE_KINDS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=Path, nargs="+", required=True,
                    help="directories of step records (WAR_STEP_RECORD_DIR of a run), one per run")
    ap.add_argument("--kind", choices=ENGINE_KINDS, required=True,
                    help="which engines to fit: war_index (WAR's drafting engines), vllm_suffix (vLLM's suffix "
                         "method), plain (no speculative config) or speculative (any drafter)")
    ap.add_argument("--engines", type=int, required=True, help="engines each configuration ran at once")
    ap.add_argument("--model", default=None,
                    help="the engines' model directory (default: from the records; older records lack it)")
    ap.add_argument("--name", default=None, help="the cost model's name (default: rollout-<kind>)")
    ap.add_argument("--min-steps", type=int, default=3, help="fewest steps in a bin of like work to fit it")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args(argv)
    from war_openrlhf.engine.step_record import read_step_records
    from war_openrlhf.metrics import format_table, write_json
    from war_openrlhf.simulation.fit_steps import fit_rollout_steps, is_kind

    t0 = time.time()
    try:
        runs = [read_step_records(d) for d in args.records]
        model, report = fit_rollout_steps(runs, kind=args.kind, engines_per_run=args.engines,
                                          name=args.name or f"rollout-{args.kind}", min_steps=args.min_steps)
    except ValueError as exc:
        raise SystemExit(f"fit_rollout_costs: {exc}")
    engines_model = args.model or next((e.header.get("model") for run in runs for e in run
                                        if is_kind(e.header, args.kind) and e.header.get("model")), None)
    if not engines_model:
        raise SystemExit("fit_rollout_costs: the records do not name their model; pass --model DIR")
    costs = model.to_dict()
    rows = [{"cost": k, "value": costs[k]} for k in (
        "step_overhead_s", "decode_per_seq_s", "kv_read_per_token_s", "prefill_per_token_s",
        "prefill_attn_per_pair_s", "spec_step_s", "draft_token_s", "draft_context_token_s", "contention")]
    print(format_table(rows, [("cost", "cost", ""), ("value", "fitted", ".4g")]))
    print(f"{report['steps']} {args.kind} steps ({report['drafting_steps']} drafting) of {report['engines']} engines; "
          f"base fit's worst bin error {report['base']['max_relative_error']:.1%}"
          + (f", drafting fit's {report['drafting']['max_relative_error']:.1%}" if report["drafting"] else ""))
    out = write_json(args.json, {"benchmark": "engine_step_costs_rollout", "engine_kind": args.kind,
                                 "model": str(engines_model),
                                 "records": [str(d) for d in args.records], "engines": args.engines,
                                 "cost_model": costs, "fit": report, "wall_s": round(time.time() - t0, 1)})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
