"""Ray actors for WAR engines: one :class:`WarEngine` per actor, one core (CPU) or
one GPU each."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..device import cluster_device
from .config import EngineConfig, check_startup
from .engine import WarEngine
from .launch import check_num_engines, cpu_engine_cores, cpu_engine_env, engine_actor_options, gpu_engine_placement


class EngineLauncher:
    """Starts a set of engine actors, and starts engine ``i`` again after it died or hung.

    It keeps what a start needs (each engine's checked config, the placement group and
    bundle, the environment), so a restart puts the new actor where the old one was: the
    same core on CPU, the same GPU bundle on CUDA. See :func:`create_war_engines` for the
    arguments.
    """

    def __init__(self, num_engines: int, config: EngineConfig, *, openrlhf_worker: bool = False,
                 agent_func_path: str | None = None, env: dict[str, str] | None = None,
                 placement_group: bool = False, shared_pg: Any = None, cuda: bool | None = None) -> None:
        check_num_engines(num_engines)
        self.cuda = cluster_device() == "cuda" if cuda is None else cuda
        cores = cpu_engine_cores(num_engines) if not self.cuda and config.cpu_core is None else None
        self.configs: list[EngineConfig] = []
        taken: set[int] = set()
        for i in range(num_engines):  # check every engine before starting any
            cfg = replace(config, seed=config.seed + i)
            if cores is not None:
                cfg = replace(cfg, cpu_core=cores[i])
            check_startup(cfg, cuda=self.cuda, taken_cores=taken)  # e.g. one explicit cpu_core for 2 engines
            if not self.cuda and cfg.cpu_core is not None:
                taken.add(cfg.cpu_core)
            self.configs.append(cfg)
        self.start_timeout_s = config.start_timeout_s
        self.env = env
        self.placement_group = placement_group
        self.shared_pg = shared_pg
        self.pg = shared_pg
        self.actor_kwargs = {"openrlhf_worker": openrlhf_worker, "agent_func_path": agent_func_path}

    def _spawn(self, i: int) -> Any:
        import ray

        options = engine_actor_placement(i, self.configs[i], cuda=self.cuda, pg=self.pg,
                                         colocated=self.shared_pg is not None, env=self.env)
        return ray.remote(WarEngine).options(**options).remote(self.configs[i], engine_index=i, **self.actor_kwargs)

    def start_all(self) -> list[Any]:
        """Start every engine and wait until all serve (``start_timeout_s``); on a failed or
        hung start no engine of the set is left running."""
        import ray

        if self.pg is None and self.placement_group:
            from ray.util.placement_group import placement_group as make_pg

            tp = self.configs[0].tensor_parallel_size
            bundles = ([{"GPU": 1, "CPU": 1} for _ in range(len(self.configs) * tp)] if self.cuda
                       else [{"CPU": 1} for _ in self.configs])
            self.pg = make_pg(bundles, strategy="PACK")
            ray.get(self.pg.ready(), timeout=600)
        handles = [self._spawn(i) for i in range(len(self.configs))]
        refs = [h.start.remote() for h in handles]
        try:
            started = ray.get(refs, timeout=self.start_timeout_s)
        except BaseException as exc:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            late = [i for i, r in enumerate(refs) if r not in ready]
            stop_engines(handles)
            if isinstance(exc, ray.exceptions.GetTimeoutError):
                raise RuntimeError(f"engines {late} did not start within EngineConfig.start_timeout_s="
                                   f"{self.start_timeout_s:g} s; every engine of the set was stopped") from None
            raise
        for i, stats in enumerate(started):
            print(f"WAR engine {i} on node {stats.get('node_id', '?')}", flush=True)
        return handles

    def restart(self, i: int, old_handle: Any) -> Any:
        """Kill engine ``i``'s actor (dead or hung) and start a new one in its place (same
        config, core or GPU bundle); returns the new handle once it serves. Blocking: the pool
        calls it from a recovery thread. Raises ``RuntimeError`` if the new actor does not
        start within ``start_timeout_s`` (it is then killed too)."""
        import ray

        stop_engines([old_handle])
        handle = self._spawn(i)
        try:
            stats = ray.get(handle.start.remote(), timeout=self.start_timeout_s)
        except BaseException as exc:
            stop_engines([handle])
            if isinstance(exc, ray.exceptions.GetTimeoutError):
                raise RuntimeError(f"engine {i}: the restarted actor did not start within "
                                   f"EngineConfig.start_timeout_s={self.start_timeout_s:g} s") from None
            raise
        print(f"WAR engine {i} restarted on node {stats.get('node_id', '?')}", flush=True)
        return handle


def create_war_engines(
    num_engines: int,
    config: EngineConfig,
    *,
    openrlhf_worker: bool = False,
    agent_func_path: str | None = None,
    env: dict[str, str] | None = None,
    placement_group: bool = False,
    shared_pg: Any = None,
    cuda: bool | None = None,
) -> list[Any]:
    """Start ``num_engines`` engine actors and wait until they serve.

    On CPU each engine gets its own core (``cpu_core`` = its index, bound through
    ``VLLM_CPU_OMP_THREADS_BIND``) and a different seed; asking for more engines than
    cores is an error that says so. ``placement_group``: reserve one bundle per engine
    ({"CPU": 1} on CPU; on CUDA ``tensor_parallel_size`` bundles of {"GPU": 1, "CPU": 1})
    in one PACK placement group first, as OpenRLHF does for its vLLM engines, so a pool
    either gets all its engines or none. ``shared_pg``: OpenRLHF's colocated placement
    group (``--train.colocate_all`` and friends): the engines go on its bundles with a
    fraction of a GPU each, as OpenRLHF's own engines do, and no group is reserved.
    ``cuda``: the cluster's device (default: :func:`~war_openrlhf.device.cluster_device`).
    :class:`EngineLauncher` does the work and can restart an engine later.
    """
    return EngineLauncher(num_engines, config, openrlhf_worker=openrlhf_worker, agent_func_path=agent_func_path,
                          env=env, placement_group=placement_group, shared_pg=shared_pg, cuda=cuda).start_all()


def stop_engines(handles: list[Any]) -> None:
    """Kill engine actors, whatever state they are in (a failed start, a pool that failed to build)."""
    import ray

    for h in handles:
        try:
            ray.kill(h)
        except Exception:  # noqa: BLE001 - already gone
            pass


def engine_actor_placement(index: int, cfg: EngineConfig, *, cuda: bool, pg: Any = None, colocated: bool = False,
                           env: dict[str, str] | None = None) -> dict[str, Any]:
    """Ray ``.options(...)`` of engine actor ``index``: resources, placement-group bundle and
    environment (see :func:`~war_openrlhf.engine.launch.gpu_engine_placement` for GPUs)."""
    env_vars = {**(env or {})}
    if not cuda:  # a core bind given in env wins here
        for name, value in cpu_engine_env(cfg.cpu_core).items():
            env_vars.setdefault(name, value)
    options = engine_actor_options(cuda=cuda, env_vars=env_vars)
    options["max_concurrency"] = 1000
    bundle_index = index
    if cuda:
        tp = cfg.tensor_parallel_size
        bundles = None
        if pg is not None and tp > 1:
            from openrlhf.trainer.ray.utils import get_bundle_indices  # bundles grouped by node

            bundles = get_bundle_indices(pg, index, tp)
        place, device_env = gpu_engine_placement(index, tp, colocated=colocated, bundle_indices=bundles)
        bundle_index = place["bundle_index"]
        options.update(num_cpus=place["num_cpus"], num_gpus=place["num_gpus"])
        options["runtime_env"]["env_vars"].update(device_env)
    if pg is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=bundle_index,
            placement_group_capture_child_tasks=True)  # vLLM's Ray workers (tensor parallel) join it
    elif cuda:
        options["num_cpus"] = 0
    return options
