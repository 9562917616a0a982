#!/usr/bin/env python
"""Tokens per verification step of draft proposers, replayed on real agent traces.

Replays OpenAI-chat traces (tau-bench format) as synchronous GRPO steps (all trials
of a task form one group, placed whole on an engine) and compares, in one process
on the same workload:

  none               no speculation
  ngram              vLLM's prompt-lookup proposer (its own matcher, vLLM defaults 5/5)
  per_engine_suffix  vLLM's suffix method: one arctic-inference cache per engine
  war_global         WAR's global suffix index: every engine drafts from every finished turn

Example:
  python tools/bench_speculation.py --traces ../shared/traces/tau_airline_dev.json \
      --engines 8 --k 16 --json benchmarks/results/speculation/e8_k16.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from war_openrlhf.metrics import format_table, write_json  # noqa: E402
from war_openrlhf.simulation import ReplayConfig, replay  # noqa: E402
from war_openrlhf.speculation import SuffixIndexConfig  # noqa: E402
from war_openrlhf.speculation.proposers import (  # noqa: E402
    NgramProposer,
    NoSpeculation,
    PerEngineSuffixProposer,
    WarGlobalProposer,
)
from war_openrlhf.traces import TraceFormatError, group_trajectories, load_chat_traces, tokenize_traces  # noqa: E402

DEFAULT_TRACES = ROOT.parent / "shared" / "traces" / "tau_airline_dev.json"

# Variants of WAR's index to show where its gain comes from (--ablations).
ABLATIONS = {
    "war_global_vllm_params": dict(max_tree_depth=24, max_spec_factor=1.0, prompt_lead_in=0),
    "war_global_full_window": dict(match_window=32),
    "war_global_depth_64": dict(max_tree_depth=64),
    "war_global_lead_in_0": dict(prompt_lead_in=0),
    "war_global_factor_1": dict(max_spec_factor=1.0),
    "war_global_group_trees": dict(group_trees=True, group_bias=1.0),
    "war_global_group_bias_2": dict(group_trees=True, group_bias=2.0),
    "war_global_no_live": dict(live_responses=False),
}


def build_proposer(name: str, engines: int, index_config: SuffixIndexConfig):
    if name == "none":
        return NoSpeculation()
    if name == "ngram":
        return NgramProposer()
    if name == "per_engine_suffix":
        return PerEngineSuffixProposer(engines)
    if name == "war_global":
        return WarGlobalProposer(engines, index_config)
    if name == "per_engine_suffix_factor_2":  # vLLM's per-engine trees with WAR's draft-length rule
        proposer = PerEngineSuffixProposer(engines, max_spec_factor=2.0)
        proposer.name = name
        return proposer
    if name in ABLATIONS:
        cfg = SuffixIndexConfig(**{**index_config.__dict__, **ABLATIONS[name]})
        proposer = WarGlobalProposer(engines, cfg)
        proposer.name = name
        return proposer
    raise ValueError(f"--configs: unknown config '{name}' (known: none, ngram, per_engine_suffix, war_global, "
                     f"per_engine_suffix_factor_2, {', '.join(ABLATIONS)})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", action="append", type=Path, help=f"trace file (repeatable; default {DEFAULT_TRACES})")
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--k", type=int, default=16, help="max draft tokens per step (num_speculative_tokens)")
    ap.add_argument("--steps", type=int, default=1, help="synchronous steps; each takes a slice of every task's trials")
    ap.add_argument("--tool-delay-ticks", type=int, default=8, help="ticks between a turn's end and the next turn")
    ap.add_argument("--tool-delay-per-env-token", type=float, default=0.0, help="extra ticks per environment token")
    ap.add_argument("--configs", default="none,ngram,per_engine_suffix,war_global")
    ap.add_argument("--ablations", action="store_true", help="also run WAR index variants")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write results here")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)

    paths = args.traces or [DEFAULT_TRACES]
    try:
        chats = load_chat_traces(paths if len(paths) > 1 else paths[0])
    except TraceFormatError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:
        print(f"error: --traces: {exc.filename} not found", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    groups = group_trajectories(tokenize_traces(chats))
    n_turns = sum(len(t.turns) for g in groups.values() for t in g)
    n_resp = sum(int(u.response_token_ids.size) for g in groups.values() for t in g for u in t.turns)
    print(f"{len(chats)} trajectories in {len(groups)} groups, {n_turns} turns, {n_resp} response tokens "
          f"(tokenized in {time.perf_counter() - t0:.1f}s)")

    config = ReplayConfig(
        engines=args.engines, k=args.k, steps=args.steps, seed=args.seed,
        tool_delay_ticks=args.tool_delay_ticks, tool_delay_ticks_per_env_token=args.tool_delay_per_env_token,
    )
    index_config = SuffixIndexConfig()
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    if args.ablations:
        names += [n for n in ["per_engine_suffix_factor_2", *ABLATIONS] if n not in names]
    results = {}
    for name in names:
        try:
            proposer = build_proposer(name, args.engines, index_config)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        res = replay(groups, proposer, config, progress=not args.no_progress)
        results[name] = res.as_dict()

    base = results.get("none", {}).get("tokens_per_step")
    ref = results.get("per_engine_suffix", {}).get("tokens_per_step")
    rows = []
    for name, r in results.items():
        rows.append({
            "config": name, **r,
            "vs_none": r["tokens_per_step"] / base if base else None,
            "vs_per_engine": r["tokens_per_step"] / ref if ref else None,
        })
        r["speedup_vs_none"] = rows[-1]["vs_none"]
        r["ratio_vs_per_engine_suffix"] = rows[-1]["vs_per_engine"]
    print(format_table(rows, [
        ("config", "config", ""), ("tokens_per_step", "tok/step", ".3f"), ("acceptance_rate", "accept", ".3f"),
        ("draft_tokens", "drafted", "d"), ("accepted_tokens", "accepted", "d"), ("generated_tokens", "generated", "d"),
        ("ticks", "ticks", "d"), ("vs_none", "x none", ".2f"), ("vs_per_engine", "x per-engine", ".2f"),
        ("propose_us_per_call", "us/propose", ".1f"),
    ]))
    out = write_json(args.json, {
        "benchmark": "speculation_replay",
        "traces": [str(p) for p in paths],
        "workload": {"trajectories": len(chats), "groups": len(groups), "turns": n_turns,
                     "response_tokens": n_resp},
        "simulated": True,  # ticks and tokens are exact; only propose_us_per_call is timed (one run)
        "replay": config.__dict__,
        "war_index": index_config.__dict__,
        "results": results,
    })
    if out:
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
