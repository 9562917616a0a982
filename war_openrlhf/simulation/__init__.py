"""Simulations that replay traces to measure rollout mechanisms at scale.

- :mod:`spec_replay`: synchronous GRPO steps with draft verification (tokens per step).
- :mod:`cluster`: a discrete-event multi-engine cluster under a dispatch policy.
- :mod:`workloads`: parametric agent workloads for it, beyond the traces one has.
- :mod:`cost_model`, :mod:`fit`: engine step costs, analytic presets and fits to measurements.
- :mod:`gpu_presets`: GPU presets fitted to published measurements, each constant cited.
"""

from . import cost_model  # noqa: F401  (registers the GPU presets before anything uses PRESETS)
from .spec_replay import ReplayConfig, ReplayResult, replay, split_into_steps
from .workloads import NAMED_SPECS, WorkloadSpec, generate_workload

__all__ = ["ReplayConfig", "ReplayResult", "replay", "split_into_steps", "NAMED_SPECS",
           "WorkloadSpec", "generate_workload"]
