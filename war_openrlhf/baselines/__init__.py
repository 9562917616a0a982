"""Baselines that run other systems' own code, for benchmarks against WAR.

- :mod:`openrlhf_rollout`: OpenRLHF 0.11.2's rollout path (its ``RolloutRayActor``
  engines, least-loaded dispatch of whole prompts, agent executor and experience
  building), run as it is.
"""

from .openrlhf_rollout import run_openrlhf_rollout, start_openrlhf_engines, stop_openrlhf_engines

__all__ = ["start_openrlhf_engines", "run_openrlhf_rollout", "stop_openrlhf_engines"]
