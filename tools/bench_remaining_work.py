#!/usr/bin/env python
"""How well is a running trajectory's remaining work predicted: the survival curve alone vs
its GRPO siblings (``war_openrlhf/dispatch/remaining_work.py``), on a trace's task halves.

    python tools/bench_remaining_work.py --trace ../shared/traces/tau_airline_dev.json \\
        --json benchmarks/results/dispatch/remaining_work.json

Both predictors are fitted on the tuning tasks only (``task_halves``); each half is then
replayed turn-synchronously, as a step runs its trajectories side by side: after ``k`` rounds
the trajectories with ``T <= k`` turns have finished (their totals known to their siblings),
the rest are alive, and each alive trajectory's remaining turns ``T - k`` is predicted. Reported
per half: the mean absolute error over every (trajectory, round), and the Spearman rank
correlation of predicted with true remaining turns among every alive trajectory of a round
(what a longest-first scheduler needs), averaged over rounds with at least 3 alive. The
validation half is the figure to read; the tuning half is in-sample.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from war_openrlhf.dispatch.remaining_work import SiblingPredictor, SurvivalPrior  # noqa: E402
from war_openrlhf.metrics import format_table, write_json  # noqa: E402


def turn_counts(trace: Path) -> dict[str, dict[str, list[int]]]:
    """Per half, per task: its trials' model-turn counts (assistant messages)."""
    from war_openrlhf.traces.chat_traces import load_chat_traces
    from war_openrlhf.traces.turns import group_trajectories, task_halves

    groups = group_trajectories(load_chat_traces(trace))
    halves = task_halves(groups)
    return {half: {g: [t.model_turns for t in groups[g]] for g in sorted(ids)}
            for half, ids in halves.items()}


def _spearman(a: np.ndarray, b: np.ndarray) -> float | None:
    if a.size < 3 or np.all(a == a[0]) or np.all(b == b[0]):
        return None
    ra = np.argsort(np.argsort(a, kind="stable"), kind="stable").astype(np.float64)
    rb = np.argsort(np.argsort(b, kind="stable"), kind="stable").astype(np.float64)
    return float(np.corrcoef(ra, rb)[0, 1])


def evaluate(groups: dict[str, list[int]], predictors: dict) -> dict[str, dict[str, float]]:
    """Replay ``groups`` turn-synchronously; each predictor's MAE and mean per-round Spearman."""
    longest = max(max(g) for g in groups.values())
    errors = {name: [] for name in predictors}
    ranks = {name: [] for name in predictors}
    for k in range(longest):
        truth, preds = [], {name: [] for name in predictors}
        for totals in groups.values():
            finished = [t for t in totals if t <= k]
            alive = [t for t in totals if t > k]
            for t in alive:
                truth.append(t - k)
                for name, predict in predictors.items():
                    preds[name].append(predict(k, finished, len(alive) - 1))
        truth_a = np.asarray(truth, dtype=np.float64)
        for name in predictors:
            p = np.asarray(preds[name], dtype=np.float64)
            errors[name].extend(np.abs(p - truth_a).tolist())
            rho = _spearman(p, truth_a)
            if rho is not None:
                ranks[name].append(rho)
    return {name: {"mae_turns": float(np.mean(errors[name])), "predictions": len(errors[name]),
                   "spearman_mean": float(np.mean(ranks[name])) if ranks[name] else None,
                   "rounds_ranked": len(ranks[name])} for name in predictors}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=ROOT.parent / "shared" / "traces" / "tau_airline_dev.json")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if not args.trace.is_file():
        ap.error(f"--trace: {args.trace} does not exist")
    halves = turn_counts(args.trace)
    tuning = halves["tuning"]
    prior = SurvivalPrior([t for g in tuning.values() for t in g])
    sib = SiblingPredictor.fit(tuning)
    predictors = {"survival_curve": lambda k, finished, running: prior.remaining(k),
                  "siblings": lambda k, finished, running: sib.remaining(k, finished, running)}
    out = {half: evaluate(groups, predictors) for half, groups in halves.items()}
    rows = [{"half": half, "predictor": name, **vals} for half, res in out.items() for name, vals in res.items()]
    print(format_table(rows, [("half", "half", ""), ("predictor", "predictor", ""), ("mae_turns", "MAE turns", ".2f"),
                              ("spearman_mean", "Spearman", ".3f"), ("predictions", "predictions", "d")]))
    write_json(args.json, {
        "benchmark": "remaining_work",
        "regime": "trace turn counts replayed turn-synchronously per half; fitted on the tuning tasks",
        "trace": args.trace.name, "fit": {"mean": sib.mean, "var_between": sib.var_b, "var_within": sib.var_w,
                                          "tuning_tasks": len(tuning)},
        "halves": out, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
