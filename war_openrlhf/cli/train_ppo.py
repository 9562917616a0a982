"""``war-train``: OpenRLHF 0.11.2's ``train_ppo_ray`` with WAR rollouts.

    war-train --config configs/cpu_demo.yaml
    war-train [--war.config FILE] [--war.KEY VALUE ...] <train_ppo_ray arguments, unchanged>

Every ``train_ppo_ray`` argument means what it means there (``--actor.model_name_or_path``,
``--rollout.n_samples_per_prompt``, ``--train.agent_func_path``, ``--train.async_enable``...).
``--war.*`` options set :class:`~war_openrlhf.rollout.RolloutConfig` keys
(``--war.dispatch_policy war``, ``--war.engine.speculation auto``, ``--war.on_tool_error end``);
``--war.config`` reads them from a YAML file (its top-level keys, or its ``war:`` section).
``war-train --preflight`` checks this node instead (:mod:`war_openrlhf.preflight`).
``--ray-address HOST:PORT`` (or ``RAY_ADDRESS``) joins a running Ray cluster instead of
starting one. ``--config FILE`` reads a YAML with an ``openrlhf:`` section (train_ppo_ray arguments: a key per
argument, ``true`` for a flag) and a ``war:`` section. An unknown key or a wrong type names the
key and the file.

What it changes in OpenRLHF, and nothing else, is in one module,
:mod:`war_openrlhf.integrations.openrlhf`: ``create_vllm_engines`` builds WAR engine actors and
the trainer class is OpenRLHF's own ``PPOTrainer`` / ``PPOTrainerAsync`` with the WAR pool as
its samples generator. The driver resolves the settings once: each WAR source (file, ``--war.*``
options) is checked as it is read, OpenRLHF's arguments are parsed and checked once, and one
frozen :class:`~war_openrlhf.rollout.RolloutConfig` is built from both
(:func:`~war_openrlhf.integrations.openrlhf.war_settings`), checked, and shipped to the trainer
as it is. Settings that OpenRLHF's arguments define (model, lengths, seed, engine count, agent
file, samples per prompt, temperature, top-p) are refused in the WAR settings. In a CPU run (the cluster has no CUDA GPU, decided once by this
driver), the CPU support (:mod:`war_openrlhf.cpu`) is applied in this process and in every Ray
worker; in a GPU run never.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from ..config_checks import load_yaml
from ..integrations.openrlhf import refuse_openrlhf_owned
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
    """Split ``argv`` into the WAR settings (a mapping of WAR keys: the files' sections, then the
    ``--war.KEY`` options over them) and train_ppo_ray's arguments. Each source is checked on
    its own, so that a bad key, type or value names its file (or ``--war options``)."""
    war: dict = {}  # --war.KEY options: they override every file, in any order
    sources: list[tuple[str, dict]] = []  # (file, its WAR section), in order
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
            data = load_yaml(path)  # one line naming file, line and column on a syntax error
            if tok.startswith("--config"):
                unknown = sorted(set(data) - {"openrlhf", "war"})
                if unknown:
                    raise ValueError(f"{path}: unknown section '{unknown[0]}' (known: openrlhf, war)")
                rest = openrlhf_argv(data.get("openrlhf") or {}, path) + rest
                section = data.get("war") or {}
            else:
                section = data.get("war", data)
            if not isinstance(section, dict):
                raise ValueError(f"{path}: the WAR settings must be a mapping of keys, got {type(section).__name__}")
            refuse_openrlhf_owned(section, path)
            sources.append((path, section))
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
    refuse_openrlhf_owned(war, "--war options")
    sources.append(("--war options", war))
    merged: dict = {}
    for _, section in sources:  # a later file overrides an earlier one; --war options override all
        merged = _deep_merge(merged, section)
    policy = merged.get("dispatch_policy", RolloutConfig.dispatch_policy)
    for source, section in sources:
        _check_source(section, source, policy)
    return merged, rest


def _check_source(section: dict, source: str, policy: Any) -> None:
    """One source's WAR keys, types and values (``dispatch_kwargs`` against the run's policy);
    a ``ValueError`` names ``source``."""
    if section.get("dispatch_kwargs") is not None and "dispatch_policy" not in section and isinstance(policy, str):
        section = {**section, "dispatch_policy": policy}
    RolloutConfig.from_dict(section, source=source)


def _deep_merge(low: dict, high: dict) -> dict:
    """``high`` over ``low``, section by section (``--war.engine.x`` keeps the file's ``engine.y``)."""
    out = dict(low)
    for key, value in high.items():
        out[key] = _deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _ray_env() -> dict[str, str]:
    env = {
        "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "true"),
        "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN"),
        "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": os.environ.get("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1"),
    }
    for k in ("VLLM_CACHE_ROOT", "VLLM_CPU_KVCACHE_SPACE", "HF_HUB_OFFLINE", "PYTHONPATH", "DS_BUILD_OPS",
              "WAR_STEP_RECORD_DIR",  # engines record their steps there (tools/fit_rollout_costs.py)
              "TOOL_FEEDBACK_FORMAT", "SQL_QA_DB"):  # the example agents read the last two
        if k in os.environ:
            env[k] = os.environ[k]
    return env


