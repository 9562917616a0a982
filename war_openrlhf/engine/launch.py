"""Launch steps every rollout engine actor shares, WAR's own and OpenRLHF's baseline alike.

:func:`war_openrlhf.engine.actors.create_war_engines` (with :class:`~war_openrlhf.engine.engine.WarEngine`)
and :func:`war_openrlhf.baselines.openrlhf_rollout.start_openrlhf_engines` start one vLLM
engine per Ray actor. On CPU each engine gets its own core (``VLLM_CPU_OMP_THREADS_BIND``;
unbound engines would share every core) and its KV space (``VLLM_CPU_KVCACHE_SPACE``, whole
GiB, at least 1), and its actor holds one CPU and no GPU.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

__all__ = ["check_num_engines", "cpu_engine_cores", "cpu_engine_env", "engine_actor_options"]


def check_num_engines(num_engines: Any) -> None:
    """Raise ``ValueError`` unless ``num_engines`` is an int >= 1."""
    if isinstance(num_engines, bool) or not isinstance(num_engines, int) or num_engines < 1:
        raise ValueError(f"num_engines: must be an int >= 1, got {num_engines!r}")


def cpu_engine_cores(num_engines: int, cpu_cores: Sequence[int] | None = None) -> list[int]:
    """One core per CPU engine: cores ``0 .. num_engines - 1``, or ``cpu_cores`` as given.

    Raises ``ValueError`` when there are more engines than cores, or when ``cpu_cores``
    does not list exactly one core per engine, each once.
    """
    cores = os.cpu_count() or 1
    if cpu_cores is None:
        if num_engines > cores:
            raise ValueError(
                f"num_engines: {num_engines} CPU engines need {num_engines} cores, this machine has {cores}; "
                "run fewer engines"
            )
        return list(range(num_engines))
    cpu_cores = list(cpu_cores)
    if len(cpu_cores) != num_engines:
        raise ValueError(f"cpu_cores: {len(cpu_cores)} cores given for {num_engines} engines; give one core per engine")
    if len(set(cpu_cores)) != len(cpu_cores):
        raise ValueError(f"cpu_cores: {cpu_cores} repeats a core; give each engine its own core")
    return cpu_cores


def cpu_engine_env(cpu_core: int | None, kv_cache_space_gib: float | None = None) -> dict[str, str]:
    """vllm-cpu's environment for one engine: ``VLLM_CPU_OMP_THREADS_BIND`` (the engine's
    core, when it has one) and ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB, at least 1; when given)."""
    env: dict[str, str] = {}
    if cpu_core is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu_core)
    if kv_cache_space_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, int(round(kv_cache_space_gib))))
    return env


def engine_actor_options(*, cuda: bool, env_vars: dict[str, str]) -> dict[str, Any]:
    """Ray ``.options(...)`` of one engine actor: one CPU, one GPU on CUDA (none on CPU),
    ``env_vars`` in its ``runtime_env``."""
    return dict(num_cpus=1, num_gpus=1 if cuda else 0, runtime_env={"env_vars": env_vars})
