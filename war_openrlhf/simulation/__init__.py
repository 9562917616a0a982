"""Simulations that replay traces to measure rollout mechanisms at scale.

- :mod:`spec_replay`: synchronous GRPO steps with draft verification (tokens per step).
"""

from .spec_replay import ReplayConfig, ReplayResult, replay, split_into_steps

__all__ = ["ReplayConfig", "ReplayResult", "replay", "split_into_steps"]
