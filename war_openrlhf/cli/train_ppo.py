"""``war-train``: OpenRLHF 0.11.2's ``train_ppo_ray`` with WAR rollouts.

    war-train --config configs/cpu_demo.yaml
    war-train [--war.config FILE] [--war.KEY VALUE ...] <train_ppo_ray arguments, unchanged>

Every ``train_ppo_ray`` argument means what it means there (``--actor.model_name_or_path``,
``--rollout.n_samples_per_prompt``, ``--train.agent_func_path``, ``--train.async_enable``...).
``--war.*`` options set :class:`~war_openrlhf.rollout.RolloutConfig` keys
(``--war.dispatch_policy war``, ``--war.engine.speculation auto``, ``--war.on_tool_error end``);
``--war.config`` reads them from a YAML file (its top-level keys, or its ``war:`` section).
``--config FILE`` reads a YAML with an ``openrlhf:`` section (train_ppo_ray arguments: a key per
argument, ``true`` for a flag) and a ``war:`` section. An unknown key or a wrong type names the
key and the file.

What it changes in OpenRLHF, and nothing else: ``create_vllm_engines`` builds WAR engine actors
(:func:`~war_openrlhf.training.create_war_engines_for_openrlhf`), and the trainer class is
OpenRLHF's own ``PPOTrainer`` / ``PPOTrainerAsync`` with the WAR pool as its samples generator
(:mod:`war_openrlhf.training.trainer`). On a machine without CUDA, the one CPU module
(:mod:`war_openrlhf.cpu_support`) is applied in this process and in every Ray worker; on a GPU
machine it is never imported.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path
from typing import Any

from ..rollout import RolloutConfig


def _coerce(text: str) -> Any:
    """A command-line value as YAML reads it, except that on/off/yes/no stay strings
    (``--war.engine.speculation off``); only true/false are booleans."""
    import yaml

    value = yaml.safe_load(text)
    if isinstance(value, bool) and text.strip().lower() not in ("true", "false"):
        return text
    return value


def _set_dotted(d: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    for k in keys[:-1]:
        d = d.setdefault(k, {})
        if not isinstance(d, dict):
            raise ValueError(f"--war.{dotted}: '{k}' is not a section")
    d[keys[-1]] = value


def openrlhf_argv(section: dict, source: str) -> list[str]:
    """``{"actor.model_name_or_path": "x", "train.async_enable": true}`` -> argv tokens."""
    if not isinstance(section, dict):
        raise ValueError(f"{source}: 'openrlhf' must be a mapping of train_ppo_ray arguments")
    out: list[str] = []
    for key, value in section.items():
        flag = "--" + str(key)
        if value is True:
            out.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, tuple)):
            out += [flag] + [str(v) for v in value]
        else:
            out += [flag, str(value)]
    return out


def parse_argv(argv: list[str]) -> tuple[dict, list[str]]:
    """Split ``argv`` into the WAR settings (a dict) and train_ppo_ray's arguments."""
    import yaml

    war: dict = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok in ("--config", "--war.config") or tok.startswith(("--config=", "--war.config=")):
            if "=" in tok:
                path = tok.split("=", 1)[1]
                i += 1
            else:
                if i + 1 >= len(argv):
                    raise ValueError(f"{tok}: needs a YAML file")
                path = argv[i + 1]
                i += 2
            data = yaml.safe_load(Path(path).read_text()) or {}
            if not isinstance(data, dict):
                raise ValueError(f"{path}: expected a mapping with 'openrlhf' and/or 'war' sections")
            if tok.startswith("--config"):
                unknown = sorted(set(data) - {"openrlhf", "war"})
                if unknown:
                    raise ValueError(f"{path}: unknown section '{unknown[0]}' (known: openrlhf, war)")
                rest = openrlhf_argv(data.get("openrlhf") or {}, path) + rest
                section = data.get("war") or {}
            else:
                section = data.get("war", data)
            RolloutConfig.from_dict(section, source=path)  # names a bad key with its file
            war = {**war, **section}
            continue
        if tok.startswith("--war."):
            key = tok[len("--war."):]
            if "=" in key:
                key, val = key.split("=", 1)
                i += 1
            else:
                if i + 1 >= len(argv):
                    raise ValueError(f"{tok}: needs a value")
                val = argv[i + 1]
                i += 2
            _set_dotted(war, key, _coerce(val))
            continue
        rest.append(tok)
        i += 1
    RolloutConfig.from_dict(war, source="--war options")
    return war, rest


def _ray_init(war: dict) -> None:
    import ray

    from ..engine.engine import cuda_available
    from ..training.trainer import ENV_CONFIG

    env = {
        "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "true"),
        "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN"),
        "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": os.environ.get("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1"),
        ENV_CONFIG: json.dumps(war),
    }
    for k in ("VLLM_CACHE_ROOT", "VLLM_CPU_KVCACHE_SPACE", "HF_HUB_OFFLINE", "PYTHONPATH", "DS_BUILD_OPS",
              "TOOL_FEEDBACK_FORMAT", "SQL_QA_DB"):  # the example agents read the last two
        if k in os.environ:
            env[k] = os.environ[k]
    os.environ[ENV_CONFIG] = env[ENV_CONFIG]
    kwargs: dict[str, Any] = {"runtime_env": {"env_vars": env}}
    if not cuda_available():
        from .. import cpu_support

        cpu_support.apply_cpu_support()
        kwargs = cpu_support.ray_init_kwargs(runtime_env=kwargs["runtime_env"])
        # Logical CPUs: every OpenRLHF actor that asks for a (logical) GPU also holds a CPU,
        # and each engine holds one; engines are pinned to their own core regardless.
        kwargs["num_cpus"] = max(8, 2 * (os.cpu_count() or 1))
    if not ray.is_initialized():
        ray.init(**kwargs)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        if not argv:
            raise SystemExit(2)
        return
    try:
        war, openrlhf_args = parse_argv(argv)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"war-train: {exc}") from None
    _ray_init(war)

    import openrlhf.trainer.ppo_trainer as ppo_trainer
    import openrlhf.trainer.ppo_trainer_async as ppo_trainer_async
    import openrlhf.trainer.ray as openrlhf_ray

    from ..training.trainer import create_war_engines_for_openrlhf, war_trainer_class

    engine_cfg = RolloutConfig.from_dict({k: v for k, v in war.items() if k == "engine"}, source="--war options")
    openrlhf_ray.create_vllm_engines = create_war_engines_for_openrlhf(engine_cfg)
    ppo_trainer.PPOTrainer = war_trainer_class(async_enable=False)
    ppo_trainer_async.PPOTrainerAsync = war_trainer_class(async_enable=True)
    sys.argv = ["train_ppo_ray"] + openrlhf_args
    runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
