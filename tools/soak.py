"""Chaos soak: war-train on CPU for N GRPO steps while faults are injected on a schedule.

    python tools/soak.py [--steps 8] [--out runs/soak] [--hang-at-step 2] [--hang-s 40]

Faults, all on the real stack (OpenRLHF's trainer, WAR engines as Ray actors, the calculator
agent):

- tools: a chaos agent file wraps the example agent; by a fixed schedule over its calls, a
  step raises (an error observation: the episode goes on), blocks past ``tool_timeout_s``
  (stopped at the deadline: the episode goes on), or returns garbage (a NaN reward: the
  agent's contract error, the episode fails and its GRPO group is dropped);
- an engine hangs: inside the rollout of step ``--hang-at-step`` (at a tool call of that step
  or an earlier one, so that turns are in flight) one WAR engine's actor process is stopped
  (SIGSTOP) for ``--hang-s`` seconds; the pool's per-turn deadline (``turn_timeout_s``)
  declares it dead and re-dispatches its turns.

Then it checks: the run completed; every step trained on whole GRPO groups (samples a
multiple of the group size, as TensorBoard reports them); the samples trained on are exactly
those of the groups without a failed episode (the dumps; a dropped group's prompt is replaced
by a new one, so the steps stay full while the dataset lasts); the trained model loads. Writes ``<out>/soak.json`` and prints a table (docs/benchmarks.md has a run).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]

CHAOS_AGENT = '''
"""The calculator agent with injected tool faults (tools/soak.py)."""
import asyncio, importlib.util, json, os, sys, time, zlib

import signal, subprocess, threading

from openrlhf.utils.agent import MultiTurnAgentExecutor

_spec = importlib.util.spec_from_file_location("soak_base_agent", {base!r})
_base = importlib.util.module_from_spec(_spec)
sys.modules["soak_base_agent"] = _base
_spec.loader.exec_module(_base)
FAULTS = {faults!r}
SCHEDULE = {schedule!r}   # per call, by a hash of the action: raise / block / garbage / none
BLOCK_S = {block_s!r}
HANG = {hang!r}   # the n-th tool call of this process stops one engine for a while (once)
_calls = [0]
_calls_lock = threading.Lock()


def _record(kind):
    with open(FAULTS, "a") as fh:
        fh.write(json.dumps({{"kind": kind, "t": time.time()}}) + "\\n")


def _maybe_hang():
    """At the HANG["at_call"]-th call: SIGSTOP one engine actor process (turns are in flight,
    since this episode's tool runs inside a rollout), SIGCONT it HANG["seconds"] later."""
    with _calls_lock:
        _calls[0] += 1
        if _calls[0] != HANG["at_call"]:
            return
    try:
        fd = os.open(HANG["record"], os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return  # done once already
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    pids = [int(l.split()[0]) for l in ps.splitlines() if "ray::WarEngine" in l]
    victim = pids[-1] if pids else None
    if victim is not None:
        os.kill(victim, signal.SIGSTOP)

        def resume():
            time.sleep(HANG["seconds"])
            try:
                os.kill(victim, signal.SIGCONT)
            except ProcessLookupError:
                pass

        threading.Thread(target=resume, daemon=True).start()
    os.write(fd, json.dumps({{"pid": victim, "t": time.time(), "call": _calls[0]}}).encode())
    os.close(fd)


class AgentInstance(_base.AgentInstance):
    async def step(self, states, **kwargs):
        _maybe_hang()
        slot = zlib.crc32((states["observation_text"] + states["action_text"]).encode()) % 100
        kind = "none"
        for name, upto in SCHEDULE:
            if slot < upto:
                kind = name
                break
        if kind == "raise":
            _record("raise")
            raise RuntimeError("soak: the tool raised")
        if kind == "block":
            _record("block")
            time.sleep(BLOCK_S)  # a synchronous tool stuck past its deadline
        if kind == "garbage":
            _record("garbage")
            return {{"rewards": float("nan"), "scores": 0.0, "environment_feedback": "", "done": True,
                    "sampling_params": states.get("sampling_params"), "extra_logs": {{}}}}
        return await super().step(states, **kwargs)


class AgentExecutor(MultiTurnAgentExecutor):  # runs this file's instances, not the base file's
    def __init__(self):
        super().__init__(AgentInstance)
'''


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "runs" / "soak"))
    ap.add_argument("--hang-at-step", type=int, default=2)
    ap.add_argument("--hang-s", type=float, default=40.0)
    ap.add_argument("--model", default=str(ROOT / ".cache" / "war_demo_policy"),
                    help="the policy (default: the CPU demo's, built if missing)")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()  # the agent file and its fault records are used by other processes
    if out.exists():
        import shutil

        shutil.rmtree(out)
    out.mkdir(parents=True)
    sys.path.insert(0, str(ROOT))
    from war_openrlhf.metrics import write_json
    from war_openrlhf.cli.cpu_demo import prepare_model

    print("policy:", prepare_model(Path(args.model)), flush=True)
    data = out / "train.jsonl"
    subprocess.run([sys.executable, str(ROOT / "examples" / "arithmetic_calculator" / "dataset.py"), "--out",
                    str(data), "--n", str(8 * args.steps), "--seed", "3", "--level", "basic"], check=True,
                   capture_output=True)
    faults = out / "faults.jsonl"
    schedule = [("raise", 8), ("block", 12), ("garbage", 16)]  # 8% raise, 4% block, 4% garbage
    tool_timeout, turn_timeout = 2.0, 15.0
    agent = out / "chaos_agent.py"
    cfg = yaml.safe_load((ROOT / "configs" / "cpu_demo.yaml").read_text())
    o = cfg["openrlhf"]
    # every episode makes at least one tool call, so a few calls past the earlier steps' episodes
    # land inside the rollout of step --hang-at-step or an earlier one
    per_step = int(o["rollout.batch_size"]) * int(o["rollout.n_samples_per_prompt"])
    hang_record = out / "engine_hung.json"
    hang = {"at_call": (args.hang_at_step - 1) * per_step + 5, "seconds": args.hang_s, "record": str(hang_record)}
    agent.write_text(CHAOS_AGENT.format(base=str(ROOT / "examples" / "arithmetic_calculator" / "agent.py"),
                                        faults=str(faults), schedule=schedule, block_s=tool_timeout + 4.0,
                                        hang=hang))
    o.update({"actor.model_name_or_path": str(Path(args.model).resolve()), "data.prompt_dataset": str(data),
              "data.max_samples": 8 * args.steps, "train.agent_func_path": str(agent),
              "logger.tensorboard_dir": str(out / "tensorboard"), "ckpt.path": str(out / "ckpt"),
              "ckpt.output_dir": str(out / "model")})
    cfg["war"].update({"tool_timeout_s": tool_timeout, "turn_timeout_s": turn_timeout, "progress": False,
                       "on_failed_episode": "drop_group", "dump_dir": str(out / "rollouts")})
    (out / "config.yaml").write_text(yaml.safe_dump(cfg))
    n = int(o["rollout.n_samples_per_prompt"])
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    t0 = time.time()
    with open(out / "train.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "war_openrlhf.cli.train_ppo", "--config", str(out / "config.yaml")],
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        seen, printed_hang = 0, False
        while proc.poll() is None:
            time.sleep(0.25)
            steps = (out / "train.log").read_text(errors="replace").count("Global step ")
            if steps > seen:
                seen = steps
                print(f"  step {steps} done ({time.time() - t0:.0f} s)", flush=True)
            if hang_record.exists() and not printed_hang:
                printed_hang = True
                print(f"  an engine process stopped (SIGSTOP) for {args.hang_s:g} s, {seen} steps done", flush=True)
    wall = time.time() - t0
    text = (out / "train.log").read_text(errors="replace")
    hung = json.loads(hang_record.read_text()) if hang_record.exists() else {}
    if hung.get("pid"):  # the agent's own resume thread may have died with the trainer
        try:
            os.kill(hung["pid"], signal.SIGCONT)
        except ProcessLookupError:
            pass
        hung["t"] = round(hung["t"] - t0, 1)  # seconds into the run
    report = check(out, n, proc.returncode, text, hung=bool(hung.get("pid")))
    injected = {}
    if faults.exists():
        for line in faults.read_text().splitlines():
            kind = json.loads(line)["kind"]
            injected[kind] = injected.get(kind, 0) + 1
    report.update(steps=args.steps, wall_s=round(wall, 1), faults_injected=injected, hang_s=args.hang_s,
                  engine_hung=hung, hung_engine_declared_dead="treated as hung" in text,
                  warm_up_episodes_not_dumped="the warm-up's episodes (one per engine) are not in the dumps")
    write_json(out / "soak.json", {"benchmark": "soak", **report}, indent=2)
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


def check(out: Path, n: int, returncode: int, log: str, hung: bool = False) -> dict:
    """The soak's checks, from TensorBoard, the rollout dumps and the saved model."""
    from war_openrlhf.metrics.tb_scalars import read_scalars

    tags = {t: [v for _, v in points] for t, points in read_scalars(out / "tensorboard").items()}
    samples = tags.get("train/rollout/num_samples", [])
    dropped = tags.get("train/war/groups_dropped", [])
    dumps = sorted((out / "rollouts").glob("rollout_*.jsonl"))
    episodes, failed, failed_reasons = 0, 0, {}
    per_step_expected = []
    for d in dumps:
        trajs = [json.loads(l) for l in d.read_text().splitlines()]
        episodes += len(trajs)
        groups: dict[str, list] = {}
        for t in trajs:
            groups.setdefault(t["group_id"], []).append(t)
            if t["end_reason"] in ("engine_error", "episode_error", "agent_error"):
                failed += 1
                failed_reasons[t["end_reason"]] = failed_reasons.get(t["end_reason"], 0) + 1
        bad = sum(any(t["end_reason"] in ("engine_error", "episode_error", "agent_error") for t in g)
                  for g in groups.values())
        per_step_expected.append(len(trajs) - bad * n)
    model_loads = False
    try:
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(str(out / "model"))
        model_loads = True
    except Exception as exc:  # noqa: BLE001 - reported
        model_loads = f"{type(exc).__name__}: {exc}"
    checks = {
        "run_completed": returncode == 0 and "Global step" in log,
        "whole_groups_every_step": bool(samples) and all(int(s) % n == 0 for s in samples),
        # every healthy group's samples were trained on, none of a failed one (dropped groups'
        # prompts are replaced by new ones, so a step can span two rollout batches)
        "samples_equal_healthy_groups": int(sum(samples)) == sum(per_step_expected),
        "no_failed_episode_trained_on": bool(samples) and sum(samples) <= episodes - failed,
        "model_loads": model_loads is True,
    }
    recovered = int(sum(tags.get("train/war/engines_recovered", [])))
    if hung:  # the stopped engine answers again after --hang-s: engine_recovery (reinstate) brings it back
        checks["hung_engine_back_in_service"] = recovered >= 1
    return {"ok": all(checks.values()), "checks": checks, "episodes": episodes, "failed_episodes": failed,
            "failed_by_reason": failed_reasons, "groups_dropped": [int(x) for x in dropped],
            "samples_per_step": [int(x) for x in samples], "engines_recovered": recovered,
            "engines_healthy_per_step": [int(x) for x in tags.get("train/war/engines_healthy", [])], "samples_lost": 0 if checks["samples_equal_healthy_groups"]
            else None, "model_load_error": None if model_loads is True else model_loads}


if __name__ == "__main__":
    sys.exit(main())
