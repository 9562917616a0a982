"""Kill war-train mid-step and restart it with the same command: does it resume, warm?

    python tools/resume_check.py [--steps 5] [--kill-after-step 2] [--out runs/resume_check] \
        [--json benchmarks/results/resume/resume_check.json]

On the real stack (OpenRLHF's trainer, WAR engines as Ray actors, the CPU demo's calculator
policy), with OpenRLHF's checkpoint every step (``ckpt.save_steps 1``) and its resume flag
(``ckpt.load_enable``) in the one command:

1. run it; once step ``--kill-after-step`` is checkpointed and the next step's rollout is
   under way, SIGKILL the whole process group (the driver, Ray, the trainer and the engines);
2. run the same command again: OpenRLHF resumes from its last checkpoint, WAR restores the
   rollout state saved with it (``rollout/checkpoint.py``);
3. run it a third time from a copy of the checkpoint without WAR's state (the cold baseline:
   what a resume gave before WAR saved anything).

Checks and reports: the resumed run starts at the step after the checkpoint (the killed step
is redone, no finished step is), no prompt is rolled out more often than the dataset holds it
(the killed step's first try aside), the index records restored,
and the drafting at the first resumed step (TensorBoard ``war/spec_acceptance_rate`` and
``war/tokens_per_verification_step``) against the step before the kill and against the cold
baseline. Target: acceptance at the first resumed step within 20% of the step before the kill
(the acceptance rate falls when drafts get longer, so tokens per verification step is reported
beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _scalars(logdir: Path, tag: str) -> dict[int, float]:
    from war_openrlhf.metrics.tb_scalars import read_scalars

    return dict(read_scalars(logdir).get(tag, []))


def _run(cmd, env, log_path: Path, kill_after_step: int | None = None, timeout_s: float = 1800,
         kill_delay_s: float = 1.5) -> dict:
    """Run ``cmd`` (its own process group) to the end, or SIGKILL the group ``kill_delay_s``
    after step ``kill_after_step`` was checkpointed (inside the next step's rollout)."""
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        killed_at = None
        while proc.poll() is None:
            time.sleep(0.2)
            if time.time() - t0 > timeout_s:
                os.killpg(proc.pid, signal.SIGKILL)
                raise SystemExit(f"{log_path}: no end after {timeout_s:.0f} s")
            if kill_after_step is not None and killed_at is None:
                text = log_path.read_text(errors="replace")
                if f"saved the rollout state of step {kill_after_step} " in text:
                    time.sleep(kill_delay_s)  # the next step's generation is under way
                    os.killpg(proc.pid, signal.SIGKILL)
                    killed_at = time.time() - t0
        proc.wait()
    time.sleep(3.0)  # let the killed group's sockets and files go
    return {"returncode": proc.returncode, "seconds": time.time() - t0, "killed_after_s": killed_at}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--kill-after-step", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "runs" / "resume_check"))
    ap.add_argument("--model", default=str(ROOT / ".cache" / "war_demo_policy"),
                    help="the policy (default: the CPU demo's, built if missing)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if not 1 <= args.kill_after_step < args.steps:
        raise SystemExit("--kill-after-step must be in [1, --steps)")
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    sys.path.insert(0, str(ROOT))
    from war_openrlhf.cli.cpu_demo import prepare_model
    from war_openrlhf.metrics import write_json

    print("policy:", prepare_model(Path(args.model)), flush=True)
    data = out / "train.jsonl"
    subprocess.run([sys.executable, str(ROOT / "examples" / "arithmetic_calculator" / "dataset.py"), "--out",
                    str(data), "--n", str(8 * args.steps), "--seed", "5", "--level", "basic"], check=True,
                   capture_output=True)
    cfg = yaml.safe_load((ROOT / "configs" / "cpu_demo.yaml").read_text())
    o = cfg["openrlhf"]
    o.update({"actor.model_name_or_path": str(Path(args.model).resolve()), "data.prompt_dataset": str(data),
              "data.max_samples": 8 * args.steps, "logger.tensorboard_dir": str(out / "tensorboard"),
              "ckpt.path": str(out / "ckpt"), "ckpt.output_dir": str(out / "model"), "ckpt.save_steps": 1,
              "ckpt.load_enable": True})
    cfg["war"].update({"progress": False, "dump_dir": str(out / "rollouts")})
    (out / "config.yaml").write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "war_openrlhf.cli.train_ppo", "--config", str(out / "config.yaml")]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    k = args.kill_after_step

    print(f"run 1: killed once step {k} is checkpointed", flush=True)
    first = _run(cmd, env, out / "run1.log", kill_after_step=k)
    if first["killed_after_s"] is None:
        raise SystemExit(f"run 1 ended before step {k} was checkpointed: {out / 'run1.log'}")
    dumps_run1 = len(list((out / "rollouts").glob("rollout_*.jsonl")))
    cold_copy = out / "ckpt_cold"
    shutil.copytree(out / "ckpt", cold_copy)
    shutil.rmtree(cold_copy / "_war")
    print("run 2: the same command", flush=True)
    second = _run(cmd, env, out / "run2.log")
    log2 = (out / "run2.log").read_text(errors="replace")
    resumed = re.search(r"resumed the rollout state of step (\d+) from \S+: (\d+) index records", log2)
    steps2 = sorted({int(s) for s in re.findall(r"Global step (\d+):", log2)})

    print("run 3: the same resume without WAR's state (cold)", flush=True)
    cold_cfg = yaml.safe_load((out / "config.yaml").read_text())
    cold_cfg["openrlhf"].update({"ckpt.path": str(cold_copy), "logger.tensorboard_dir": str(out / "tensorboard_cold"),
                                 "ckpt.output_dir": str(out / "model_cold")})
    cold_cfg["war"]["dump_dir"] = str(out / "rollouts_cold")
    (out / "config_cold.yaml").write_text(yaml.safe_dump(cold_cfg))
    third = _run([*cmd[:-1], str(out / "config_cold.yaml")], env, out / "run3.log")
    log3 = (out / "run3.log").read_text(errors="replace")

    acc = _scalars(out / "tensorboard", "train/war/spec_acceptance_rate")
    tpv = _scalars(out / "tensorboard", "train/war/tokens_per_verification_step")
    acc_cold = _scalars(out / "tensorboard_cold", "train/war/spec_acceptance_rate")
    tpv_cold = _scalars(out / "tensorboard_cold", "train/war/tokens_per_verification_step")
    from collections import Counter

    samples = []  # per dump: samples per prompt text
    for p in sorted((out / "rollouts").glob("rollout_*.jsonl")):
        samples.append(Counter(json.loads(line)["prompt"] for line in p.read_text().splitlines()))
    # a prompt text may be in the dataset more than once: it may be rolled out that many times
    n = int(cfg["openrlhf"]["rollout.n_samples_per_prompt"])
    allowed = Counter(json.loads(line)["prompt"] for line in data.read_text().splitlines())
    trained = sum(samples[:k], Counter()) + sum(samples[dumps_run1:], Counter())  # the killed step's first try aside
    repeated = sum(1 for p, c in trained.items() if c > allowed[p] * n)
    after_restart = samples[dumps_run1:]
    killed_redone = (dumps_run1 > k and bool(after_restart) and samples[k] == after_restart[0])
    prompts = samples
    first_resumed = k + 1
    before, after = acc.get(k), acc.get(first_resumed)
    within = (before is not None and after is not None and before > 0 and abs(after / before - 1) <= 0.2)
    result = {
        "benchmark": "resume_check", "steps": args.steps, "kill_after_step": k,
        "run1": first, "run2": second, "run3_cold": third,
        "resumed_from_step": int(resumed.group(1)) if resumed else None,
        "restored_index_records": int(resumed.group(2)) if resumed else None,
        "steps_run_after_restart": steps2, "cold_run_says": ("cold rollouts" in log3),
        "prompts_rolled_out_too_often": repeated, "dumps": len(prompts), "dumps_before_kill": dumps_run1,
        "killed_step_dumped_before_kill": dumps_run1 > k, "killed_step_redone_with_its_prompts": killed_redone,
        "acceptance_by_step": acc, "tokens_per_verification_step_by_step": tpv,
        "cold_acceptance_by_step": acc_cold, "cold_tokens_per_verification_step_by_step": tpv_cold,
        "acceptance_before_kill": before, "acceptance_first_resumed_step": after,
        "acceptance_first_resumed_step_cold": acc_cold.get(first_resumed),
        "target_within_20pct": within,
    }
    ok = (second["returncode"] == 0 and third["returncode"] == 0 and resumed is not None
          and int(resumed.group(1)) == k and steps2 and steps2[0] == first_resumed and steps2[-1] == args.steps
          and repeated == 0)
    result["resume_ok"] = bool(ok)
    print(json.dumps({key: result[key] for key in ("resume_ok", "resumed_from_step", "restored_index_records",
                                                   "steps_run_after_restart", "prompts_rolled_out_too_often",
                                                   "acceptance_before_kill", "acceptance_first_resumed_step",
                                                   "acceptance_first_resumed_step_cold", "target_within_20pct")},
                     indent=1))
    written = write_json(args.json, result)
    if written:
        print(f"wrote {written}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
