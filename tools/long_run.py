"""A long war-train run: does anything grow without bound over hundreds of steps?

    python tools/long_run.py [--steps 300] [--out runs/long_run] \
        [--json benchmarks/results/long_run/long_run.json] [--plot long_run.png]

The real stack on CPU (OpenRLHF's trainer, two WAR engines as Ray actors, the calculator agent,
the tiny local model: short turns), one GRPO step after another over a prompt set that recurs
every epoch, as a long job's does. Sampled every ``--sample-s`` seconds from outside: the
resident memory of the driver, the trainer, the policy and reference actors and each engine
actor, and the shared memory in use (``/dev/shm``, where Ray keeps its object store). Logged
by war-train at every step (TensorBoard): the index replica's records and tokens, the pool's
log entries and record archive, the dispatcher's per-trajectory state and survival history.

The index's token budget is set low (``--index-token-budget``) so that the run reaches it before
the warm-up step: a bounded index is one that stays at its budget. Each quantity's level after warm-up (its peak over steps ``--warm-up`` +/- 5) is compared with
its level at the end (its peak over the last 10 steps); target: none grows by more than 10%.
Writes the JSON (every sample), a table and a plot.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]

#: process kinds by what Ray names them in the command line (first match wins)
KINDS = (("engine", "WarEngine"), ("trainer", "WarPPOTrainer"), ("policy", "PolicyModelActor"),
         ("reference", "ReferenceModelActor"), ("raylet", "raylet"), ("gcs", "gcs_server"))
#: war-train's per-step scalars followed here
SCALARS = ("war/index_records", "war/index_tokens", "war/log_entries", "war/archive_records",
           "war/dispatch_state_entries", "war/dispatch_survival_history")


def _shm_bytes() -> int:
    total = 0
    for p in Path("/dev/shm").iterdir():
        try:
            total += p.stat().st_blocks * 512
        except OSError:
            pass
    return total


def _sample(root_pid: int) -> dict[str, float]:
    """Resident MiB per process kind (engines one by one) in ``root_pid``'s process tree, and /dev/shm."""
    import psutil

    out: dict[str, float] = {}
    try:
        procs = [psutil.Process(root_pid)] + psutil.Process(root_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return out
    engines = []
    for p in procs:
        try:
            cmd = " ".join(p.cmdline())
            rss = p.memory_info().rss / 2 ** 20
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if p.pid == root_pid:
            out["driver"] = rss
            continue
        kind = next((k for k, key in KINDS if key in cmd), None)
        if kind == "engine":
            engines.append((p.pid, rss))
        elif kind is not None:
            out[kind] = out.get(kind, 0.0) + rss
    for i, (_, rss) in enumerate(sorted(engines)):
        out[f"engine{i}"] = rss
    out["shm"] = _shm_bytes() / 2 ** 20
    return out


def _scalars(logdir: Path) -> dict[str, dict[int, float]]:
    from war_openrlhf.metrics.tb_scalars import read_scalars

    raw = read_scalars(logdir)
    return {tag: dict(raw[f"train/{tag}"]) for tag in SCALARS if f"train/{tag}" in raw}


def _level(by_step: dict[int, float], lo: int, hi: int) -> float | None:
    """The peak over steps ``lo..hi`` (an index at its budget saw-tooths between 75% and 100% of
    it; memory is bounded by its peaks)."""
    vals = [v for s, v in by_step.items() if lo <= s <= hi]
    return max(vals) if vals else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warm-up", type=int, default=50, help="the step whose level is the baseline")
    ap.add_argument("--prompts", type=int, default=64, help="distinct prompts (recurring every epoch)")
    ap.add_argument("--sample-s", type=float, default=2.0)
    ap.add_argument("--index-token-budget", type=int, default=8000,
                    help="the index replicas' token budget (reached after ~40 steps of this run)")
    ap.add_argument("--out", default=str(ROOT / "runs" / "long_run"))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot")
    args = ap.parse_args(argv)
    if args.steps < args.warm_up + 20:
        raise SystemExit("--steps must exceed --warm-up by at least 20")
    out = Path(args.out)
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    sys.path.insert(0, str(ROOT))
    from war_openrlhf.fixtures.tiny_model import build_tiny_model
    from war_openrlhf.metrics import write_json

    model = build_tiny_model(ROOT / ".cache" / "war_tiny_llama")
    data = out / "train.jsonl"
    subprocess.run([sys.executable, str(ROOT / "examples" / "arithmetic_calculator" / "dataset.py"), "--out",
                    str(data), "--n", str(args.prompts), "--seed", "6"], check=True, capture_output=True)
    batch = 2
    epochs = math.ceil(args.steps * batch / args.prompts)
    cfg = yaml.safe_load((ROOT / "configs" / "cpu_demo.yaml").read_text())
    cfg["openrlhf"].update({"actor.model_name_or_path": str(model), "data.prompt_dataset": str(data),
                            "data.max_samples": args.prompts, "data.max_len": 512, "rollout.batch_size": batch,
                            "rollout.n_samples_per_prompt": 2, "rollout.micro_batch_size": 2,
                            "train.batch_size": 4, "train.micro_batch_size": 2, "train.num_episodes": epochs,
                            "logger.tensorboard_dir": str(out / "tensorboard"), "ckpt.path": str(out / "ckpt"),
                            "ckpt.output_dir": str(out / "model"), "ckpt.save_steps": -1})
    cfg["war"].update({"max_turns": 2, "max_new_tokens_per_turn": 32, "progress": False})
    # an index budget the run outgrows early (the default, 4M tokens, would take ~20,000 of these
    # steps): past it the replicas and the archive evict, and stay at the budget
    cfg["war"].setdefault("engine", {}).setdefault("index", {})["token_budget"] = args.index_token_budget
    (out / "config.yaml").write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "war_openrlhf.cli.train_ppo", "--config", str(out / "config.yaml")]
    samples: list[dict] = []
    log_path = out / "train.log"
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        stop = threading.Event()

        def monitor():
            while not stop.is_set():
                step = log_path.read_text(errors="replace").count("Global step ")
                s = _sample(proc.pid)
                if s:
                    samples.append({"t": time.time() - t0, "step": step, **s})
                stop.wait(args.sample_s)

        th = threading.Thread(target=monitor, daemon=True)
        th.start()
        last = -1
        while proc.poll() is None:
            time.sleep(5)
            step = log_path.read_text(errors="replace").count("Global step ")
            if step // 25 != last // 25:
                print(f"  step {step} ({time.time() - t0:.0f} s)", flush=True)
            last = step
            if step >= args.steps:
                break
        stop.set()
        th.join()
        if proc.poll() is None:  # enough steps: end the run (its group)
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    steps_done = log_path.read_text(errors="replace").count("Global step ")
    scalars = _scalars(out / "tensorboard")
    series: dict[str, dict[int, float]] = {k: v for k, v in scalars.items()}
    for key in sorted({k for s in samples for k in s} - {"t", "step"}):
        by: dict[int, list[float]] = {}
        for s in samples:
            if key in s and s["step"] > 0:
                by.setdefault(s["step"], []).append(s[key])
        series[f"rss_mib/{key}" if key != "shm" else "shm_mib"] = {st: max(v) for st, v in by.items()}
    last_step = max((s for v in series.values() for s in v), default=0)
    rows = []
    for name, by_step in sorted(series.items()):
        base = _level(by_step, args.warm_up - 5, args.warm_up + 5)
        end = _level(by_step, last_step - 9, last_step)
        growth = (end / base - 1.0) if base else (0.0 if end == 0 else None)
        rows.append({"quantity": name, "at_warm_up": base, "at_end": end, "growth": growth,
                     "bounded": growth is not None and growth <= 0.10})
    result = {"benchmark": "long_run", "steps_requested": args.steps, "steps_done": steps_done,
              "warm_up_step": args.warm_up, "last_step": last_step, "prompts": args.prompts, "epochs": epochs,
              "seconds": time.time() - t0, "rows": rows, "series": {k: {str(s): v for s, v in sorted(d.items())}
                                                                      for k, d in series.items()},
              "target_met": bool(rows) and all(r["bounded"] for r in rows)}
    print(f"{steps_done} steps in {result['seconds']:.0f} s")
    print(f"{'quantity':40s} {'at step ' + str(args.warm_up):>14s} {'at the end':>12s} {'growth':>8s}")
    for r in rows:
        g = f"{100 * r['growth']:+.1f}%" if r["growth"] is not None else "-"
        print(f"{r['quantity']:40s} {r['at_warm_up'] or 0:14.1f} {r['at_end'] or 0:12.1f} {g:>8s}")
    written = write_json(args.json, result)
    if written:
        print(f"wrote {written}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = [r["quantity"] for r in rows]
        fig, axes = plt.subplots(math.ceil(len(names) / 3), 3, figsize=(12, 2.6 * math.ceil(len(names) / 3)))
        for ax, name in zip(axes.flat, names):
            d = series[name]
            xs = sorted(d)
            ax.plot(xs, [d[x] for x in xs])
            ax.axvline(args.warm_up, color="grey", lw=0.8)
            ax.set_title(name, fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)
    return 0 if result["target_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
