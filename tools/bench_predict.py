#!/usr/bin/env python
"""How long ``war-predict`` takes on a large trace set: ``--trajectories`` OpenAI-chat trajectories
at ``--engines`` engines (issue target: 1,000 x 32 engines in under a minute).

The trajectories are the tau-bench file's, re-grouped: group g takes the trials of task
g mod 35 (as many GRPO groups of 4 as asked), written to a chat JSONL with a group id per line,
so the run reads, tokenizes, replays and simulates real agent text. Groups that repeat a task's
text draft from each other across groups: the gains printed are not a prediction for any
workload; only the time is the result. The command runs in this process, ``--repeats`` times;
the JSON has each run's wall time and its split (reading and tokenizing, speculation replay,
simulation).

  python tools/bench_predict.py --json benchmarks/results/predict/bench_predict.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from war_openrlhf.metrics import format_table, spread, write_json  # noqa: E402

TRACES = ROOT.parent / "shared" / "traces" / "tau_airline_dev.json"


def write_trace_set(source: Path, trajectories: int, out: Path) -> None:
    records = json.loads(source.read_text())
    by_task: dict[int, list] = {}
    for r in records:
        by_task.setdefault(r["task_id"], []).append(r)
    tasks = sorted(by_task)
    lines = []
    g = 0
    while len(lines) < trajectories:
        for r in by_task[tasks[g % len(tasks)]]:
            if len(lines) < trajectories:
                lines.append(json.dumps({"messages": r["traj"], "group_id": f"g{g}"}))
        g += 1
    out.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=Path, default=TRACES)
    ap.add_argument("--trajectories", type=int, default=1000)
    ap.add_argument("--engines", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if not args.traces.is_file():
        raise SystemExit(f"--traces: {args.traces} not found")
    from war_openrlhf.cli.predict import main as war_predict

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        trace_file = Path(tmp) / "traces.jsonl"
        write_trace_set(args.traces, args.trajectories, trace_file)
        for r in range(args.repeats):
            out = Path(tmp) / f"p{r}.json"
            t0 = time.perf_counter()
            war_predict(["--traces", str(trace_file), "--engines", str(args.engines), "--json", str(out), "--quiet"])
            wall = time.perf_counter() - t0
            d = json.loads(out.read_text())
            runs.append({"wall_s": wall, **{k: float(v) for k, v in d["timing"].items()},
                         "read_s": wall - d["seconds"]})
            print(f"  run {r}: {wall:.1f} s", file=sys.stderr, flush=True)
    rows = [{"part": k, "seconds": spread([x[k] for x in runs])} for k in ("wall_s", "read_s", "prepare_s",
                                                                            "replay_s", "simulate_s")]
    for row in rows:
        row["median"] = row["seconds"]["median"]
    print(format_table(rows, [("part", "part", ""), ("median", "median s", ".1f")]))
    target = rows[0]["median"] <= 60.0
    print(f"target (<= 60 s for {args.trajectories} trajectories x {args.engines} engines): "
          f"{'met' if target else 'missed'}")
    write_json(args.json, {"benchmark": "predict", "regime": f"{args.trajectories} tau-bench trajectories "
                           f"re-grouped in groups of 4, {args.engines} engines, preset h100_qwen7b, default configs",
                           "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                           "runs": runs, "rows": rows, "target_met": target})
    return 0


if __name__ == "__main__":
    sys.exit(main())
