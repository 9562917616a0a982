"""Ray actors for WAR engines: one :class:`WarEngine` per actor, one core (CPU) or
one GPU each."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..device import cuda_available
from .config import EngineConfig, check_startup
from .engine import WarEngine
from .launch import check_num_engines, cpu_engine_cores, cpu_engine_env, engine_actor_options


def create_war_engines(
    num_engines: int,
    config: EngineConfig,
    *,
    openrlhf_worker: bool = False,
    agent_func_path: str | None = None,
    env: dict[str, str] | None = None,
    placement_group: bool = False,
) -> list[Any]:
    """Start ``num_engines`` engine actors and wait until they serve.

    On CPU each engine gets its own core (``cpu_core`` = its index, bound through
    ``VLLM_CPU_OMP_THREADS_BIND``) and a different seed; asking for more engines than
    cores is an error that says so. ``placement_group``: reserve one bundle per engine
    ({"CPU": 1} on CPU, {"GPU": 1, "CPU": 1} on CUDA) in one PACK placement group first, as
    OpenRLHF does for its vLLM engines, so a pool either gets all its engines or none.
    """
    import ray

    check_num_engines(num_engines)
    cuda = cuda_available()
    cores = cpu_engine_cores(num_engines) if not cuda and config.cpu_core is None else None
    configs = []
    taken: set[int] = set()
    for i in range(num_engines):  # check every engine before starting any
        cfg = replace(config, seed=config.seed + i)
        if cores is not None:
            cfg = replace(cfg, cpu_core=cores[i])
        check_startup(cfg, cuda=cuda, taken_cores=taken)  # e.g. one explicit cpu_core for 2 engines
        if not cuda and cfg.cpu_core is not None:
            taken.add(cfg.cpu_core)
        configs.append(cfg)
    pg = None
    if placement_group:
        from ray.util.placement_group import placement_group as make_pg

        bundles = [{"GPU": 1, "CPU": 1} if cuda else {"CPU": 1} for _ in configs]
        pg = make_pg(bundles, strategy="PACK")
        ray.get(pg.ready(), timeout=600)
    handles = []
    for i, cfg in enumerate(configs):
        env_vars = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1", **(env or {})}
        if not cuda:  # a core bind given in env wins here
            for name, value in cpu_engine_env(cfg.cpu_core).items():
                env_vars.setdefault(name, value)
        options = engine_actor_options(cuda=cuda, env_vars=env_vars)
        options["max_concurrency"] = 1000
        if pg is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=i)
        elif cuda:
            options["num_cpus"] = 0
        actor_cls = ray.remote(WarEngine).options(**options)
        handles.append(actor_cls.remote(cfg, engine_index=i, openrlhf_worker=openrlhf_worker,
                                        agent_func_path=agent_func_path))
    ray.get([h.start.remote() for h in handles])
    return handles
