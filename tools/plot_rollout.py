#!/usr/bin/env python
"""Plot a real-engine rollout benchmark (``tools/bench_rollout.py`` JSON): speed-up over
OpenRLHF's own rollout path per configuration, median with the spread of the repeats, and
the simulator's prediction where the run has one (``--cost-model``).

    python tools/plot_rollout.py results/bench_rollout_traces_report_p2_sim.json \\
        --out docs/img/rollout_traces_p2.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def speedups(result: dict) -> dict[str, tuple[float, float, float]]:
    """config -> (median, min, max) of openrlhf's median step time / the config's step times."""
    runs = result["runs"]
    if not runs.get("openrlhf"):
        raise SystemExit("the benchmark has no openrlhf runs: nothing to compare against")
    base = statistics.median(r["step_s"] for r in runs["openrlhf"])
    out = {}
    for name, rs in runs.items():
        xs = [base / r["step_s"] for r in rs]
        out[name] = (statistics.median(xs), min(xs), max(xs))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    try:
        result = json.loads(args.json.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"{args.json}: cannot read the benchmark JSON ({exc})")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = speedups(result)
    names = list(xs)
    med = [xs[n][0] for n in names]
    err = [[xs[n][0] - xs[n][1] for n in names], [xs[n][2] - xs[n][0] for n in names]]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.bar(range(len(names)), med, yerr=err, capsize=4, color="#4c72b0", label="measured (median, spread)")
    sim = result.get("simulated") or {}
    if sim:
        ax.scatter([i for i, n in enumerate(names) if n in sim], [sim[n] for n in names if n in sim],
                   marker="D", color="#dd8452", zorder=3, label="simulated")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right")
    ax.set_ylabel("speed-up over openrlhf (step time)")
    regime = result.get("regime") or {}
    pressure = regime.get("pressure")
    ax.set_title(f"{result.get('workload', '')}: {result.get('engines')} engines, load {regime.get('load')}, "
                 f"pressure {pressure:.2f}" if pressure else f"{result.get('workload', '')}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
