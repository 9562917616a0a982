"""war-train's command line: everything is parsed and checked before Ray starts (OpenRLHF's
own parser and argument checks in dry mode, then WAR's keys, files, model, agent file and
dispatcher options); errors are one line naming the argument, key or file; --help lists
WAR's keys with defaults and OpenRLHF's arguments."""

from __future__ import annotations

from pathlib import Path

import pytest

from war_openrlhf.cli.train_ppo import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run_args(tmp_path_factory):
    from war_openrlhf.fixtures.tiny_model import build_tiny_model

    model = build_tiny_model(ROOT / ".cache" / "war_tiny_model")
    tmp = tmp_path_factory.mktemp("cli")
    data = tmp / "train.jsonl"
    data.write_text('{"prompt": "p", "label": "1"}\n')
    return ["--config", str(ROOT / "configs" / "cpu_demo.yaml"), "--actor.model_name_or_path", str(model),
            "--data.prompt_dataset", str(data)], tmp


def _refused(argv, capsys) -> str:
    import ray

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert not ray.is_initialized(), "Ray started before the arguments were checked"
    msg = str(exc.value.code) if not isinstance(exc.value.code, int) else capsys.readouterr().err
    assert msg.startswith("war-train: ") and "\n" not in msg.strip(), msg
    return msg


@pytest.mark.parametrize("extra, expected", [
    (["--war"], "OpenRLHF's arguments: unrecognized arguments: --war"),
    (["--train.agent_func_path", "/nope/agent.py"], "--train.agent_func_path: /nope/agent.py does not exist"),
    (["--data.prompt_dataset", "/nope/train.jsonl"], "--data.prompt_dataset: /nope/train.jsonl does not exist"),
    (["--actor.model_name_or_path", "/nope/model"], "--actor.model_name_or_path: '/nope/model' is not a directory"),
    (["--war.dispatch_kwargs.bogus", "1"],
     r"--war options: RolloutConfig\.dispatch_kwargs: unknown option 'bogus' of dispatch policy 'war' \(its options: "
     r"kv_capacity_tokens, admission, thrash_bound, thrash_window, admission_order, defer_margin, cold_turns\)"),
    (["--war.dispatch_kwargs.admission", "maybe"],
     r"--war options: RolloutConfig\.dispatch_kwargs: option 'admission' of dispatch policy 'war' must be bool"),
    (["--war.dispatch_kwargs.kv_capacity_tokens", "[1024, 1024, 1024]"],
     r"war\.dispatch_kwargs \(war\): kv_capacity_tokens has 3 entries for 2 engines \(--vllm\.num_engines 2\)"),
    (["--war.max_turn", "3"], "unknown key 'max_turn'"),
    (["--war.tool_timeout_s", ".nan"], "key 'tool_timeout_s' must be a finite number"),
    (["--train.partial_rollout_enable"], "OpenRLHF refused the arguments: --train.partial_rollout_enable requires"),
])
def test_bad_arguments_fail_before_ray_in_one_line(run_args, capsys, extra, expected):
    import re

    argv, _ = run_args
    assert re.search(expected, _refused(argv + extra, capsys))


def test_an_agent_file_that_does_not_import_is_named(run_args, capsys):
    argv, tmp = run_args
    bad = tmp / "broken_agent.py"
    bad.write_text("import not_a_module_anywhere\n")
    msg = _refused(argv + ["--train.agent_func_path", str(bad)], capsys)
    assert f"--train.agent_func_path: {bad}: ModuleNotFoundError" in msg


def test_yaml_errors_are_one_line_with_file_line_and_column(tmp_path, capsys):
    bad = tmp_path / "run.yaml"
    bad.write_text("openrlhf:\n  actor.model_name_or_path: [x,\nwar: {}\n")
    msg = _refused(["--config", str(bad)], capsys)
    assert msg.startswith(f"war-train: {bad}:4:1: expected ',' or ']'")
    bad.write_text("war:\n  dispatch_kwargs: &a {x: 1}\n  other: *a\n")
    assert "aliases (*name) are not allowed" in _refused(["--config", str(bad)], capsys)