#: Tasks whose events the Ray GCS started here keeps for its dashboard (Ray's default is 100,000).
#: A trainer step makes a few hundred Ray calls, and over 300 steps the GCS grew by ~0.2 MiB a step
#: towards that cap (``tools/long_run.py``); keeping the last 10,000 bounds it early. An explicit
#: ``RAY_task_events_max_num_task_in_gcs`` wins; a joined cluster keeps its own setting.
GCS_TASK_EVENTS = 10_000


def _ray_init(address: str | None = None) -> str:
    """Start Ray here, or join the cluster at ``address``; returns the run's device.

    The device (``cuda`` or ``cpu``) is the cluster's, decided once here
    (:func:`~war_openrlhf.device.detect_cluster_device`) and handed to every Ray worker as
    ``WAR_CLUSTER_DEVICE``, so that no actor decides from its own view (an actor without a GPU
    in a GPU run sees no CUDA). Joining a cluster passes no ``num_cpus`` / ``num_gpus`` (Ray
    refuses them there); a CPU cluster must then declare logical GPUs itself
    (``ray start --num-gpus N``) for OpenRLHF's GPU actors to schedule. Starting Ray here on a
    machine without CUDA declares them (:func:`war_openrlhf.cpu.ray_init_kwargs`).
    """
    import ray

    from .. import cpu
    from ..device import CLUSTER_DEVICE_ENV, cuda_available, detect_cluster_device

    env = _ray_env()
    if address:
        ray.init(address=address, log_to_driver=True)
        device = detect_cluster_device()
        ray.shutdown()  # again, with every worker told the device
        env[CLUSTER_DEVICE_ENV] = device
        # the driver too: train_ppo_ray plans the engines here (create_vllm_engines), and a
        # CPU-only head node of a GPU cluster must plan GPU engines, not its own CPU ones
        os.environ[CLUSTER_DEVICE_ENV] = device
        runtime_env: dict[str, Any] = {"env_vars": env}
        if device == "cpu":
            cpu.apply_cpu_support()
            runtime_env = cpu.ray_init_kwargs(num_gpus=1, runtime_env=runtime_env)["runtime_env"]
        ray.init(address=address, runtime_env=runtime_env)
        return device
    device = "cuda" if cuda_available() else "cpu"
    env[CLUSTER_DEVICE_ENV] = device
    os.environ[CLUSTER_DEVICE_ENV] = device
    kwargs: dict[str, Any] = {"runtime_env": {"env_vars": env}}
    if device == "cpu":
        cpu.apply_cpu_support()
        kwargs = cpu.ray_init_kwargs(runtime_env=kwargs["runtime_env"])
        # Logical CPUs: every OpenRLHF actor that asks for a (logical) GPU also holds a CPU,
        # and each engine holds one; engines are pinned to their own core regardless.
        kwargs["num_cpus"] = max(8, 2 * (os.cpu_count() or 1))
    if "RAY_task_events_max_num_task_in_gcs" not in os.environ:
        kwargs["_system_config"] = {"task_events_max_num_task_in_gcs": GCS_TASK_EVENTS}
    if not ray.is_initialized():
        ray.init(**kwargs)
    return device


