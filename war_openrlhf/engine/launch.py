"""Launch steps every rollout engine actor shares, WAR's own and OpenRLHF's baseline alike.

:func:`war_openrlhf.engine.actors.create_war_engines` (with :class:`~war_openrlhf.engine.engine.WarEngine`)
and :func:`war_openrlhf.baselines.openrlhf_rollout.start_openrlhf_engines` start one vLLM
engine per Ray actor. On CPU each engine gets its own core (``VLLM_CPU_OMP_THREADS_BIND``;
unbound engines would share every core) and its KV space (``VLLM_CPU_KVCACHE_SPACE``, whole
GiB, at least 1), and its actor holds one CPU and no GPU.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

__all__ = ["check_num_engines", "cpu_engine_cores", "cpu_engine_env", "engine_actor_options",
           "gpu_engine_placement", "device_env_for_engine", "vllm_engine_kwargs"]


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


def vllm_engine_kwargs(cfg: Any, *, cuda: bool, openrlhf_worker: bool = False) -> dict[str, Any]:
    """The ``vllm.AsyncEngineArgs`` of one WAR engine, from its :class:`EngineConfig`.

    What OpenRLHF 0.11.2's ``create_vllm_engines`` hands vLLM (``trainer/ray/vllm_engine.py``
    lines 240-298) where it applies: ``distributed_executor_backend`` ``uni`` for one GPU,
    ``ray`` for tensor parallelism (vLLM then places its workers on the engine's bundles),
    ``gpu_memory_utilization``, ``enable_sleep_mode``, ``logprobs_mode`` with
    ``max_logprobs=1``, the trainer's dtype on CUDA (OpenRLHF: ``bfloat16`` always; WAR: the
    weight sync's, ``--ds.param_dtype``, when ``dtype`` is ``auto``), ``trust_remote_code`` (OpenRLHF: always on; WAR: the config's, on in
    ``war-train``); plus WAR's speculative config and worker extension.
    """
    from ..device import kv_blocks_for

    kwargs: dict[str, Any] = dict(
        model=cfg.model,
        dtype=cfg.dtype,
        max_model_len=cfg.max_model_len,
        enforce_eager=cfg.enforce_eager,
        enable_prefix_caching=cfg.enable_prefix_caching,
        seed=cfg.seed,
        skip_tokenizer_init=False,
        trust_remote_code=bool(cfg.trust_remote_code),
    )
    if cfg.scheduling_policy != "fcfs":
        kwargs["scheduling_policy"] = cfg.scheduling_policy
    if cuda:
        if cfg.dtype == "auto" and cfg.weight_sync_dtype:  # as OpenRLHF: the engine runs the trainer's dtype
            kwargs["dtype"] = cfg.weight_sync_dtype
        kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        kwargs["tensor_parallel_size"] = cfg.tensor_parallel_size
        kwargs["distributed_executor_backend"] = "uni" if cfg.tensor_parallel_size == 1 else "ray"
        if cfg.enable_sleep_mode:
            kwargs["enable_sleep_mode"] = True
    if cfg.logprobs_mode:
        kwargs["logprobs_mode"] = cfg.logprobs_mode
        kwargs["max_logprobs"] = 1
    if cfg.kv_capacity_tokens is not None:  # a stated KV-pressure regime: the same size on every engine
        kwargs["num_gpu_blocks_override"] = kv_blocks_for(cfg.kv_capacity_tokens, cuda)
    kwargs.update(cfg.drafting.engine_kwargs(cfg.num_speculative_tokens, cfg.index.max_tree_depth,
                                             openrlhf_worker=openrlhf_worker))
    return kwargs


def cost_fit_engine_kwargs(max_len: int, seed: int, *, cuda: bool, dtype: str | None = None) -> dict[str, Any]:
    """The engine ``tools/bench_engine.py --fit-costs`` times: on CUDA what the rollout serves
    (the trainer's ``bfloat16`` as OpenRLHF hands vLLM, CUDA graphs on: OpenRLHF's
    ``enforce_eager`` default is off), on CPU what the CPU engines run (``float32``, eager).
    A fit of a float32 eager engine on a GPU would price a step several times what serving
    pays. Prefix caching is off: the fit needs steps whose work is known."""
    return dict(dtype=dtype or ("bfloat16" if cuda else "float32"), enforce_eager=not cuda,
                max_model_len=max_len, seed=seed, enable_prefix_caching=False, disable_log_stats=False)


def gpu_engine_placement(index: int, tensor_parallel_size: int, *, colocated: bool,
                         bundle_indices: Sequence[int] | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """Ray resources and environment of GPU engine ``index``, as OpenRLHF places its own.

    OpenRLHF 0.11.2 (``create_vllm_engines``, ``trainer/ray/vllm_engine.py`` lines 240-305,
    and ``RolloutRayActor._configure_device_env``, lines 66-78): one GPU per engine actor
    when ``tensor_parallel_size`` is 1 (0.2 when colocated with the trainer in a shared
    placement group, so that the trainer's and the engine's actors share a GPU), none when
    it is larger (vLLM's Ray executor asks for the GPUs of the engine's bundles, named by
    ``VLLM_RAY_BUNDLE_INDICES``); as many CPUs as GPUs; the bundle of the engine's first GPU.
    Returns ``(options, env)``: ``options`` holds ``num_cpus``, ``num_gpus`` and
    ``bundle_index``; ``env`` the variables the engine sets before vLLM starts.
    """
    if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size: must be an int >= 1, got {tensor_parallel_size!r}")
    if bundle_indices is None:
        bundle_indices = list(range(index * tensor_parallel_size, (index + 1) * tensor_parallel_size))
    bundle_indices = [int(b) for b in bundle_indices]
    if len(bundle_indices) != tensor_parallel_size:
        raise ValueError(f"bundle_indices: {len(bundle_indices)} bundles for tensor_parallel_size "
                         f"{tensor_parallel_size}")
    num_gpus: float = 1 if tensor_parallel_size == 1 else 0
    if colocated and tensor_parallel_size == 1:
        num_gpus = 0.2
    env: dict[str, str] = {}
    if tensor_parallel_size > 1:
        env["VLLM_RAY_PER_WORKER_GPUS"] = str(0.2 if colocated else 1)
        env["VLLM_RAY_BUNDLE_INDICES"] = ",".join(map(str, bundle_indices))
    return {"num_cpus": num_gpus, "num_gpus": num_gpus, "bundle_index": bundle_indices[0]}, env


def device_env_for_engine(tensor_parallel_size: int, environ: Mapping[str, str], gpu_ids: Sequence[Any],
                          ray_address: str | None = None) -> dict[str, str | None]:
    """Changes to an engine process's environment before vLLM starts (``None``: remove).

    As OpenRLHF's ``_configure_device_env``: with vLLM's Ray executor (tensor parallel) the
    workers pick their own devices, so ``CUDA_VISIBLE_DEVICES`` goes; with
    ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`` set Ray leaves it unset, so the engine
    pins the GPU Ray gave it. ``RAY_ADDRESS`` (when unset): the running cluster's
    (``ray_address``), as OpenRLHF's ``_configure_vllm_env`` (lines 102-105): vLLM's engine core
    is a spawned process, not a Ray worker, and its Ray executor's ``ray.init(address=None)``
    would otherwise start a new local Ray instead of joining the one holding the engine's GPUs.
    """
    out: dict[str, str | None] = {}
    if ray_address and not environ.get("RAY_ADDRESS"):
        out["RAY_ADDRESS"] = str(ray_address)
    if tensor_parallel_size > 1:
        return {**out, "CUDA_VISIBLE_DEVICES": None, "ROCR_VISIBLE_DEVICES": None, "HIP_VISIBLE_DEVICES": None}
    if environ.get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES") and gpu_ids:  # any value, as OpenRLHF
        out["CUDA_VISIBLE_DEVICES"] = str(gpu_ids[0])
    return out
