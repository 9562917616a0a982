"""The CPU demo: GRPO through OpenRLHF's real Ray trainer with WAR rollouts, on a 2-core machine.

    python -m war_openrlhf.cli.cpu_demo [--config configs/cpu_demo.yaml] [--out runs/cpu_demo]
                                        [--seed N] [--no-compare] [--json FILE]

1. builds the demo's agent policy locally when the config's model directory does not hold
   it yet (cached): the tiny Llama of :mod:`war_openrlhf.fixtures.tiny_policy`, trained
   by SFT on scripted calculator episodes of the arithmetic task's ``basic`` level (one
   operation per problem) from a teacher that uses the wrong operation in half of them
   (``slip_rate``), so that it calls the tool and answers in the task's format and, sampled
   as GRPO samples it, solves about half of the problems: GRPO has something to fix that a
   reward reveals and a ~1M-parameter model can learn in a few dozen steps;
2. writes the dataset: basic-level problems from another seed than the policy's;
3. runs ``war-train --config configs/cpu_demo.yaml``: 2 WAR engines, the calculator agent,
   OpenRLHF's GRPO trainer, weight sync to the engines after every step;
4. rolls the same prompts once through OpenRLHF's own rollout path and once through the
   WAR pool with the trained policy (``tools/bench_rollout.py``: same engines count and
   settings, one warm-up each first) and reports the measured ratio;
5. turns the TensorBoard logs into ``<out>/summary.png`` and prints a one-screen summary.

Every run writes its record (``<out>/demo_run.json``, or ``--json FILE``): the time of each
stage and of the whole job (with the install time ``scripts/main.sh`` measured, when it ran it),
the machine's peak memory in use (:mod:`war_openrlhf.metrics.memory_watch`), the rewards and
drafting figures of the summary and the side-by-side steps; ``docs/benchmarks.md`` renders
committed records.

A config whose model directory holds some other model (``config.json`` and no policy
manifest) trains that model as it is. The output directory is cleared first, so the plot
and summary describe this run only.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from ..config_checks import config_path
from ..metrics import write_json
from ..metrics.memory_watch import MemoryWatch

ROOT = Path(__file__).resolve().parents[2]

# The demo's policy (tiny_policy.build_tiny_policy arguments): the arithmetic task only, at
# its basic level, SFT on a teacher that slips on half of the episodes; it calls the
# calculator in the task's format every time and solves about half of the held-out problems
# when sampled (its manifest's held-out check says how many).
DEMO_POLICY = {
    "tasks": ["arithmetic_calculator"],
    "arithmetic_level": "basic",
    "steps": 500,
    "slip_rate": 0.5,
    "n_eval": 40,
    "n_samples": 4,
    "tie_embeddings": True,
}
DATASET_SEED = 1  # the policy trains on seed 0's problems
DATASET_ROWS = 512


def _absolute(path: str | os.PathLike) -> Path:
    p = Path(path)
    return p if p.is_absolute() else ROOT / p


def prepare_model(model_dir: Path) -> str:
    """Build the demo policy at ``model_dir`` unless it holds another model; says which."""
    from ..fixtures.tiny_policy import build_tiny_policy, read_manifest

    if (model_dir / "config.json").is_file() and read_manifest(model_dir) is None:
        return "a model directory (used as it is)"
    build_tiny_policy(model_dir, **DEMO_POLICY)
    held = (read_manifest(model_dir) or {}).get("results", {}).get("held_out", {}).get("arithmetic_calculator", {})
    return (f"the demo policy: held-out success when sampled as GRPO samples (temperature 1) "
            f"{held.get('sampled_episode_mean_reward', 'n/a')}, greedy {held.get('episode_mean_reward', 'n/a')}")


def _train(run_cfg: Path, out: Path, t0: float) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    with open(out / "train.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "war_openrlhf.cli.train_ppo", "--config", str(run_cfg)],
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        steps_seen = 0
        while proc.poll() is None:  # progress: one line per finished GRPO step
            time.sleep(2)
            text = (out / "train.log").read_text(errors="replace")
            steps = text.count("Global step ")
            if steps > steps_seen:
                steps_seen = steps
                print(f"      GRPO step {steps} done ({time.time() - t0:.0f} s)", flush=True)
    if proc.returncode != 0:
        tail = (out / "train.log").read_text(errors="replace")[-3000:]
        raise SystemExit(f"war-train failed (exit {proc.returncode}); last lines of {out / 'train.log'}:\n{tail}")


def compare_rollouts(model: Path, data: Path, out: Path, engines: int, prompts_per_engine: int,
                     n_samples: int, max_len: int) -> dict | None:
    """Synchronous rollout steps on equal work through OpenRLHF's path and the WAR pool
    (``tools/bench_rollout.py``: one free-sampled step of the prompts recorded, then replayed by
    both with every turn forced to its recorded length; a warm-up each, then 3 repeats in
    rotating order; median and spread); its JSON, or None if it failed."""
    js = out / "side_by_side.json"
    cmd = [sys.executable, str(ROOT / "tools" / "bench_rollout.py"), "--workload", "task:arithmetic_calculator",
           "--prompts", str(data), "--model", str(model), "--configs", "openrlhf,war", "--repeats", "3",
           "--same-engines",
           "--engines", str(engines), "--load", "high", "--high-prompts", str(prompts_per_engine),
           "--n-samples", str(n_samples), "--max-len", str(max_len), "--json", str(js)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    with open(out / "side_by_side.log", "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0 or not js.is_file():
        print(f"      side-by-side failed (exit {proc.returncode}); see {out / 'side_by_side.log'}", flush=True)
        return None
    return json.loads(js.read_text())


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments, run the demo under a memory watch, write its record."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(config_path("cpu_demo")))
    ap.add_argument("--out", default=str(ROOT / "runs" / "cpu_demo"),
                    help="run directory (TensorBoard logs, checkpoints, summary plot)")
    ap.add_argument("--seed", type=int, default=None, help="training seed (default: the config's train.seed)")
    ap.add_argument("--no-compare", action="store_true",
                    help="skip the side-by-side rollout step (OpenRLHF's path vs the WAR pool)")
    ap.add_argument("--json", default=None,
                    help="where to write the run's record (default: <out>/demo_run.json)")
    args = ap.parse_args(argv)
    with MemoryWatch() as memory:
        record = _demo(args)
    record["memory"] = memory.summary()
    install_s = os.environ.get("WAR_INSTALL_S")
    record["install_s"] = float(install_s) if install_s else None
    how = ["bash", "scripts/main.sh"] if install_s else ["python", "-m", "war_openrlhf.cli.cpu_demo"]
    path = write_json(args.json or Path(record["out"]) / "demo_run.json", record,
                      command=shlex.join(how + list(sys.argv[1:] if argv is None else argv)))
    mem = record["memory"]
    print(f"Peak memory:      {mem['peak_gib']:.1f} GiB in use on the machine "
          f"({mem['peak_added_gib']:.1f} GiB above the {mem['baseline_gib']:.1f} GiB before the demo)")
    print(f"Run record:       {path}")


def _demo(args) -> dict:
    """The demo's five stages; returns the run's record (stage times, summary figures,
    the side-by-side). One function over 80 lines on purpose: it reads as the README lists
    the stages, each a call of its own."""
    t0 = time.time()
    stages: dict[str, float] = {}
    cfg = yaml.safe_load(Path(args.config).read_text())
    o = cfg["openrlhf"]
    out = Path(args.out).absolute()

    model_dir = _absolute(o["actor.model_name_or_path"])
    print(f"[1/5] policy: {model_dir}", flush=True)
    what = prepare_model(model_dir)
    stages["policy"] = time.time() - t0
    print(f"      {what} ({time.time() - t0:.0f} s)", flush=True)

    data = _absolute(o["data.prompt_dataset"])
    print(f"[2/5] dataset: {data}", flush=True)
    data.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, str(ROOT / "examples" / "arithmetic_calculator" / "dataset.py"),
                    "--out", str(data), "--n", str(DATASET_ROWS), "--seed", str(DATASET_SEED), "--level", "basic"],
                   check=True, stdout=subprocess.DEVNULL)

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    o.update({"actor.model_name_or_path": str(model_dir), "data.prompt_dataset": str(data),
              "logger.tensorboard_dir": str(out / "tensorboard"), "ckpt.path": str(out / "ckpt"),
              "ckpt.output_dir": str(out / "model"), "logger.wandb.run_name": "cpu_demo"})
    if args.seed is not None:
        o["train.seed"] = args.seed
    o["train.agent_func_path"] = str(_absolute(o["train.agent_func_path"]))
    run_cfg = out / "config.yaml"
    run_cfg.write_text(yaml.safe_dump(cfg, sort_keys=False))
    print(f"[3/5] training: war-train --config {run_cfg}  (log: {out / 'train.log'})", flush=True)
    t = time.time()
    stages["dataset"] = t - t0 - stages["policy"]
    _train(run_cfg, out, t0)
    stages["training"] = time.time() - t

    comparison = None
    t = time.time()
    if not args.no_compare:
        print("[4/5] side by side: rollout steps (median of 3), OpenRLHF's path vs the WAR pool, trained policy, "
              f"equal work: one recorded step replayed by both (log: {out / 'side_by_side.log'})", flush=True)
        n = int(o["rollout.n_samples_per_prompt"])
        result = compare_rollouts(out / "model", data, out, int(o["vllm.num_engines"]),
                                  max(1, int(o["rollout.batch_size"]) // int(o["vllm.num_engines"])), n,
                                  int(o["data.max_len"]))
        if result:
            configs = {c: result["configs"][c] for c in ("openrlhf", "war") if c in result["configs"]}
            r = result.get("regime", {})
            comparison = {"configs": configs,
                          "regime": (f"{r.get('load', '?')} load ({r.get('episodes_per_engine', 0):g} episodes/engine), "
                                     "no KV pressure, calculator tool (~0 s), equal work (one recorded step replayed, "
                                     "every turn at its recorded length); median of 3 steps each after a warm-up")}
    else:
        print("[4/5] side by side: skipped (--no-compare)", flush=True)
    stages["side_by_side"] = time.time() - t

    from ..metrics.run_summary import load_scalars, plot, summary_lines, summary_values

    print("[5/5] summary", flush=True)
    scalars = load_scalars(out / "tensorboard")
    png = out / "summary.png"
    plot(scalars, png, comparison)
    print()
    print("\n".join(summary_lines(scalars)))
    if comparison and "openrlhf" in comparison["configs"] and "war" in comparison["configs"]:
        base, war = comparison["configs"]["openrlhf"], comparison["configs"]["war"]
        spread = lambda d: "-".join(f"{x:.2f}" for x in d.get("step_s_spread", []))  # noqa: E731
        print(f"rollout step, same prompts:  openrlhf {base['step_s']:.2f} s ({spread(base)}), war "
              f"{war['step_s']:.2f} s ({spread(war)}) -> {base['step_s'] / war['step_s']:.2f}x  (median of 3 "
              "steps each, min-max in brackets)")
        print(f"                             tokens/s: openrlhf {base['throughput_tok_s']:,.0f}, war "
              f"{war['throughput_tok_s']:,.0f} -> {war['throughput_tok_s'] / base['throughput_tok_s']:.2f}x")
        print("  Equal work: both paths replayed one recorded step of the trained policy, every turn forced to "
              "its recorded length, so the ratio is speed, not which path drew the longest episode; repeats "
              "of one step on a 2-core CPU still move (the min-max in brackets).")
    print(f"\nTensorBoard logs: {out / 'tensorboard'}   (tensorboard --logdir {out / 'tensorboard'})")
    print(f"Summary plot:     {png}")
    print(f"Trained policy:   {out / 'model'}")
    total = time.time() - t0
    print(f"Total time:       {total:.0f} s")
    stages["summary"] = total - sum(stages.values())
    side = None
    if comparison and "openrlhf" in comparison["configs"] and "war" in comparison["configs"]:
        keep = ("step_s", "step_s_runs", "step_s_spread", "throughput_tok_s", "x_openrlhf")
        side = {"regime": comparison["regime"],
                "configs": {c: {k: v.get(k) for k in keep} for c, v in comparison["configs"].items()},
                "x_openrlhf": comparison["configs"]["openrlhf"]["step_s"] / comparison["configs"]["war"]["step_s"]}
    return {"out": str(out), "seed": o.get("train.seed"), "policy": what, "demo_s": total, "stages_s": stages,
            "summary": summary_values(scalars), "side_by_side": side}


if __name__ == "__main__":
    main()