def _ray_address(argv: list[str]) -> tuple[str | None, list[str]]:
    """``--ray-address ADDR`` (or ``RAY_ADDRESS``) taken out of ``argv``."""
    rest, address, i = [], os.environ.get("RAY_ADDRESS") or None, 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--ray-address":
            if i + 1 >= len(argv):
                raise ValueError("--ray-address: needs the cluster's address (host:port, as `ray start` printed)")
            address, i = argv[i + 1], i + 2
            continue
        if tok.startswith("--ray-address="):
            address, i = tok.split("=", 1)[1], i + 1
            continue
        rest.append(tok)
        i += 1
    return address, rest


_DATA_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv", ".txt", ".arrow")


def check_before_start(war: dict, args: Any) -> RolloutConfig:
    """The run's settings, built once and checked once before Ray starts: the model resolves
    (local directory or hub id), the agent file exists and defines an agent, local dataset files
    exist, and the WAR settings (``war``, from :func:`parse_argv`) completed from OpenRLHF's
    parsed arguments (``args``) are valid, the dispatcher's options for its engine count too.
    Returns the frozen settings; raises ``ValueError`` naming the argument or key."""
    from ..integrations.openrlhf import war_settings
    from ..model_source import ModelNotFound, resolve_model
    from ..rollout import load_agent_class

    try:
        resolve_model(args.actor.model_name_or_path)
    except ModelNotFound as exc:
        raise ValueError(f"--actor.model_name_or_path: {exc}") from None
    agent = getattr(args.train, "agent_func_path", None)
    if agent:
        if not Path(agent).is_file():
            raise ValueError(f"--train.agent_func_path: {agent} does not exist")
        try:
            load_agent_class(agent)
        except Exception as exc:  # noqa: BLE001 - the user's file: say what went wrong in it
            raise ValueError(f"--train.agent_func_path: {agent}: {type(exc).__name__}: {exc}") from None
    for flag, value in (("--data.prompt_dataset", getattr(args.data, "prompt_dataset", None)),
                        ("--eval.dataset", getattr(getattr(args, "eval", None), "dataset", None))):
        for item in str(value or "").split(","):
            item = item.strip()
            if item and item.lower().endswith(_DATA_SUFFIXES) and not Path(item).exists():
                raise ValueError(f"{flag}: {item} does not exist")
    settings = war_settings(war, args)
    try:
        settings.dispatch_options.check_engines(settings.num_engines)
    except ValueError as exc:
        raise ValueError(f"war.dispatch_kwargs ({settings.dispatch_policy}): {exc} "
                         f"(--vllm.num_engines {settings.num_engines})") from None
    return settings


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--preflight":  # checks of this node, nothing started
        from ..preflight import main as preflight

        raise SystemExit(preflight(argv[1:]))
    if not argv or argv[0] in ("-h", "--help"):
        from .options_help import war_help

        print(war_help())
        if not argv:
            raise SystemExit(2)
        print("\nOpenRLHF's train_ppo_ray arguments (every one accepted by war-train, unchanged):\n")
        _apply_cpu_support_for_import()
        from ..integrations.openrlhf import parse_openrlhf_args

        try:
            parse_openrlhf_args(["--help"])  # argparse prints them and exits 0
        except SystemExit as exc:
            if exc.code not in (0, None):
                raise
        return
    try:
        address, argv = _ray_address(argv)
        war, openrlhf_argv = parse_argv(argv)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"war-train: {exc}") from None
    _apply_cpu_support_for_import()
    from ..integrations.openrlhf import parse_openrlhf_args, run_train_ppo_ray

    try:  # OpenRLHF's own parser and checks (once), then the settings built and checked, before Ray starts
        args = parse_openrlhf_args(openrlhf_argv)
        settings = check_before_start(war, args)
    except ValueError as exc:
        raise SystemExit(f"war-train: {exc}") from None
    device = _ray_init(address)
    print(f"war-train: Ray {'cluster at ' + address if address else 'started here'}, device {device} "
          "(decided once for every actor)", flush=True)
    run_train_ppo_ray(settings, args)


def _apply_cpu_support_for_import() -> None:
    """Importing OpenRLHF on a machine without CUDA needs the flash-attn stand-in, and nothing
    more before the cluster's device is known: a CPU-only head node of a GPU cluster must not
    carry the CPU patches into the run (:func:`_ray_init` applies them in a CPU run)."""
    from ..device import cuda_available

    if not cuda_available():
        from ..cpu.flash_attn_shim import install_flash_attn_shim

        install_flash_attn_shim()


if __name__ == "__main__":
    main()
