"""OpenRLHF's samples-generator contract over the WAR pool (the trainer classes that install it
are in :mod:`war_openrlhf.integrations.openrlhf`)."""

from .samples_generator import WarSamplesGenerator, rollout_metrics, run_coroutine

__all__ = ["WarSamplesGenerator", "rollout_metrics", "run_coroutine"]