def test_command_line_beats_files_whatever_the_order(tmp_path):
    from war_openrlhf.cli.train_ppo import parse_argv

    cfg = tmp_path / "w.yaml"
    cfg.write_text("war:\n  engine:\n    speculation: 'on'\n    num_speculative_tokens: 4\n")
    for argv in (["--war.engine.speculation", "off", "--config", str(cfg)],
                 ["--config", str(cfg), "--war.engine.speculation", "off"]):
        war, _ = parse_argv(argv)
        assert war["engine"] == {"speculation": "off", "num_speculative_tokens": 4}


def test_yaml_booleans_where_a_word_is_expected_say_to_quote_it(tmp_path, capsys):
    cfg = tmp_path / "w.yaml"
    cfg.write_text("war:\n  engine:\n    speculation: off\n")
    assert "quote the value" in _refused(["--config", str(cfg)], capsys)


def test_help_lists_war_keys_with_defaults_and_openrlhfs_arguments(capsys):
    main(["--help"])
    out = capsys.readouterr().out
    assert "engine.num_speculative_tokens" in out and "most draft tokens verified per request-step" in out
    assert "dispatch_kwargs of dispatch_policy war: kv_capacity_tokens=None, admission=True" in out
    assert "  admission: hold new trajectories back while the engines' KV is short" in out
    assert "dispatch_kwargs of dispatch_policy sticky: lru_capacity=10000" in out  # every policy's options
    assert "dispatch_kwargs of dispatch_policy round_robin: (none)" in out
    assert "engine.model                           (set by OpenRLHF's --actor.model_name_or_path)" in out
    assert "--actor.model_name_or_path" in out and "--rollout.n_samples_per_prompt" in out  # OpenRLHF's
    assert "--preflight" in out and "--ray-address" in out
    from war_openrlhf.dispatch import POLICIES

    policy_line = next(line for line in out.splitlines() if line.lstrip().startswith("dispatch_policy "))
    missing = [name for name in POLICIES if name not in policy_line]
    assert not missing, f"dispatch_policy's help does not list {missing}: {policy_line}"
    assert "context bounds a turn, as OpenRLHF's executor. war-train: null unless" in out  # a comment's 2nd line
    # the default a war-train run gets, not RolloutConfig's: only the context bounds a turn
    assert next(line for line in out.splitlines() if line.lstrip().startswith("max_new_tokens_per_turn ")
                ).split()[1] == "None"


def test_openrlhfs_arguments_are_parsed_once_and_the_trainer_gets_the_one_frozen_settings(run_args, monkeypatch):
    """war-train parses OpenRLHF's arguments once (counted at argparse), builds the settings
    once, and hands that object, unchanged, to the trainer classes; train(args) gets the
    namespace parsed before Ray started (Ray, the seams and the trainer are stubbed here)."""
    import argparse
    import dataclasses
    import importlib

    import war_openrlhf.cli.train_ppo as cli
    import war_openrlhf.integrations.openrlhf as seams
    from war_openrlhf.rollout import RolloutConfig

    argv, _ = run_args
    parses, installed, trained = [], [], []
    real_parse = argparse.ArgumentParser.parse_args
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args",
                        lambda self, *a, **k: parses.append(1) or real_parse(self, *a, **k))
    built = []
    real_from_dict = RolloutConfig.from_dict.__func__
    monkeypatch.setattr(RolloutConfig, "from_dict",
                        classmethod(lambda cls, data, source="RolloutConfig": built.append(source)
                                    or real_from_dict(cls, data, source)))
    monkeypatch.setattr(cli, "_ray_init", lambda address=None: "cpu")
    monkeypatch.setattr(seams, "install", lambda settings: installed.append(settings) or [])
    module = importlib.import_module("openrlhf.cli.train_ppo_ray")
    monkeypatch.setattr(module, "train", lambda args: trained.append(args))
    main(argv + ["--war.max_turns", "3"])
    assert len(parses) == 1, f"OpenRLHF's arguments parsed {len(parses)} times"
    assert built.count("WAR settings + OpenRLHF arguments") == 1, built
    (settings,), (args,) = installed, trained
    assert isinstance(settings, RolloutConfig) and settings.max_turns == 3
    assert settings.num_engines == args.vllm.num_engines and settings.engine.model == args.actor.model_name_or_path
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.max_turns = 4


