"""Turn a training run's TensorBoard logs into a PNG summary and a one-screen text summary.

    python tools/plot_run.py --logdir runs/cpu_demo/tensorboard --out runs/cpu_demo/summary.png

Reads every event file under ``--logdir`` (OpenRLHF's ``train/...`` scalars and the WAR rollout
scalars ``war/...``); plots rewards, rollout throughput, speculation, prefix-cache hits,
per-engine load, the step-time split and episode lengths; prints the summary.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from war_openrlhf.metrics.run_summary import load_scalars, plot, summary_lines  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--logdir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    try:
        scalars = load_scalars(Path(args.logdir))
    except ValueError as exc:
        raise SystemExit(f"--{exc}") from None
    plot(scalars, Path(args.out))
    print("\n".join(summary_lines(scalars)))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
