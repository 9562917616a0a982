"""``war-predict``: the rollout gain WAR would bring on your own agent trajectories, before adopting it.

    war-predict --traces runs/*.traj --engines 32 --json predict.json
    war-predict --traces tau.json --engines 8 --kv-tokens 400000 --cost-model my_node.json --tool-latency 0.5

Reads trajectories a team already has (OpenAI-chat JSON/JSONL as tau-bench writes them,
SWE-agent ``.traj`` files, war-train's own rollout dumps: :mod:`war_openrlhf.traces.trace_files`),
replays what drafting achieves on them, simulates one synchronous rollout step of them on the
cluster given, and prints each configuration's predicted step time and gain over OpenRLHF's
rollout (:mod:`war_openrlhf.simulation.predict`). The cost model is a preset (analytic: not fitted
to any measured GPU) or the file ``tools/bench_engine.py --fit-costs`` writes on your node. Every
prediction prints how far the simulator has been from real engines where it was checked.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
#: the committed comparison of the simulator with real engines (tools that validate it write it):
#: the latest, whose costs were fitted to the steps of rollouts on other tasks than it checks
VALIDATION_FILE = ROOT / "benchmarks" / "results" / "simulator_fit" / "validation.json"


def validation_note(path: Path = VALIDATION_FILE, cost: str | None = None) -> dict[str, Any]:
    """The simulator's worst error against real engines, from the committed validation file
    (``tools/validate_simulator.py``); ``validated`` False (and why) when there is none. The file
    checks the cost models fitted on the machine of its runs; ``cost`` (this prediction's preset
    or cost file) is said to be covered only when it is one of them."""
    import json

    if not path.is_file():
        return {"validated": False,
                "note": "the simulator has not been validated against real engines: treat the figures as a "
                        "model's estimate (docs/benchmarks.md, the simulator section)"}
    data = json.loads(path.read_text())
    worst = data.get("worst_abs_error")
    checked = [Path(c).name for c in data.get("cost_models", [])]
    covered = cost is not None and Path(str(cost)).name in checked
    target = data.get("target_abs_error")
    met = worst is not None and target is not None and worst <= target
    note = (f"against real engines the simulated gain over OpenRLHF was within {100 * (worst or 0):.0f}% of the "
            f"measured one over {data.get('comparisons', '?')} comparisons ({path.name}"
            f"{'' if target is None else f'; target {100 * target:.0f}%: ' + ('met' if met else 'missed')})")
    step = data.get("worst_abs_step_error")
    if step is not None:  # the gain is what the target judges; the step time drifts with the machine's day
        note += f"; the simulated step time within {100 * step:.0f}% of the measured one"
    if not covered:
        note += (f"; that check used costs fitted on its own machine ({', '.join(checked) or 'none named'}), "
                 "not this prediction's: fit yours to a rollout of your own with tools/fit_rollout_costs.py")
    return {"validated": bool(met and covered), "worst_abs_error": worst, "target_abs_error": target,
            "worst_abs_step_error": step,
            "cost_model_checked": covered, "file": str(path), "note": note}


def _parser() -> argparse.ArgumentParser:
    from ..simulation.predict import CONFIGS, DEFAULT_CONFIGS

    ap = argparse.ArgumentParser(prog="war-predict", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", nargs="+", required=True, metavar="FILE",
                    help="trajectory files: .json / .jsonl (OpenAI chat; war-train's rollout_*.jsonl), .traj (SWE-agent)")
    ap.add_argument("--engines", type=int, default=8, help="rollout engines (default 8)")
    ap.add_argument("--kv-tokens", type=int, default=None, help="KV-cache tokens per engine (default: the cost model's)")
    cost = ap.add_mutually_exclusive_group()
    cost.add_argument("--preset", default=None, help="cost preset (default h100_qwen7b: analytic, unvalidated; "
                           "h100_qwen7b_published / a100_qwen7b_published: fitted to published "
                           "measurements, docs/cost_presets.md)")
    cost.add_argument("--cost-model", type=Path, default=None,
                      help="a cost model fitted on your node (tools/fit_rollout_costs.py on a rollout's recorded steps, "
                           "or tools/fit_serving_costs.py)")
    ap.add_argument("--tool-latency", type=float, default=None, metavar="S",
                    help="seconds a tool call takes (default: the traces' recorded latencies, else 1 s)")
    ap.add_argument("--steps", type=int, default=1, help="synchronous steps the trajectories are split into (default 1)")
    ap.add_argument("--draft-tokens", type=int, default=16, help="most tokens drafted per step (default 16)")
    ap.add_argument("--replay-groups", type=int, default=32,
                    help="groups the speculation replay samples (default 32; 0: every group)")
    ap.add_argument("--jobs", type=int, default=0,
                    help="processes for the replays and simulations (default 0: one per core)")
    ap.add_argument("--tokenizer", default=None,
                    help="a Hugging Face tokenizer directory for chat traces (default: the bundled Qwen2.5 one)")
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                    help=f"configurations to predict, comma-separated (known: {', '.join(CONFIGS)})")
    ap.add_argument("--json", type=Path, default=None, help="write the prediction here")
    ap.add_argument("--plot", type=Path, default=None, help="write a bar chart of the gains here (.png)")
    ap.add_argument("--quiet", action="store_true", help="no progress output")
    return ap


def _tokenizer(name: str | None):
    if name is None:
        return None
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(name)

    class _Encode:
        def encode(self, text: str) -> list[int]:
            return hf(text, add_special_tokens=False)["input_ids"]

        def decode(self, ids) -> str:
            return hf.decode(ids)

    return _Encode()


def _table(result: dict[str, Any]) -> str:
    lines = ["| config | dispatch | speculation | predicted step s | x openrlhf |", "|---|---|---|---:|---:|"]
    for name, row in result["configs"].items():
        spec = row["speculation"] + (f" (switch: {row['switch']})" if "switch" in row else "")
        lines.append(f"| {name} | {row['policy']} | {spec} | {row['step_s']:.2f} | {row['x_openrlhf']:.2f} |")
    return "\n".join(lines)


def _plot(result: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["configs"])
    gains = [result["configs"][n]["x_openrlhf"] for n in names]
    fig, ax = plt.subplots(figsize=(1.2 * len(names) + 2, 3.6))
    ax.bar(range(len(names)), gains, color=["#888" if n == "openrlhf" else "#2a6" for n in names])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("predicted x OpenRLHF's rollout")
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from ..simulation.predict import PredictSettings, predict
    from ..traces.chat_traces import TraceFormatError
    from ..traces.trace_files import load_trace_files, trace_summary

    for flag, value, least in (("engines", args.engines, 1), ("steps", args.steps, 1),
                               ("replay-groups", args.replay_groups, 0), ("jobs", args.jobs, 0),
                               ("draft-tokens", args.draft_tokens, 1),
                               ("kv-tokens", args.kv_tokens, 16)):
        if value is not None and value < least:
            raise SystemExit(f"war-predict: --{flag}: must be >= {least}, got {value}")
    if args.tool_latency is not None and not args.tool_latency >= 0:
        raise SystemExit(f"war-predict: --tool-latency: must be seconds >= 0, got {args.tool_latency}")
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    cost = str(args.cost_model) if args.cost_model is not None else (args.preset or "h100_qwen7b")
    if args.cost_model is not None and not args.cost_model.is_file():
        raise SystemExit(f"war-predict: --cost-model {args.cost_model}: no such file")
    try:
        settings = PredictSettings(engines=args.engines, kv_tokens=args.kv_tokens, cost_model=cost,
                                   tool_latency_s=args.tool_latency, steps=args.steps, draft_tokens=args.draft_tokens,
                                   replay_groups=args.replay_groups or None)
        from ..simulation.cost_model import get_preset

        get_preset(cost)
        traces = load_trace_files(args.traces, tokenizer=_tokenizer(args.tokenizer))
    except (TraceFormatError, ValueError, OSError) as exc:
        raise SystemExit(f"war-predict: {exc}") from None
    summary = trace_summary(traces)
    say = None if args.quiet else (lambda msg: print(f"  {msg}", file=sys.stderr, flush=True))
    try:
        result = predict(traces.trajectories, settings, configs, progress=say, jobs=args.jobs or None)
    except ValueError as exc:
        raise SystemExit(f"war-predict: {exc}") from None
    validation = validation_note(cost=str(cost))
    regime = (f"{summary['trajectories']} trajectories in {summary['groups']} groups, {summary['turns']} turns; "
              f"{args.engines} engines, KV {'per cost model' if args.kv_tokens is None else args.kv_tokens} tokens "
              f"each, cost model {cost}, tools {result['tool_latency']}")
    print(f"war-predict: {regime}")
    print(_table(result))
    for mode, s in result["speculation"].items():
        print(f"drafting ({mode}), replayed on {s['replay_trajectories']} of these trajectories "
              f"({s['replay_groups']} groups): {s['tokens_per_step']:.2f} tokens per step, acceptance "
              f"{s['acceptance']:.2f} (greedy verification: an upper bound for sampled turns)")
    print(f"validation: {validation['note']}")
    if args.plot is not None:
        _plot(result, args.plot, regime)
    if args.json is not None:
        from ..metrics import write_json

        write_json(args.json, {"tool": "war-predict", "regime": regime, "traces": summary,
                               "settings": {k: v for k, v in vars(settings).items()}, **result,
                               "validation": validation})
    return 0


if __name__ == "__main__":
    sys.exit(main())
