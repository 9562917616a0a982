"""``war-train``: a short GRPO run through OpenRLHF's real trainer classes with WAR engines and
the WAR pool (tiny local model, CPU, 2 steps), its TensorBoard scalars, and the proof that
rollouts after step 1 come from the updated weights; plus config validation."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
# GRPO runs through OpenRLHF's trainers with real engines: minutes each on two CPU cores
# (the default, setup.cfg, is 300 s a test)
pytestmark = pytest.mark.timeout(600)
MODEL_DIR = Path(os.environ.get("WAR_TINY_MODEL_DIR", ROOT / ".cache" / "war_tiny_llama"))


def test_cli_config_errors_name_key_and_file(tmp_path):
    from war_openrlhf.cli.train_ppo import openrlhf_argv, parse_argv

    bad = tmp_path / "run.yaml"
    bad.write_text("openrlhf: {}\nwar:\n  dispatch_policy: war\n  max_turn: 3\n")
    with pytest.raises(ValueError, match=r"run.yaml: unknown key 'max_turn'"):
        parse_argv(["--config", str(bad)])
    bad.write_text("openrlhf: {}\nwar:\n  engine:\n    speculation: sometimes\n")
    with pytest.raises(ValueError, match="speculation"):
        parse_argv(["--config", str(bad)])
    bad.write_text("trainer: {}\n")
    with pytest.raises(ValueError, match="run.yaml: unknown section 'trainer'"):
        parse_argv(["--config", str(bad)])
    with pytest.raises(ValueError, match="tool_timeout_s"):
        parse_argv(["--war.tool_timeout_s", "soon"])
    war, rest = parse_argv(["--actor.model_name_or_path", "m", "--war.engine.speculation", "off",
                            "--war.max_turns=3", "--train.async_enable"])
    assert war == {"engine": {"speculation": "off"}, "max_turns": 3}
    assert rest == ["--actor.model_name_or_path", "m", "--train.async_enable"]
    assert openrlhf_argv({"a.b": 1, "flag": True, "off": False, "lst": [0, 1]}, "x") == \
        ["--a.b", "1", "--flag", "--lst", "0", "1"]
    cfg = yaml.safe_load((ROOT / "configs" / "cpu_demo.yaml").read_text())
    war, rest = parse_argv(["--config", str(ROOT / "configs" / "cpu_demo.yaml")])
    assert war == cfg["war"] and "--train.agent_func_path" in rest



def test_a_bad_dispatch_option_names_the_field_and_its_file(tmp_path):
    from war_openrlhf.cli.train_ppo import parse_argv

    policy, opts = tmp_path / "policy.yaml", tmp_path / "opts.yaml"
    policy.write_text("war:\n  dispatch_policy: sticky\n")
    opts.write_text("war:\n  dispatch_kwargs:\n    lru_capacity: 0\n")
    with pytest.raises(ValueError, match=r"opts\.yaml: RolloutConfig\.dispatch_kwargs: dispatch policy 'sticky': "
                                         r"lru_capacity must be positive, got 0"):
        parse_argv(["--config", str(policy), "--config", str(opts)])  # checked against the run's policy
    with pytest.raises(ValueError, match=r"^--war options: RolloutConfig\.dispatch_kwargs: unknown option 'admission' "
                                         r"of dispatch policy 'sticky' \(its options: lru_capacity\)"):
        parse_argv(["--war.dispatch_kwargs.admission", "false", "--config", str(policy)])
    war, _ = parse_argv(["--war.dispatch_kwargs.lru_capacity", "5", "--config", str(policy)])
    assert war == {"dispatch_policy": "sticky", "dispatch_kwargs": {"lru_capacity": 5}}


def _args(**rollout):
    from types import SimpleNamespace as NS

    return NS(actor=NS(model_name_or_path="/models/m"), data=NS(max_len=3000), train=NS(seed=7, agent_func_path="a.py"),
              vllm=NS(num_engines=3, enforce_eager=False), rollout=NS(n_samples_per_prompt=8, temperature=0.9,
                                                                      top_p=0.95, **rollout))


def test_settings_openrlhf_defines_are_refused_and_cli_options_beat_files(tmp_path):
    from war_openrlhf.cli.train_ppo import parse_argv
    from war_openrlhf.integrations.openrlhf import war_settings

    run = tmp_path / "run.yaml"
    run.write_text("openrlhf: {}\nwar:\n  temperature: 0.7\n")
    with pytest.raises(ValueError, match=r"run.yaml: 'temperature' is defined by OpenRLHF's --rollout.temperature"):
        parse_argv(["--config", str(run)])
    with pytest.raises(ValueError, match=r"'engine.model' is defined by OpenRLHF's --actor.model_name_or_path"):
        parse_argv(["--war.engine.model", "/m"])
    run.write_text("openrlhf: {}\nwar:\n  engine:\n    speculation: auto\n    num_speculative_tokens: 4\n")
    war, _ = parse_argv(["--war.engine.speculation", "off", "--config", str(run)])
    assert war == {"engine": {"speculation": "off", "num_speculative_tokens": 4}}  # before --config: not lost
    assert war_settings(war, _args()).max_new_tokens_per_turn is None  # OpenRLHF's: the context bounds a turn


def test_merge_takes_what_openrlhf_defines_from_openrlhf():
    from types import SimpleNamespace as NS

    from war_openrlhf.integrations.openrlhf import OPENRLHF_OWNED, merge_openrlhf_args
    from war_openrlhf.rollout import RolloutConfig

    args = NS(actor=NS(model_name_or_path="/models/m"), data=NS(max_len=3000), train=NS(seed=7, agent_func_path="a.py"),
              vllm=NS(num_engines=3, enforce_eager=False), rollout=NS(n_samples_per_prompt=8, temperature=0.9,
                                                                      top_p=0.95))
    cfg = RolloutConfig.from_dict({"max_new_tokens_per_turn": None, "max_turns": 5,
                                   "engine": {"speculation": "off", "enforce_eager": True}})
    merged = merge_openrlhf_args(cfg, args)
    assert (merged.engine.model, merged.engine.max_model_len, merged.engine.seed) == ("/models/m", 3000, 7)
    assert (merged.num_engines, merged.agent_func_path, merged.max_context_tokens) == (3, "a.py", 3000)
    assert (merged.n_samples_per_prompt, merged.temperature, merged.top_p) == (8, 0.9, 0.95)
    assert merged.max_turns == 5 and merged.engine.speculation == "off" and merged.engine.enforce_eager
    assert merged.turn_token_cap == 2999 and merged.engine.enable_prefix_caching
    assert set(OPENRLHF_OWNED) >= {"engine.model", "temperature"}


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    from war_openrlhf.fixtures.tiny_model import build_tiny_model

    model = build_tiny_model(MODEL_DIR)
    tmp = tmp_path_factory.mktemp("train")
    data = tmp / "train.jsonl"
    subprocess.run([sys.executable, str(ROOT / "examples" / "arithmetic_calculator" / "dataset.py"),
                    "--out", str(data), "--n", "8", "--seed", "1"], check=True, capture_output=True)
    cfg = yaml.safe_load((ROOT / "configs" / "cpu_demo.yaml").read_text())
    o = cfg["openrlhf"]
    o.update({"actor.model_name_or_path": str(model), "data.prompt_dataset": str(data), "data.max_samples": 4,
              "data.max_len": 512, "rollout.batch_size": 2, "rollout.n_samples_per_prompt": 2,
              "rollout.micro_batch_size": 2, "train.batch_size": 4, "train.micro_batch_size": 2,
              "actor.adam.lr": 1.0e-2, "actor.lr_warmup_ratio": 0.0, "actor.lr_scheduler": "constant",
              "actor.entropy_coef": 0.5,  # rewards are all 0 for a random model: a gradient anyway
              "logger.tensorboard_dir": str(tmp / "tb"), "ckpt.path": str(tmp / "ckpt"),
              "ckpt.output_dir": str(tmp / "model"), "ckpt.save_steps": 1, "ckpt.save_hf": True,
              "ckpt.disable_ds": True})
    cfg["war"].update({"max_turns": 2, "max_new_tokens_per_turn": 32, "dump_dir": str(tmp / "rollouts"),
                       "progress": False})
    (tmp / "run.yaml").write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "war_openrlhf.cli.train_ppo", "--config", str(tmp / "run.yaml")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    return tmp, proc, model


def test_two_grpo_steps_through_openrlhfs_trainer(trained_run):
    tmp, proc, _ = trained_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Global step 2" in proc.stdout + proc.stderr
    # the seams to OpenRLHF are listed where the user sees them
    assert "war-train: openrlhf.trainer.ray.create_vllm_engines -> WAR engine actors" in proc.stdout
    from war_openrlhf.metrics.tb_scalars import read_scalars

    tags = {t: [v for _, v in points] for t, points in read_scalars(tmp / "tb").items()}
    for t in ("war/rollout_tokens_per_s", "war/speculating_fraction", "war/prefix_hit_rate_engine",
              "war/spec_acceptance_rate", "war/engine0_turns", "war/reward_mean", "war/episode_turns_mean",
              "war/engine0_speculating_fraction", "war/engine0_switch_speculating", "war/turn_generate_s_mean",
              "war/turn_tool_s_mean", "war/index_records", "war/index_sync_lag_records", "war/dispatch_moves"):
        # one place per scalar: logged by OpenRLHF's trainer at its global step, nowhere else
        assert f"train/{t}" in tags and len(tags[f"train/{t}"]) == 2, t
        assert t not in tags, f"{t} logged twice"
    for t in ("train/timing/generation", "train/timing/ppo_train", "train/timing/broadcast"):
        assert t in tags and len(tags[t]) == 2, t
    assert all(v > 0 for v in tags["train/war/rollout_tokens_per_s"])
    # per batch, not since engine start: a fraction of this batch's steps
    assert all(0.0 <= v <= 1.0 for v in tags["train/war/speculating_fraction"])
    assert tags["train/war/index_records"][1] >= tags["train/war/index_records"][0] > 0
    assert (tmp / "model" / "config.json").is_file()


def test_tensorboard_serves_the_runs_scalars_over_http(trained_run):
    """As a user sees it: ``tensorboard --logdir`` on the run directory, on a loopback port,
    and the war/ and train/ scalars read back through its HTTP API."""
    import json
    import shutil
    import socket
    import time
    import urllib.parse
    import urllib.request

    tmp, proc, _ = trained_run
    assert proc.returncode == 0, proc.stderr[-2000:]
    exe = shutil.which("tensorboard", path=str(Path(sys.executable).parent)) or shutil.which("tensorboard")
    assert exe, "tensorboard executable not installed"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([exe, "--logdir", str(tmp / "tb"), "--host", "127.0.0.1", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}/data/plugin/scalars"
    try:
        deadline = time.monotonic() + 90
        tags = None
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{base}/tags", timeout=5) as r:
                    tags = json.loads(r.read())
                if any(t.startswith("train/war/") for run in tags.values() for t in run):
                    break
            except OSError:
                pass
            assert server.poll() is None, server.stderr.read().decode()[-2000:]
            time.sleep(1.0)
        assert tags, "tensorboard never answered"
        found = {}
        for run, run_tags in tags.items():
            for tag in ("train/war/reward_mean", "train/war/rollout_tokens_per_s", "train/timing/generation"):
                if tag in run_tags:
                    q = urllib.parse.urlencode({"run": run, "tag": tag})
                    with urllib.request.urlopen(f"{base}/scalars?{q}", timeout=10) as r:
                        found[tag] = json.loads(r.read())  # [[wall_time, step, value], ...]
        for tag in ("train/war/reward_mean", "train/war/rollout_tokens_per_s", "train/timing/generation"):
            assert tag in found and len(found[tag]) == 2, (tag, sorted(found))
            assert [p[1] for p in found[tag]] == sorted(p[1] for p in found[tag])
        assert all(p[2] > 0 for p in found["train/war/rollout_tokens_per_s"])
    finally:
        server.terminate()
        server.wait(timeout=30)


def _hf_logprobs(model_dir, traj):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([traj["token_ids"]])).logits[0].float(), -1)
    mask = np.array(traj["action_mask"][1:], dtype=bool)
    ref = np.array([float(lp[i - 1, t]) for i, t in enumerate(traj["token_ids"]) if i > 0])
    return np.array(traj["logprobs"][1:])[mask], ref[mask]


def test_rollouts_after_step_one_come_from_the_updated_weights(trained_run):
    tmp, proc, model = trained_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    rollouts = sorted((tmp / "rollouts").glob("rollout_*.jsonl"))
    assert len(rollouts) == 2
    first = json.loads(rollouts[0].read_text().splitlines()[0])
    second = json.loads(rollouts[1].read_text().splitlines()[0])
    assert (first["policy_version"], second["policy_version"]) == (0, 1)
    w1 = tmp / "ckpt" / "global_step1_hf"
    assert (w1 / "config.json").is_file()
    got, ref0 = _hf_logprobs(model, first)
    assert np.abs(got - ref0).max() < 0.1  # rollout 1: the initial weights (engine in bf16)
    got, ref0 = _hf_logprobs(model, second)
    _, ref1 = _hf_logprobs(w1, second)
    assert np.abs(got - ref1).max() < 0.1  # rollout 2: the weights after step 1 ...
    assert np.abs(got - ref0).max() > 0.5  # ... and not the initial ones


def _prompts(path):
    return {json.loads(line)["prompt"] for line in path.read_text().splitlines()}


def test_a_killed_run_resumes_with_its_rollout_state(tmp_path):
    """As a crash happens: war-train with OpenRLHF's checkpoint every step and its resume flag is
    SIGKILLed (its whole process group: driver, Ray, trainer, engines) once step 1 is
    checkpointed and step 2's rollout is under way, then started again with the same command.
    OpenRLHF resumes from step 1; WAR restores the rollout state saved with it (the index records,
    in the new replicas at the first resumed step; the dispatcher's measurements). Step 2 is
    redone, step 1 is not: no prompt of step 1 is rolled out again, its dump stays as it was."""
    sys.path.insert(0, str(ROOT / "tools"))
    from resume_check import _run
    from war_openrlhf.fixtures.tiny_model import build_tiny_model

    model = build_tiny_model(MODEL_DIR)
    data = tmp_path / "train.jsonl"
    subprocess.run([sys.executable, str(ROOT / "examples" / "arithmetic_calculator" / "dataset.py"),
                    "--out", str(data), "--n", "8", "--seed", "4"], check=True, capture_output=True)
    cfg = yaml.safe_load((ROOT / "configs" / "cpu_demo.yaml").read_text())
    cfg["openrlhf"].update({"actor.model_name_or_path": str(model), "data.prompt_dataset": str(data),
                            "data.max_samples": 4, "data.max_len": 512, "rollout.batch_size": 2,
                            "rollout.n_samples_per_prompt": 2, "rollout.micro_batch_size": 2,
                            "train.batch_size": 4, "train.micro_batch_size": 2,
                            "logger.tensorboard_dir": str(tmp_path / "tb"), "ckpt.path": str(tmp_path / "ckpt"),
                            "ckpt.output_dir": str(tmp_path / "model"), "ckpt.save_steps": 1,
                            "ckpt.load_enable": True,
                            # one engine, no reference model: what resuming needs (the two-step run above
                            # covers both); each of the two runs starts four processes fewer
                            "vllm.num_engines": 1, "algo.kl.init_coef": 0.0, "algo.kl.use_loss": False})
    cfg["war"].update({"max_turns": 2, "max_new_tokens_per_turn": 32, "progress": False,
                       "dump_dir": str(tmp_path / "rollouts")})
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "war_openrlhf.cli.train_ppo", "--config", str(tmp_path / "run.yaml")]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    first = _run(cmd, env, tmp_path / "run1.log", kill_after_step=1, timeout_s=600, kill_delay_s=0.2)
    log1 = (tmp_path / "run1.log").read_text(errors="replace")
    # killed inside step 2 (a tiny model's step is a second: at least before its checkpoint)
    assert first["killed_after_s"] is not None and "saved the rollout state of step 2" not in log1, log1[-3000:]
    saved = re.findall(r"war-train: saved the rollout state of step 1 to \S+ \((\d+) index records\)", log1)
    records = int(saved[0])
    assert records > 0
    step1_dump = (tmp_path / "rollouts" / "rollout_0001.jsonl").read_text()
    dumps_before = len(list((tmp_path / "rollouts").glob("rollout_*.jsonl")))

    second = _run(cmd, env, tmp_path / "run2.log", timeout_s=600)
    log2 = (tmp_path / "run2.log").read_text(errors="replace")
    assert second["returncode"] == 0, log2[-4000:]
    assert f"war-train: resumed the rollout state of step 1 from {tmp_path / 'ckpt' / '_war' / 'global_step1'}: " \
           f"{records} index records" in log2
    assert "dispatcher measurements restored" in log2
    assert "Global step 2:" in log2 and "Global step 1:" not in log2
    dumps = sorted((tmp_path / "rollouts").glob("rollout_*.jsonl"))
    assert dumps[0].read_text() == step1_dump and len(dumps) > dumps_before
    redone = set().union(*(_prompts(p) for p in dumps[dumps_before:]))
    assert redone and redone.isdisjoint(_prompts(dumps[0]))
    if dumps_before == 2:  # step 2 had been rolled out before the kill: redone with its prompts
        assert _prompts(dumps[1]) == _prompts(dumps[2])
    # the replicas held the restored records at the resumed step (TensorBoard: the same logdir)
    from war_openrlhf.metrics.tb_scalars import read_scalars

    steps = dict(read_scalars(tmp_path / "tb").get("train/war/index_records", []))
    assert steps.get(2, 0) > records, steps


def test_a_missing_or_damaged_rollout_state_is_a_cold_start(tmp_path, capsys):
    """resume_war_state: a checkpoint without WAR's state, or with a damaged one, resumes with
    cold rollouts and says why; it never stops the job."""
    from types import SimpleNamespace

    from war_openrlhf.integrations.openrlhf import resume_war_state, save_war_state, war_state_dir
    from war_openrlhf.rollout.checkpoint import PoolStateError

    class Pool:
        def __init__(self):
            self.loaded = []

        def load_state(self, path):
            if not (path / "state.json").is_file():
                raise PoolStateError(f"{path}: no state.json (not a saved pool state)")
            raise PoolStateError(f"{path / 'state.json'}: unreadable (bad JSON)")

        def save_state(self, path):
            raise OSError("disk full")

    ckpt = SimpleNamespace(path=str(tmp_path), max_num=2)
    assert resume_war_state(Pool(), ckpt, 0) is None  # a fresh run: nothing to resume
    assert resume_war_state(Pool(), ckpt, 4) is None
    assert "resuming at step 4 with cold rollouts" in capsys.readouterr().out
    war_state_dir(ckpt, 5).mkdir(parents=True)
    (war_state_dir(ckpt, 5) / "state.json").write_text("{")
    assert resume_war_state(Pool(), ckpt, 5) is None
    assert "global_step5/state.json: unreadable" in capsys.readouterr().out
    save_war_state(Pool(), ckpt, 6)  # a failed save is reported, not raised
    assert "could not save the rollout state" in capsys.readouterr().out
    assert not war_state_dir(ckpt, 6).exists()


def test_async_trainer_runs_with_the_war_pool(tmp_path):
    """--train.async_enable: OpenRLHF's PPOTrainerAsync, its rollout actor's samples generator
    replaced by the WAR pool; its scalars reach the trainer's logger with the samples."""
    from war_openrlhf.fixtures.tiny_model import build_tiny_model

    model = build_tiny_model(MODEL_DIR)
    data = tmp_path / "train.jsonl"
    subprocess.run([sys.executable, str(ROOT / "examples" / "arithmetic_calculator" / "dataset.py"),
                    "--out", str(data), "--n", "8", "--seed", "2"], check=True, capture_output=True)
    cfg = yaml.safe_load((ROOT / "configs" / "cpu_demo.yaml").read_text())
    cfg["openrlhf"].update({"actor.model_name_or_path": str(model), "data.prompt_dataset": str(data),
                            "data.max_samples": 4, "data.max_len": 512, "rollout.batch_size": 2,
                            "rollout.n_samples_per_prompt": 2, "rollout.micro_batch_size": 2,
                            "train.batch_size": 4, "train.micro_batch_size": 2, "train.async_enable": True,
                            "logger.tensorboard_dir": str(tmp_path / "tb"), "ckpt.path": str(tmp_path / "ckpt"),
                            "ckpt.output_dir": str(tmp_path / "model"), "algo.kl.init_coef": 0.0,
                            "algo.kl.use_loss": False, "vllm.num_engines": 1})  # what the async path needs
    cfg["war"].update({"max_turns": 2, "max_new_tokens_per_turn": 32, "progress": False})
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([sys.executable, "-m", "war_openrlhf.cli.train_ppo", "--config", str(tmp_path / "run.yaml")],
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    from war_openrlhf.metrics.tb_scalars import read_scalars

    tags = {t: [v for _, v in points] for t, points in read_scalars(tmp_path / "tb").items()}
    assert len(tags.get("train/war/rollout_tokens_per_s", [])) == 2, sorted(tags)
    assert not any(t.startswith("war/") for t in tags), "WAR scalars logged outside the trainer's logger"
