"""OpenRLHF 0.11.2's PPO trainers with the WAR pool in place of its samples generator.

OpenRLHF builds its trainer as a Ray actor (``PPOTrainer.remote(...)``, or
``PPOTrainerAsync`` with ``--train.async_enable``) that owns a ``SamplesGenerator``. Here the
same classes are subclassed, not copied: after OpenRLHF's ``__init__`` has built datasets,
tokenizer and experience maker, ``samples_generator`` is replaced by a
:class:`~.samples_generator.WarSamplesGenerator` over the same engine handles (WAR engines,
see :func:`create_war_engines_for_openrlhf`). Everything else -- experience making, PPO/GRPO
updates, weight sync, checkpoints, logging -- is OpenRLHF's code.

The WAR settings reach the trainer actors through the environment variable
``WAR_ROLLOUT_CONFIG`` (a JSON :class:`~war_openrlhf.rollout.RolloutConfig`), set by
:mod:`war_openrlhf.cli.train_ppo` for the whole Ray job.
"""

from __future__ import annotations

import json
import os
from typing import Any

import ray

from ..rollout import RolloutConfig
from .samples_generator import WarSamplesGenerator

ENV_CONFIG = "WAR_ROLLOUT_CONFIG"


def rollout_config_from_env(args) -> RolloutConfig:
    """The job's RolloutConfig, completed from OpenRLHF's args (model, agent file, lengths)."""
    raw = os.environ.get(ENV_CONFIG)
    if not raw:
        raise RuntimeError(f"{ENV_CONFIG} is not set: start training through war_openrlhf.cli.train_ppo "
                           "(console script war-train)")
    data = json.loads(raw)
    return complete_from_openrlhf_args(data, args)


def complete_from_openrlhf_args(data: dict, args) -> RolloutConfig:
    """Fill what OpenRLHF's own arguments already say (model, agent file, lengths, samples,
    sampling) into the WAR settings ``data``; the WAR file's explicit values win only for
    WAR-specific keys."""
    data = dict(data)
    eng = dict(data.get("engine") or {})
    eng["model"] = args.actor.model_name_or_path
    eng["max_model_len"] = int(args.data.max_len)
    eng.setdefault("seed", int(args.train.seed))
    data["engine"] = eng
    data["num_engines"] = int(args.vllm.num_engines)
    data["agent_func_path"] = args.train.agent_func_path or data.get("agent_func_path", "")
    data["max_context_tokens"] = int(args.data.max_len)
    data.setdefault("max_new_tokens_per_turn", int(args.data.max_len) - 2)  # OpenRLHF: max_len - context
    data["n_samples_per_prompt"] = int(args.rollout.n_samples_per_prompt)
    data["temperature"] = float(args.rollout.temperature)
    data["top_p"] = float(args.rollout.top_p)
    return RolloutConfig.from_dict(data, source=ENV_CONFIG)


def _prepare_cpu() -> None:
    from ..engine.engine import cuda_available

    if not cuda_available():
        from ..cpu_support import apply_cpu_support

        apply_cpu_support()


def _war_generator(self, strategy, vllm_engines) -> WarSamplesGenerator:
    old = self.samples_generator
    return WarSamplesGenerator(strategy, old.prompts_dataloader, old.eval_dataloader, old.tokenizer,
                               vllm_engines, rollout_config_from_env(strategy.args))


def _sync_trainer_cls():
    from openrlhf.trainer.ppo_trainer import PPOTrainer

    base = PPOTrainer.__ray_actor_class__

    class WarPPOTrainer(base):
        """OpenRLHF's synchronous PPOTrainer; rollouts by the WAR pool."""

        def __init__(self, pretrain, strategy, actor_model_group, critic_model_group, reward_model_group,
                     reference_model_group, vllm_engines, **generate_kwargs) -> None:
            _prepare_cpu()
            super().__init__(pretrain, strategy, actor_model_group, critic_model_group, reward_model_group,
                             reference_model_group, vllm_engines, **generate_kwargs)
            self.samples_generator = _war_generator(self, strategy, vllm_engines)

        def train_step(self, rollout_samples, global_step: int):
            status, step = super().train_step(rollout_samples, global_step)
            status.update(self.samples_generator.metrics)  # -> TensorBoard train/war/...
            return status, step

        def broadcast_to_vllm(self) -> None:
            super().broadcast_to_vllm()
            # WAR engines always cache prefixes: KV computed with the old weights must go
            # (OpenRLHF resets it only with --vllm.enable_prefix_caching)
            ray.get([e.reset_prefix_cache.remote() for e in self.vllm_engines])
            # records completed from now on come from the new policy
            self.samples_generator.pool.advance_policy_version()

        def war_rollout_metrics(self) -> dict[str, Any]:
            return dict(self.samples_generator.metrics)

    return WarPPOTrainer


def _async_trainer_cls():
    import openrlhf.trainer.ppo_trainer_async as mod

    gen_base = mod.GenerateSamplesActor.__ray_actor_class__

    class WarGenerateSamplesActor(gen_base):
        """OpenRLHF's async rollout actor; rollouts by the WAR pool."""

        def __init__(self, pretrain, strategy, vllm_engines, **kwargs) -> None:
            _prepare_cpu()
            super().__init__(pretrain, strategy, vllm_engines, **kwargs)
            self.samples_generator = _war_generator(self, strategy, vllm_engines)

    trainer_base = mod.PPOTrainerAsync.__ray_actor_class__

    class WarPPOTrainerAsync(trainer_base):
        """OpenRLHF's async PPO trainer; its rollout actor is :class:`WarGenerateSamplesActor`."""

        def __init__(self, *args, **kwargs) -> None:
            _prepare_cpu()
            # In this actor's process only. Ray ships OpenRLHF's trainer class by value (the
            # module attribute is its ActorClass wrapper), so its __init__ reads its own copy
            # of the module globals: patch that copy, and the module for good measure.
            war_gen = ray.remote(WarGenerateSamplesActor)
            trainer_base.__init__.__globals__["GenerateSamplesActor"] = war_gen
            mod.GenerateSamplesActor = war_gen
            super().__init__(*args, **kwargs)

    return WarPPOTrainerAsync


def war_trainer_class(async_enable: bool):
    """The Ray actor class ``train_ppo_ray.train`` should instantiate."""
    return ray.remote(_async_trainer_cls() if async_enable else _sync_trainer_cls())


def create_war_engines_for_openrlhf(config: RolloutConfig):
    """A replacement for OpenRLHF's ``create_vllm_engines(...)``: WAR engine actors with
    OpenRLHF's weight-sync worker extension, in one placement group."""
    from ..engine.actors import create_war_engines

    def create(num_engines, tensor_parallel_size, pretrain, seed, full_determinism, enable_prefix_caching,
               enforce_eager, max_model_len, *args, **kwargs):
        if tensor_parallel_size != 1:
            raise ValueError(f"--vllm.tensor_parallel_size {tensor_parallel_size}: WAR engines run one GPU "
                             "each (tensor parallelism is not supported yet); use 1")
        from dataclasses import replace

        eng = replace(config.engine, model=pretrain, seed=seed, max_model_len=max_model_len,
                      enable_prefix_caching=True, enforce_eager=bool(enforce_eager) or config.engine.enforce_eager)
        return create_war_engines(num_engines, eng, openrlhf_worker=True, placement_group=True)

    return create
