"""The CPU demo: a few GRPO steps through OpenRLHF's real Ray trainer with WAR rollouts.

    python -m war_openrlhf.cli.cpu_demo [--config configs/cpu_demo.yaml] [--out runs/cpu_demo]

1. builds the tiny Llama + BPE tokenizer of :mod:`war_openrlhf.fixtures.tiny_model` locally
   (cached under ``.cache/``) when the config names a directory that does not exist yet
   (a real model directory is used as it is);
2. writes the arithmetic word-problem dataset (``examples/arithmetic_calculator``);
3. runs ``war-train --config configs/cpu_demo.yaml``: 2 WAR engines, the calculator agent,
   OpenRLHF's GRPO trainer, weight sync to the engines after every step;
4. turns the TensorBoard logs into ``<out>/summary.png`` and prints a one-screen summary.

The output directory is cleared first, so the plot and summary describe this run only.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "cpu_demo.yaml"))
    ap.add_argument("--out", default=str(ROOT / "runs" / "cpu_demo"),
                    help="run directory (TensorBoard logs, checkpoints, summary plot)")
    args = ap.parse_args(argv)
    t0 = time.time()
    cfg = yaml.safe_load(Path(args.config).read_text())
    o = cfg["openrlhf"]
    out = Path(args.out).absolute()

    model_dir = Path(o["actor.model_name_or_path"])
    model_dir = model_dir if model_dir.is_absolute() else ROOT / model_dir
    print(f"[1/4] model: {model_dir}", flush=True)
    if not (model_dir / "config.json").is_file() or (model_dir / "war_tiny_model.json").is_file():
        from ..fixtures.tiny_model import build_tiny_model

        build_tiny_model(model_dir)

    data = Path(o["data.prompt_dataset"])
    data = data if data.is_absolute() else ROOT / data
    print(f"[2/4] dataset: {data}", flush=True)
    data.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, str(ROOT / "examples" / "arithmetic_calculator" / "dataset.py"),
                    "--out", str(data), "--n", "256", "--seed", "0"], check=True, stdout=subprocess.DEVNULL)

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    o.update({"actor.model_name_or_path": str(model_dir), "data.prompt_dataset": str(data),
              "logger.tensorboard_dir": str(out / "tensorboard"), "ckpt.path": str(out / "ckpt"),
              "ckpt.output_dir": str(out / "model"), "logger.wandb.run_name": "cpu_demo"})
    agent = Path(o["train.agent_func_path"])
    o["train.agent_func_path"] = str(agent if agent.is_absolute() else ROOT / agent)
    run_cfg = out / "config.yaml"
    run_cfg.write_text(yaml.safe_dump(cfg, sort_keys=False))
    print(f"[3/4] training: war-train --config {run_cfg}  (log: {out / 'train.log'})", flush=True)
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

    from ..metrics.run_summary import load_scalars, plot, summary_lines

    print("[4/4] summary", flush=True)
    scalars = load_scalars(out / "tensorboard")
    png = out / "summary.png"
    plot(scalars, png)
    print()
    print("\n".join(summary_lines(scalars)))
    print(f"\nTensorBoard logs: {out / 'tensorboard'}   (tensorboard --logdir {out / 'tensorboard'})")
    print(f"Summary plot:     {png}")
    print(f"Trained policy:   {out / 'model'}")
    print(f"Total time:       {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
