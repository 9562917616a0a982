"""Every seam between war-openrlhf and OpenRLHF 0.11.2's Ray PPO trainer, in one module.

``war-train`` runs OpenRLHF's own ``openrlhf.cli.train_ppo_ray`` (argument parsing, actors,
experience making, PPO/GRPO updates, weight sync, checkpoints, logging) with exactly these
substitutions, each version-checked and listed by :func:`applied_patches`:

====================================================  =========================================
OpenRLHF name                                         replaced by
====================================================  =========================================
``openrlhf.trainer.ray.create_vllm_engines``          :func:`war_engine_factory`: WAR engine
                                                      actors (OpenRLHF's weight-sync worker
                                                      extension inside) in one placement group
``openrlhf.trainer.ppo_trainer.PPOTrainer``           :func:`war_trainer_class` (sync): OpenRLHF's
                                                      trainer, samples generator = the WAR pool
``openrlhf.trainer.ppo_trainer_async.PPOTrainerAsync``  :func:`war_trainer_class` (async): its
                                                      rollout actor's samples generator = the pool
====================================================  =========================================

The settings travel as one object: ``war-train`` parses OpenRLHF's arguments once
(:func:`parse_openrlhf_args`), builds the run's frozen settings once from them and the WAR
keys (:func:`war_settings`), checks them, and hands both to :func:`run_train_ppo_ray`.
:func:`war_trainer_class` closes over the settings and Ray ships the class (by value) to the
trainer actor with them; nothing there merges or changes them.

**One precedence rule.** A setting that OpenRLHF's arguments already define (the table
:data:`OPENRLHF_OWNED`: model, max length, seed, engine count, agent file, samples per prompt,
temperature, top-p) comes from OpenRLHF, always; giving it in the WAR settings is refused
before anything starts (:func:`refuse_openrlhf_owned`), so no value is ever silently
overridden. Everything else is WAR's own (``war-train`` leaves ``max_new_tokens_per_turn``
unset = ``None``: only the context bounds a turn, as in OpenRLHF's agent executor).
"""

from __future__ import annotations

import runpy
import sys
import threading
from dataclasses import fields
from typing import Any, Callable, Mapping, Sequence

from ..engine.config import EngineConfig
from ..rollout import RolloutConfig
from ..training.weight_sync_hook import after_weight_sync

__all__ = ["SUPPORTED_OPENRLHF", "SUPPORTED_VLLM", "OPENRLHF_OWNED", "check_openrlhf_version", "check_vllm_version",
           "refuse_openrlhf_owned", "war_settings", "merge_openrlhf_args", "engine_settings", "parse_openrlhf_args",
           "war_engine_factory", "war_trainer_class", "install", "applied_patches", "run_train_ppo_ray",
           "war_state_dir", "save_war_state", "resume_war_state"]

from ..versions import SUPPORTED_OPENRLHF, SUPPORTED_VLLM, check_openrlhf_version, check_vllm_version  # noqa: E402

#: WAR setting (dotted) -> the OpenRLHF argument that defines it.
OPENRLHF_OWNED: dict[str, str] = {
    "engine.model": "actor.model_name_or_path",
    "engine.max_model_len": "data.max_len",
    "engine.seed": "train.seed",
    "num_engines": "vllm.num_engines",
    "agent_func_path": "train.agent_func_path",
    "max_context_tokens": "data.max_len",
    "n_samples_per_prompt": "rollout.n_samples_per_prompt",
    "temperature": "rollout.temperature",
    "top_p": "rollout.top_p",
    "engine.tensor_parallel_size": "vllm.tensor_parallel_size",
    "engine.gpu_memory_utilization": "vllm.gpu_memory_utilization",
    "engine.enable_sleep_mode": "vllm.enable_sleep",
    "engine.full_determinism": "train.full_determinism_enable",
    "engine.logprobs_mode": "algo.advantage.is_correction_level",
    "engine.weight_sync_dtype": "ds.param_dtype",
}

#: WAR keys whose default in ``war-train`` is not ``RolloutConfig``'s: as OpenRLHF's executor,
#: only the context bounds a turn unless a cap is given.
WAR_TRAIN_DEFAULTS: dict[str, Any] = {"max_new_tokens_per_turn": None}