SHIPPED_RUN_CONFIGS = sorted(p.name for p in (ROOT / "configs").glob("*.yaml") if "openrlhf:" in p.read_text())


@pytest.mark.parametrize("name", SHIPPED_RUN_CONFIGS)
def test_every_shipped_run_config_passes_war_trains_checks(name, run_args, monkeypatch):
    """Each config with an ``openrlhf:`` section goes through what ``war-train --config`` does
    before Ray starts (OpenRLHF's parser and checks, WAR's keys, the settings built and
    checked), with the model and data paths given on the command line as the example scripts
    give them; the OpenRLHF flags it sets reach the settings."""
    from war_openrlhf.cli.train_ppo import _apply_cpu_support_for_import, check_before_start, parse_argv
    from war_openrlhf.config_checks import load_yaml
    from war_openrlhf.integrations.openrlhf import parse_openrlhf_args

    assert {"cpu_demo.yaml", "gpu_qwen7b_sql_1node.yaml", "gpu_qwen7b_sql_2node.yaml"} <= set(SHIPPED_RUN_CONFIGS)
    model, data = run_args[0][3], run_args[0][5]
    _apply_cpu_support_for_import()  # as war-train's main, before OpenRLHF is imported
    monkeypatch.chdir(ROOT)  # agent paths in the configs are relative to the job's working directory
    argv = ["--config", str(ROOT / "configs" / name), "--actor.model_name_or_path", model,
            "--data.prompt_dataset", data]
    if "eval.dataset" in (ROOT / "configs" / name).read_text():
        argv += ["--eval.dataset", data]
    war, openrlhf_argv = parse_argv(argv)
    args = parse_openrlhf_args(openrlhf_argv)
    settings = check_before_start(war, args)
    section = load_yaml(ROOT / "configs" / name)["openrlhf"]
    assert settings.num_engines == int(section["vllm.num_engines"])
    if "vllm.gpu_memory_utilization" in section:
        assert settings.engine.gpu_memory_utilization == pytest.approx(float(section["vllm.gpu_memory_utilization"]))
    assert settings.engine.trust_remote_code  # as OpenRLHF's engines
    assert settings.engine.weight_sync_dtype == {"bf16": "bfloat16", "fp16": "float16"}[
        section.get("ds.param_dtype", "bf16")]


@pytest.mark.parametrize("user_value", [None, "50000"])
def test_a_ray_started_here_keeps_a_bounded_number_of_task_events(user_value):
    """Ray's GCS keeps every task's events up to its cap (100,000 by default) and grew with a
    long job's steps; war-train starting Ray caps it at GCS_TASK_EVENTS, unless the user's own
    RAY_task_events_max_num_task_in_gcs says otherwise. A fresh process (ray.init replaced)."""
    import json
    import os
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent('''
        import json, ray
        import war_openrlhf.cli.train_ppo as cli
        calls = []
        ray.is_initialized = lambda: False
        ray.init = lambda *a, **k: calls.append(k.get("_system_config"))
        cli._ray_init(None)
        print(json.dumps({"calls": calls, "cap": cli.GCS_TASK_EVENTS}))
    ''')
    env = {k: v for k, v in os.environ.items() if k != "RAY_task_events_max_num_task_in_gcs"}
    if user_value:
        env["RAY_task_events_max_num_task_in_gcs"] = user_value
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    want = None if user_value else {"task_events_max_num_task_in_gcs": got["cap"]}
    assert got["calls"] == [want] and got["cap"] < 100_000
