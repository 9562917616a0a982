"""OpenRLHF PPO/GRPO training with WAR rollouts: the samples generator and trainer classes
that put the WAR pool under OpenRLHF's trainers (see :mod:`war_openrlhf.cli.train_ppo`)."""

from .samples_generator import WarSamplesGenerator, rollout_metrics, run_coroutine
from .trainer import ENV_CONFIG, create_war_engines_for_openrlhf, rollout_config_from_env, war_trainer_class

__all__ = ["WarSamplesGenerator", "rollout_metrics", "run_coroutine", "ENV_CONFIG", "war_trainer_class",
           "create_war_engines_for_openrlhf", "rollout_config_from_env"]