#: OpenRLHF's --ds.param_dtype choices -> the engine dtype its weight sync sends.
_PARAM_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}

_LOCK = threading.Lock()
_APPLIED: list[str] = []


# ------------------------------------------------------------------ version and names
def _need(module: Any, *names: str) -> None:
    missing = [n for n in names if not hasattr(module, n)]
    if missing:
        raise RuntimeError(f"war_openrlhf.integrations.openrlhf: {module.__name__} has no {', '.join(missing)}; "
                           f"the seams are written for OpenRLHF {', '.join(SUPPORTED_OPENRLHF)}")


def _opt(namespace: Any, dotted: str, default: Any) -> Any:
    """An optional OpenRLHF argument (``default`` when this namespace lacks it)."""
    try:
        return _dig(namespace, dotted)
    except AttributeError:
        return default


def _dig(namespace: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        namespace = getattr(namespace, part)
    return namespace


# ------------------------------------------------------------------ settings
def refuse_openrlhf_owned(settings: Mapping[str, Any], source: str) -> None:
    """Raise if the WAR settings give a value that an OpenRLHF argument defines."""
    for dotted, owner in OPENRLHF_OWNED.items():
        section: Any = settings
        for part in dotted.split("."):
            if not isinstance(section, Mapping) or part not in section:
                break
            section = section[part]
        else:
            raise ValueError(f"{source}: '{dotted}' is defined by OpenRLHF's --{owner}; "
                             "set it there (remove it from the WAR settings)")


def war_settings(war: Mapping[str, Any], args: Any) -> RolloutConfig:
    """The one settings object of a ``war-train`` run, built once and frozen: the WAR settings
    (``war``: a mapping of WAR keys, as ``war-train``'s files and ``--war.*`` options give them)
    completed from OpenRLHF's parsed arguments (``train_ppo_ray``'s checked namespace). An
    unset ``max_new_tokens_per_turn`` is ``None`` here: only the context bounds a turn, as in
    OpenRLHF's own agent executor. Raises ``ValueError`` naming the key or the argument."""
    war = {**WAR_TRAIN_DEFAULTS, **dict(war)}
    top = {k: _dig(args, v) for k, v in OPENRLHF_OWNED.items() if not k.startswith("engine.")}
    top["num_engines"] = int(top["num_engines"])
    top["agent_func_path"] = top["agent_func_path"] or ""
    top["max_context_tokens"] = int(top["max_context_tokens"])
    top["n_samples_per_prompt"] = int(top["n_samples_per_prompt"])
    top["temperature"], top["top_p"] = float(top["temperature"]), float(top["top_p"])
    cap = getattr(getattr(args, "rollout", None), "max_new_tokens", None)
    if cap is not None:  # OpenRLHF's per-generation cap: here, per model turn
        if war["max_new_tokens_per_turn"] not in (None, int(cap)):
            raise ValueError(f"--rollout.max_new_tokens {cap} and the WAR setting max_new_tokens_per_turn "
                             f"{war['max_new_tokens_per_turn']} disagree; set one")
        top["max_new_tokens_per_turn"] = int(cap)
    if war.get("engine_recovery") == "restart":
        raise ValueError("engine_recovery: 'restart' is for pools that start their own engines; in war-train "
                         "the engines belong to OpenRLHF's weight-sync group, which a new actor cannot join "
                         "(it would roll out the model file's weights). Use 'reinstate' (a hung engine that "
                         "answers again comes back) or 'off'")
    correction = _opt(args, "algo.advantage.is_correction_level", "off")
    engine = _engine_dict(war.get("engine") or {}, pretrain=_dig(args, OPENRLHF_OWNED["engine.model"]),
                          seed=_dig(args, OPENRLHF_OWNED["engine.seed"]),
                          max_model_len=_dig(args, OPENRLHF_OWNED["engine.max_model_len"]),
                          enforce_eager=bool(args.vllm.enforce_eager),
                          tensor_parallel_size=_opt(args, "vllm.tensor_parallel_size", 1),
                          full_determinism=_opt(args, "train.full_determinism_enable", False),
                          gpu_memory_utilization=_opt(args, "vllm.gpu_memory_utilization", None),
                          vllm_enable_sleep=_opt(args, "vllm.enable_sleep", False),
                          logprobs_mode="processed_logprobs" if correction not in (None, "off") else None,
                          remote_rm_url=_opt(args, "reward.remote_url", None),
                          max_images_per_prompt=_opt(args, "data.max_images_per_prompt", 0) or 0,
                          param_dtype=_opt(args, "ds.param_dtype", "bf16"))
    return RolloutConfig.from_dict({**war, **top, "engine": engine}, source="WAR settings + OpenRLHF arguments")


def merge_openrlhf_args(config: RolloutConfig, args: Any) -> RolloutConfig:
    """``config`` completed from OpenRLHF's parsed arguments (:func:`war_settings` of its keys)."""
    return war_settings(config.as_dict(), args)


def _engine_dict(engine: Mapping[str, Any], *, pretrain: str, seed: int, max_model_len: int, enforce_eager: bool,
                 tensor_parallel_size: int = 1, full_determinism: bool = False,
                 gpu_memory_utilization: float | None = None, vllm_enable_sleep: bool = False,
                 logprobs_mode: str | None = None, remote_rm_url: Any = None,
                 max_images_per_prompt: int = 0, param_dtype: str | None = None) -> dict[str, Any]:
    """The WAR engine settings (``engine``: a mapping of ``EngineConfig`` keys) completed from
    what ``train_ppo_ray`` hands ``create_vllm_engines`` (OpenRLHF 0.11.2,
    ``trainer/ray/vllm_engine.py`` lines 209-225): every argument is honoured or refused here,
    none is dropped. As OpenRLHF's engines (same file, lines 273-274): ``trust_remote_code``
    on, and the weights in the trainer's dtype (``param_dtype``, ``--ds.param_dtype``: the
    engine's ``weight_sync_dtype``; an engine ``dtype`` of another 16-bit type is refused,
    ``float32`` is left to the device check: CPU runs cast, CUDA runs refuse)."""
    if remote_rm_url and [str(u) for u in ([remote_rm_url] if isinstance(remote_rm_url, str) else remote_rm_url)] != ["agent"]:
        # OpenRLHF sets remote_url "agent" itself when --train.agent_func_path is given
        raise ValueError(f"--reward.remote_url {remote_rm_url!r}: WAR rollouts are multi-turn episodes whose "
                         "reward comes from the agent file (--train.agent_func_path); a remote reward model "
                         "is not supported")
    if max_images_per_prompt:
        raise ValueError(f"--data.max_images_per_prompt {max_images_per_prompt}: WAR engines serve text models "
                         "only; vision-language rollouts are not supported")
    defaults = {f.name: f.default for f in fields(EngineConfig)}
    out = dict(engine)
    out.update(model=str(pretrain), seed=int(seed), max_model_len=int(max_model_len),
               enable_prefix_caching=True,  # WAR's dispatch counts on it
               enforce_eager=bool(enforce_eager) or bool(out.get("enforce_eager", defaults["enforce_eager"])),
               tensor_parallel_size=int(tensor_parallel_size),
               full_determinism=bool(full_determinism) or bool(out.get("full_determinism",
                                                                       defaults["full_determinism"])),
               enable_sleep_mode=bool(vllm_enable_sleep))
    if out.get("trust_remote_code") is None:  # not chosen: as OpenRLHF's engines
        out["trust_remote_code"] = True
    if param_dtype is not None:
        sync = _PARAM_DTYPES.get(str(param_dtype))
        if sync is None:
            raise ValueError(f"--ds.param_dtype {param_dtype!r}: not one of {', '.join(_PARAM_DTYPES)}")
        given = out.get("dtype", defaults["dtype"])
        if given in ("bfloat16", "float16") and given != sync:
            raise ValueError(f"war.engine.dtype {given} and --ds.param_dtype {param_dtype} disagree: the trainer "
                             "sends its weights in its dtype and the weight sync asserts the engine's is the same; "
                             "set one (engine dtype auto follows --ds.param_dtype)")
        out["weight_sync_dtype"] = sync
    if gpu_memory_utilization is not None:
        out["gpu_memory_utilization"] = float(gpu_memory_utilization)
    if logprobs_mode:
        out["logprobs_mode"] = str(logprobs_mode)
    return out


def engine_settings(config: RolloutConfig, *, pretrain: str, seed: int, max_model_len: int, enforce_eager: bool,
                    tensor_parallel_size: int = 1, full_determinism: bool = False,
                    gpu_memory_utilization: float | None = None, vllm_enable_sleep: bool = False,
                    logprobs_mode: str | None = None, remote_rm_url: Any = None,
                    max_images_per_prompt: int = 0) -> Any:
    """The WAR engines' :class:`EngineConfig` from ``config.engine`` and what ``train_ppo_ray``
    hands ``create_vllm_engines`` (:func:`_engine_dict`)."""
    return EngineConfig.from_dict(
        _engine_dict(config.engine.as_dict(), pretrain=pretrain, seed=seed, max_model_len=max_model_len,
                     enforce_eager=enforce_eager, tensor_parallel_size=tensor_parallel_size,
                     full_determinism=full_determinism, gpu_memory_utilization=gpu_memory_utilization,
                     vllm_enable_sleep=vllm_enable_sleep, logprobs_mode=logprobs_mode, remote_rm_url=remote_rm_url,
                     max_images_per_prompt=max_images_per_prompt),
        source="OpenRLHF's --vllm.* arguments")


# ------------------------------------------------------------------ engines
def war_engine_factory(settings: RolloutConfig) -> Callable[..., list]:
    """A replacement for OpenRLHF's ``create_vllm_engines``: WAR engine actors with OpenRLHF's
    weight-sync worker extension, placed as OpenRLHF places its own, configured by
    ``settings.engine`` (the run's settings, built from the same OpenRLHF arguments before Ray
    started: :func:`war_settings`). What ``train_ppo_ray`` passes is checked against them."""

    def create_vllm_engines(num_engines, tensor_parallel_size, pretrain, seed, full_determinism,
                            enable_prefix_caching, enforce_eager, max_model_len, shared_pg=None,
                            gpu_memory_utilization=None, vllm_enable_sleep=False, logprobs_mode=None,
                            agent_func_path=None, remote_rm_url=None, max_images_per_prompt=0):
        from ..engine.actors import create_war_engines
        from openrlhf.trainer.ray.vllm_engine import batch_vllm_engine_call

        engine = settings.engine
        given = {"num_engines": (int(num_engines), settings.num_engines), "pretrain": (str(pretrain), engine.model),
                 "seed": (int(seed), engine.seed), "max_model_len": (int(max_model_len), engine.max_model_len),
                 "tensor_parallel_size": (int(tensor_parallel_size), engine.tensor_parallel_size),
                 "vllm_enable_sleep": (bool(vllm_enable_sleep), engine.enable_sleep_mode)}
        differ = {k: v for k, v in given.items() if v[0] != v[1]}
        if differ:
            raise RuntimeError("war_openrlhf: create_vllm_engines was called with "
                               + ", ".join(f"{k}={a!r} (the settings: {b!r})" for k, (a, b) in differ.items())
                               + "; the settings come from the same OpenRLHF arguments, parsed once")
        engines = create_war_engines(settings.num_engines, engine, openrlhf_worker=True,
                                     placement_group=shared_pg is None, shared_pg=shared_pg)
        if engine.enable_sleep_mode:  # as OpenRLHF: engines sleep until the first generation wakes them
            batch_vllm_engine_call(engines, "sleep")
        return engines

    return create_vllm_engines


# ------------------------------------------------------------------ trainers
def _prepare_cpu() -> None:
    """In a trainer actor's process: the CPU patches, in a CPU run only (the cluster's device,
    :func:`~war_openrlhf.device.cluster_device`; an actor without a GPU in a GPU run is left alone)."""
    from ..device import cluster_device

    if cluster_device() == "cpu":
        from ..cpu import apply_cpu_support

        apply_cpu_support()


def _war_samples_generator(trainer: Any, strategy: Any, vllm_engines: Sequence, settings: RolloutConfig):
    from ..training.samples_generator import WarSamplesGenerator

    old = trainer.samples_generator
    gen = WarSamplesGenerator(strategy, old.prompts_dataloader, old.eval_dataloader, old.tokenizer,
                              vllm_engines, settings)  # the driver's settings, as built there
    seconds = gen.warm_up()  # before any step is timed (RolloutConfig.warm_up)
    if seconds is not None:
        print(f"war-train: rollout pool warmed up in {seconds:.1f} s (one untimed episode per engine)", flush=True)
    return gen


def _sync_trainer_cls(config: RolloutConfig):
    import ray
    from openrlhf.trainer import ppo_trainer

    _need(ppo_trainer, "PPOTrainer")
    base = ppo_trainer.PPOTrainer.__ray_actor_class__

    class WarPPOTrainer(base):
        """OpenRLHF's synchronous PPOTrainer; rollouts by the WAR pool."""

        def __init__(self, pretrain, strategy, actor_model_group, critic_model_group, reward_model_group,
                     reference_model_group, vllm_engines, **generate_kwargs) -> None:
            _prepare_cpu()
            super().__init__(pretrain, strategy, actor_model_group, critic_model_group, reward_model_group,
                             reference_model_group, vllm_engines, **generate_kwargs)
            self.samples_generator = _war_samples_generator(self, strategy, vllm_engines, config)

        def broadcast_to_vllm(self) -> None:
            super().broadcast_to_vllm()
            # prefix caches dropped, engines' weight version advanced (the one hook of both trainers)
            self.samples_generator.pool.advance_policy_version(after_weight_sync(self.vllm_engines))

        def init_checkpoint_states(self) -> dict:
            """OpenRLHF's resume point; the pool's state saved with that checkpoint comes back too."""
            states = super().init_checkpoint_states()
            resume_war_state(self.samples_generator.pool, self.args.ckpt, int(states.get("global_step", 0)))
            return states

        def save_logs_and_checkpoints(self, global_step: int, logs_dict=None, client_states=None) -> None:
            super().save_logs_and_checkpoints(global_step, logs_dict, client_states)
            if global_step % self.args.ckpt.save_steps == 0:  # OpenRLHF's own rule (inf: never)
                save_war_state(self.samples_generator.pool, self.args.ckpt, global_step)

    return WarPPOTrainer


def _async_trainer_cls(config: RolloutConfig):
    import ray
    import openrlhf.trainer.ppo_trainer_async as mod

    _need(mod, "GenerateSamplesActor", "TrainingActor", "BasePPOTrainer", "PPOTrainerAsync")
    gen_base = mod.GenerateSamplesActor.__ray_actor_class__

    class WarGenerateSamplesActor(gen_base):
        """OpenRLHF's async rollout actor; rollouts by the WAR pool."""

        def __init__(self, pretrain, strategy, vllm_engines, **kwargs) -> None:
            _prepare_cpu()
            super().__init__(pretrain, strategy, vllm_engines, **kwargs)
            self.samples_generator = _war_samples_generator(self, strategy, vllm_engines, config)

    training_base = mod.TrainingActor.__ray_actor_class__

    class WarTrainingActor(training_base):
        """OpenRLHF's async training actor; the weight-sync hook inside its broadcast.

        OpenRLHF 0.11.2's ``TrainingActor.broadcast_to_vllm`` (``ppo_trainer_async.py`` lines
        255-266), with :func:`after_weight_sync` while the engines are still paused under
        ``--train.partial_rollout_enable``: a turn that resumes afterwards reports both
        versions it ran under, and no turn starts on the new weights with an old prefix cache.
        """

        def __init__(self, *args, **kwargs) -> None:
            _prepare_cpu()
            super().__init__(*args, **kwargs)

        def broadcast_to_vllm(self):
            from openrlhf.trainer.ray.vllm_engine import batch_vllm_engine_call

            ray.get(self.vllm_lock.acquire.remote())
            if self._partial_rollout:
                batch_vllm_engine_call(self.vllm_engines, "pause_generation")
            try:
                mod.BasePPOTrainer.broadcast_to_vllm(self)  # the weights, as TrainingActor does
                after_weight_sync(self.vllm_engines)
            finally:
                if self._partial_rollout:
                    batch_vllm_engine_call(self.vllm_engines, "resume_generation")
                ray.get(self.vllm_lock.release.remote())

    trainer_base = mod.PPOTrainerAsync.__ray_actor_class__

    class WarPPOTrainerAsync(trainer_base):
        """OpenRLHF's async PPO trainer; its rollout actor is :class:`WarGenerateSamplesActor`."""

        def __init__(self, *args, **kwargs) -> None:
            _prepare_cpu()
            # In this actor's process only. Ray ships OpenRLHF's trainer class by value (the
            # module attribute is its ActorClass wrapper), so its __init__ reads its own copy
            # of the module globals: patch that copy, and the module for good measure.
            war_gen = ray.remote(WarGenerateSamplesActor)
            war_training = ray.remote(WarTrainingActor)
            trainer_base.__init__.__globals__["GenerateSamplesActor"] = war_gen
            trainer_base.__init__.__globals__["TrainingActor"] = war_training
            mod.GenerateSamplesActor = war_gen
            mod.TrainingActor = war_training
            super().__init__(*args, **kwargs)

    return WarPPOTrainerAsync


def war_trainer_class(config: RolloutConfig, *, async_enable: bool):
    """The Ray actor class ``train_ppo_ray.train`` instantiates, carrying ``config`` with it."""
    import ray

    return ray.remote(_async_trainer_cls(config) if async_enable else _sync_trainer_cls(config))


# ------------------------------------------------------------------ install and run
def install(config: RolloutConfig) -> list[str]:
    """Apply the three substitutions in this (driver) process; returns :func:`applied_patches`."""
    check_openrlhf_version()
    check_vllm_version()
    import openrlhf.trainer.ppo_trainer as ppo_trainer
    import openrlhf.trainer.ppo_trainer_async as ppo_trainer_async
    import openrlhf.trainer.ray as openrlhf_ray

    _need(openrlhf_ray, "create_vllm_engines")
    _need(ppo_trainer, "PPOTrainer")
    _need(ppo_trainer_async, "PPOTrainerAsync")
    with _LOCK:
        _APPLIED.clear()
        openrlhf_ray.create_vllm_engines = war_engine_factory(config)
        _APPLIED.append("openrlhf.trainer.ray.create_vllm_engines -> WAR engine actors (one placement group, "
                        "OpenRLHF's weight-sync worker extension inside)")
        ppo_trainer.PPOTrainer = war_trainer_class(config, async_enable=False)
        _APPLIED.append("openrlhf.trainer.ppo_trainer.PPOTrainer -> OpenRLHF's PPOTrainer with the WAR pool as "
                        "samples generator (+ prefix-cache reset and policy version after each weight sync)")
        ppo_trainer_async.PPOTrainerAsync = war_trainer_class(config, async_enable=True)
        _APPLIED.append("openrlhf.trainer.ppo_trainer_async.PPOTrainerAsync -> OpenRLHF's async trainer whose "
                        "rollout actor uses the WAR pool as samples generator")
        return list(_APPLIED)


def applied_patches() -> list[str]:
    """What :func:`install` substituted in this process, one line each."""
    with _LOCK:
        return list(_APPLIED)


class _StopBeforeRay(Exception):
    """Raised in place of ``ray.init`` by :func:`parse_openrlhf_args`: the arguments passed."""


def parse_openrlhf_args(openrlhf_argv: Sequence[str]) -> Any:
    """``train_ppo_ray``'s own parser and argument checks, run up to where it would start Ray.

    OpenRLHF builds its parser and checks the arguments in the module's ``__main__`` block,
    then calls ``train(args)``, whose first act is ``ray.init``. This runs that block with
    ``ray.init`` raising (and ``ray.is_initialized`` answering False), so nothing starts; the
    checked namespace ``train`` would get is returned. Unknown or malformed arguments
    raise ``ValueError`` with argparse's message; so does a failed OpenRLHF check.
    ``--help`` prints OpenRLHF's help and exits 0.
    """
    import argparse

    import ray

    captured: dict[str, Any] = {}

    def no_ray(*_a, **_k):
        # called as train(args)'s first step: its args are the checked, hierarchical namespace
        captured["checked"] = sys._getframe(1).f_locals.get("args")
        raise _StopBeforeRay()

    orig_error = argparse.ArgumentParser.error

    def error(self, message):  # one line instead of OpenRLHF's ~150-line usage
        raise ValueError(f"OpenRLHF's arguments: {message}")

    saved = (sys.argv, ray.init, ray.is_initialized)
    sys.argv = ["war-train", *openrlhf_argv]
    argparse.ArgumentParser.error = error
    ray.init, ray.is_initialized = no_ray, (lambda: False)
    try:
        runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__")
    except _StopBeforeRay:
        pass
    except AssertionError as exc:
        raise ValueError(f"OpenRLHF refused the arguments: {exc or 'an argument check failed'}") from None
    finally:
        sys.argv, ray.init, ray.is_initialized = saved
        argparse.ArgumentParser.error = orig_error
    if captured.get("checked") is None:
        raise RuntimeError("OpenRLHF's train_ppo_ray reached no train(args); is openrlhf 0.11.2 installed?")
    return captured["checked"]


def run_train_ppo_ray(settings: RolloutConfig, args: Any) -> None:
    """OpenRLHF's ``train_ppo_ray.train(args)`` with the WAR substitutions (:func:`install`).

    ``args`` is the namespace :func:`parse_openrlhf_args` returned: OpenRLHF's arguments,
    parsed and checked once, before Ray started; nothing parses them again. ``settings`` is
    the run's frozen settings (:func:`war_settings`); the trainer classes carry it to the
    trainer actor as it is. The module's own ``create_vllm_engines`` name (imported at its top)
    is pointed at the substitution too."""
    import importlib

    import openrlhf.trainer.ray as openrlhf_ray

    for line in install(settings):
        print(f"war-train: {line}", flush=True)
    module = importlib.import_module("openrlhf.cli.train_ppo_ray")
    _need(module, "train", "create_vllm_engines")
    module.create_vllm_engines = openrlhf_ray.create_vllm_engines
    if getattr(args, "use_ms", False):  # as the module's __main__ block does before train(args)
        from modelscope.utils.hf_util import patch_hub

        patch_hub()
    module.train(args)


# ------------------------------------------------------------------ checkpoints
def war_state_dir(ckpt: Any, global_step: int):
    """Where the pool's state of OpenRLHF's checkpoint ``global_step{N}`` lives: beside the
    actor's (``<ckpt.path>/_actor``), in ``<ckpt.path>/_war/global_step{N}``."""
    from pathlib import Path

    return Path(ckpt.path) / "_war" / f"global_step{global_step}"


def save_war_state(pool: Any, ckpt: Any, global_step: int) -> None:
    """Save the pool's state with OpenRLHF's checkpoint of ``global_step`` and keep as many
    as OpenRLHF keeps (``ckpt.max_num``). A failure is reported, never fatal: the model's
    checkpoint is already written, and a resumed job can start its rollouts cold."""
    import shutil

    path = war_state_dir(ckpt, global_step)
    try:
        pool.save_state(path)
    except Exception as exc:  # noqa: BLE001 - the training checkpoint matters more
        print(f"war-train: could not save the rollout state to {path} ({type(exc).__name__}: {exc}); "
              "a resume from this checkpoint starts its rollouts cold", flush=True)
        return
    print(f"war-train: saved the rollout state of step {global_step} to {path} "
          f"({len(pool.shipper.archive)} index records)", flush=True)
    keep = int(getattr(ckpt, "max_num", 0) or 0)
    if keep > 0:
        saved = sorted((p for p in path.parent.glob("global_step*") if p.is_dir() and p.name[11:].isdigit()),
                       key=lambda p: int(p.name[11:]))
        for old in saved[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def resume_war_state(pool: Any, ckpt: Any, global_step: int) -> dict | None:
    """On a resume from OpenRLHF's checkpoint ``global_step`` (> 0), restore the pool's state
    saved with it; a missing or unreadable one is a cold start with the reason printed."""
    if global_step <= 0:
        return None
    from ..rollout.checkpoint import PoolStateError

    path = war_state_dir(ckpt, global_step)
    try:
        got = pool.load_state(path)
    except PoolStateError as exc:
        print(f"war-train: resuming at step {global_step} with cold rollouts: {exc}", flush=True)
        return None
    print(f"war-train: resumed the rollout state of step {global_step} from {path}: {got['records']} index records "
          f"({got['record_tokens']} tokens), dispatcher measurements {got['dispatch']}", flush=True)
    return got
