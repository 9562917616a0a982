"""OpenRLHF 0.11.2's own rollout path, run as it is, as a benchmark baseline.

What runs is OpenRLHF's code, not a re-implementation:

- engines: its ``RolloutRayActor`` (``openrlhf/trainer/ray/vllm_engine.py``), one async
  vLLM engine per actor with vLLM's default configuration (no speculation) and the
  engine arguments ``create_vllm_engines`` gives it;
- dispatch: ``SamplesGenerator._dispatch_prompts_to_vllm``
  (``trainer/ppo_utils/samples_generator.py``): one snapshot of every engine's
  unfinished-request count, then each prompt with all its ``n`` samples goes to the
  least-loaded engine (a min-heap; the engine's load grows by ``n``);
- trajectories: the executor inside the engine actor, i.e. ``MultiTurnAgentExecutor``
  loaded from ``agent_func_path`` (or ``SingleTurnAgentExecutor`` without one), so a
  whole trajectory stays on the engine its prompt was dispatched to;
- experiences: ``SamplesGenerator._generate_vllm`` collecting results as they finish and
  ``_process_response_into_experience`` turning each into an ``Experience``.

:func:`run_openrlhf_rollout` only supplies what the trainer would: a ``strategy`` whose
``args`` carry the fields ``SamplesGenerator`` reads, an iterator shaped like its prompt
dataloader, and the generate kwargs ``train_ppo_ray`` passes. The engine handles it
gives ``SamplesGenerator`` forward every call unchanged and record two facts for the
stats: the load snapshot each dispatch took and the engine each prompt went to.
"""

from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace
from typing import Any, Iterable, Sequence

from ..cpu import OPENRLHF_WORKER_WRAP
from ..device import cuda_available, kv_blocks_for
from ..engine.config import EngineConfig, check_startup
from ..engine.launch import check_num_engines, cpu_engine_cores, cpu_engine_env, engine_actor_options

__all__ = ["start_openrlhf_engines", "run_openrlhf_rollout", "stop_openrlhf_engines"]


def start_openrlhf_engines(
    num_engines: int,
    model_dir: str | os.PathLike,
    *,
    agent_func_path: str | os.PathLike | None = None,
    max_model_len: int = 2048,
    seed: int = 0,
    enable_prefix_caching: bool = True,
    enforce_eager: bool | None = None,
    cpu_cores: Sequence[int] | None = None,
    logprobs_mode: str | None = "processed_logprobs",
    kv_cache_space_gib: float | None = None,
    kv_capacity_tokens: int | None = None,
    speculative_config: dict | None = None,
    gpu_memory_utilization: float | None = None,
) -> list[Any]:
    """Start OpenRLHF's ``RolloutRayActor`` engines and wait until they serve.

    ``max_model_len`` is what ``train_ppo_ray`` passes (``--data.max_len``, default
    2048). ``enable_prefix_caching`` is passed through as OpenRLHF does; note that
    its CLI default (``--vllm.enable_prefix_caching`` unset) is ``False``, while this
    baseline defaults to ``True`` so it is compared with prefix reuse on.
    ``logprobs_mode`` is what ``train_ppo_ray`` passes when rollout log-probs are used
    (``--algo.advantage.is_correction_level`` not ``off``); ``None`` for vLLM's default.
    ``enforce_eager`` defaults to ``False`` on CUDA (OpenRLHF's default) and ``True`` on
    CPU (compiling takes minutes there).

    With CUDA this is OpenRLHF's ``create_vllm_engines(...)``, unchanged (tensor
    parallel 1, no shared placement group, no sleep mode, no full determinism), with
    ``gpu_memory_utilization`` the WAR engines' (default: ``EngineConfig``'s), so that an A/B
    compares the same KV size: OpenRLHF's own 0.95 would give the baseline more.

    On CPU it creates the same ``RolloutRayActor`` with the same engine arguments, except
    where :func:`_start_cpu_actors` says.

    Two engine arguments a benchmark states explicitly, passed to ``vllm.AsyncEngineArgs``
    through ``RolloutRayActor``'s keyword arguments (on CUDA added to the arguments
    ``create_vllm_engines`` builds, which has no parameter for them: :func:`_start_gpu_actors`):

    - ``kv_capacity_tokens``: exact usable KV-cache size (``num_gpu_blocks_override``: whole
      blocks and vLLM's null block), the same size the WAR engines get in a KV-pressure regime;
    - ``speculative_config``: vLLM's own speculation, e.g. ``{"method": "suffix",
      "num_speculative_tokens": 8}`` (per-engine suffix trees: what an OpenRLHF user gets by
      adding that one engine argument).

    Returns the actor handles (what ``create_vllm_engines`` returns).
    """
    import ray

    check_num_engines(num_engines)
    model_dir = str(model_dir)
    agent_func_path = _checked_agent_path(agent_func_path)
    cuda = cuda_available()
    if enforce_eager is None:
        enforce_eager = not cuda
    kv_gib = float(kv_cache_space_gib if kv_cache_space_gib is not None
                   else os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    cores = None if cuda else cpu_engine_cores(num_engines, cpu_cores)
    # The same start-up checks as the project's own engines (model dir, KV space, cores).
    for i in range(num_engines):
        check_startup(EngineConfig(model=model_dir, dtype="bfloat16" if cuda else "float32",
                                   max_model_len=max_model_len, kv_cache_space_gib=kv_gib,
                                   cpu_core=None if cuda else cores[i]), cuda=cuda)
    if not ray.is_initialized():
        raise RuntimeError("start_openrlhf_engines: Ray is not initialized; call ray.init(...) first")
    _check_engine_extras(kv_capacity_tokens, speculative_config, max_model_len, cuda)
    if cuda:
        memory = EngineConfig.gpu_memory_utilization if gpu_memory_utilization is None else float(gpu_memory_utilization)
        engines = _start_gpu_actors(num_engines, model_dir, seed=seed, enable_prefix_caching=enable_prefix_caching,
                                    enforce_eager=bool(enforce_eager), max_model_len=max_model_len,
                                    gpu_memory_utilization=memory, logprobs_mode=logprobs_mode,
                                    agent_func_path=agent_func_path,
                                    extra=_engine_extras(kv_capacity_tokens, speculative_config, cuda=True))
    else:
        engines = _start_cpu_actors(num_engines, model_dir, agent_func_path=agent_func_path,
                                    max_model_len=max_model_len, seed=seed,
                                    enable_prefix_caching=enable_prefix_caching,
                                    enforce_eager=bool(enforce_eager), cores=cores, kv_gib=kv_gib,
                                    logprobs_mode=logprobs_mode, kv_capacity_tokens=kv_capacity_tokens,
                                    speculative_config=speculative_config)
    _wait_until_serving(engines)
    return engines


def _checked_agent_path(agent_func_path: str | os.PathLike | None) -> str | None:
    if agent_func_path is None:
        return None
    agent_func_path = str(agent_func_path)
    if not agent_func_path.endswith(".py") or not os.path.isfile(agent_func_path):
        raise ValueError(
            f"agent_func_path: {agent_func_path!r} is not a .py file; OpenRLHF loads the AgentExecutor class "
            "from a Python file"
        )
    return agent_func_path


def _check_engine_extras(kv_capacity_tokens: int | None, speculative_config: dict | None, max_model_len: int,
                         cuda: bool) -> None:
    if kv_capacity_tokens is not None and kv_capacity_tokens < max_model_len:
        raise ValueError(f"kv_capacity_tokens: {kv_capacity_tokens} cannot hold one max_model_len={max_model_len} "
                         "sequence")


def _engine_extras(kv_capacity_tokens: int | None, speculative_config: dict | None, *, cuda: bool) -> dict[str, Any]:
    """The engine arguments a benchmark states beyond OpenRLHF's: an exact KV size in whole
    blocks of the device's size, vLLM's own speculation."""
    extra: dict[str, Any] = {}
    if kv_capacity_tokens is not None:
        extra["num_gpu_blocks_override"] = kv_blocks_for(kv_capacity_tokens, cuda=cuda)
    if speculative_config is not None:
        extra["speculative_config"] = dict(speculative_config)
    return extra


_CREATE_LOCK = threading.Lock()


def _start_gpu_actors(num_engines: int, model_dir: str, *, seed: int, enable_prefix_caching: bool,
                      enforce_eager: bool, max_model_len: int, gpu_memory_utilization: float,
                      logprobs_mode: str | None, agent_func_path: str | None, extra: dict[str, Any]) -> list[Any]:
    """OpenRLHF's own ``create_vllm_engines`` (placement, arguments, bf16, trust_remote_code),
    with ``extra`` added to each ``RolloutRayActor``'s keyword arguments (it hands them to
    ``vllm.AsyncEngineArgs``, ``vllm_engine.py`` lines 60-62): the call is OpenRLHF's, only
    the actor class it sees adds them."""
    import openrlhf.trainer.ray.vllm_engine as openrlhf_engines

    real = openrlhf_engines.RolloutRayActor

    class _WithExtras:
        @staticmethod
        def options(**options):
            handle = real.options(**options)
            return SimpleNamespace(remote=lambda *a, **kw: handle.remote(*a, **{**kw, **extra}))

    with _CREATE_LOCK:
        openrlhf_engines.RolloutRayActor = _WithExtras if extra else real
        try:
            return openrlhf_engines.create_vllm_engines(
                num_engines, 1, model_dir, seed, False, enable_prefix_caching, enforce_eager, max_model_len,
                None, gpu_memory_utilization, False, logprobs_mode, agent_func_path=agent_func_path)
        finally:
            openrlhf_engines.RolloutRayActor = real


def _wait_until_serving(engines: list[Any]) -> None:
    """Wait for every engine's async ``__init__`` (the engine is up once an actor answers);
    on a failure stop them all and say what to check."""
    import ray

    try:
        ray.get([e.get_num_unfinished_requests.remote() for e in engines])
    except Exception as exc:
        stop_openrlhf_engines(engines)
        raise RuntimeError(
            f"start_openrlhf_engines: an OpenRLHF RolloutRayActor failed to start ({type(exc).__name__}: {exc}); "
            "check model_dir / max_model_len / kv_cache_space_gib / agent_func_path"
        ) from exc


def _start_cpu_actors(num_engines: int, model_dir: str, *, agent_func_path: str | None, max_model_len: int,
                      seed: int, enable_prefix_caching: bool, enforce_eager: bool, cores: Sequence[int],
                      kv_gib: float, logprobs_mode: str | None, kv_capacity_tokens: int | None,
                      speculative_config: dict | None) -> list[Any]:
    """OpenRLHF's ``RolloutRayActor`` engines on CPU (not yet waited for).

    The engine arguments of ``create_vllm_engines``, except (each needed to run at all, or to run
    the tiny test model faithfully):

    - no placement group and ``num_gpus=0, num_cpus=1`` per actor instead of
      ``{"GPU": 1, "CPU": 1}`` bundles: there are no GPUs to reserve;
    - ``dtype="float32"`` instead of ``"bfloat16"``: the tiny test model is float32 and
      its greedy/logprob checks need it (see ``fixtures.tiny_model``);
    - ``enforce_eager`` by default (there are no CUDA graphs to capture on CPU);
    - no ``gpu_memory_utilization`` (meaningless on CPU); KV space comes from
      ``VLLM_CPU_KVCACHE_SPACE`` (``kv_cache_space_gib``, default: the environment's
      value or 1 GiB);
    - each engine bound to its own core with ``VLLM_CPU_OMP_THREADS_BIND`` (through the
      actor's ``runtime_env``): unbound engines would share every core;
    - ``worker_extension_cls`` is OpenRLHF's ``WorkerWrap``, as ``create_vllm_engines``
      sets it: it loads on CPU (only its weight-sync methods need CUDA, and the
      rollout never calls them).
    """
    from openrlhf.trainer.ray.vllm_engine import RolloutRayActor

    engines = []
    for i in range(num_engines):
        actor_kwargs = {
            "model": model_dir,
            "enforce_eager": bool(enforce_eager),
            "worker_extension_cls": OPENRLHF_WORKER_WRAP,
            "tensor_parallel_size": 1,
            "seed": seed + i,
            "distributed_executor_backend": "uni",
            "max_model_len": max_model_len,
            "enable_prefix_caching": enable_prefix_caching,
            "dtype": "float32",
            # the baseline mirrors OpenRLHF's own engine arguments (create_vllm_engines,
            # vllm_engine.py line 274); the models here are local builds with no custom code
            "trust_remote_code": True,
            "full_determinism": False,
            "bundle_indices": None,
            "num_gpus": 0,
            "enable_sleep_mode": False,
            "agent_func_path": agent_func_path,
            "remote_rm_url": None,
            "mm_pad_token_ids": set(),
        }
        if logprobs_mode:
            actor_kwargs["logprobs_mode"] = logprobs_mode
            actor_kwargs["max_logprobs"] = 1
        actor_kwargs.update(_engine_extras(kv_capacity_tokens, speculative_config, cuda=False))
        env_vars = cpu_engine_env(cores[i], kv_gib)
        engines.append(RolloutRayActor.options(**engine_actor_options(cuda=False, env_vars=env_vars)).remote(
            **actor_kwargs
        ))
    return engines


def stop_openrlhf_engines(engines: Iterable[Any]) -> None:
    """Shut the engines' vLLM engine cores down, then kill the actors.

    ``RolloutRayActor`` has no shutdown method; ``__ray_call__`` runs
    ``self.llm.shutdown()`` inside the actor so vLLM's engine-core process exits too.
    """
    import ray

    engines = list(engines)
    refs = []
    for engine in engines:
        try:
            refs.append(engine.__ray_call__.remote(_shutdown_llm))
        except Exception:  # already dead
            pass
    if refs:
        try:
            ray.get(refs, timeout=60)
        except Exception:
            pass
    for engine in engines:
        try:
            ray.kill(engine)
        except Exception:
            pass


def _reset_suffix_cache(actor: Any) -> int:
    # runs on a thread of the (async) RolloutRayActor; the RPC runs on the actor's event loop,
    # the one vLLM's output handler lives on (started by the first request)
    import asyncio

    handler = getattr(actor.llm, "output_handler", None)
    if handler is None:
        return 0  # no request yet: the cache is still empty
    from war_openrlhf.engine.worker_extension import fresh_vllm_suffix_cache

    job = asyncio.run_coroutine_threadsafe(actor.llm.collective_rpc(fresh_vllm_suffix_cache), handler.get_loop())
    return sum(job.result(timeout=60))


def reset_vllm_suffix_caches(engines: Iterable[Any]) -> int:
    """Empty vLLM's own suffix cache on each of OpenRLHF's engines (``speculative_config`` method
    ``suffix``): a benchmark that repeats one step must not let vLLM draft from the responses of
    the same prompts' earlier repeats (a real step's prompts are new) while WAR's index starts
    each run empty. Returns how many cached responses were dropped."""
    import ray

    return sum(ray.get([e.__ray_call__.remote(_reset_suffix_cache) for e in engines]))


def _shutdown_llm(actor: Any) -> None:
    llm = getattr(actor, "llm", None)
    if llm is not None:
        llm.shutdown()


class _RecordingMethod:
    """``handle.method`` as ``SamplesGenerator`` uses it (``.remote(...)``), recording the call."""

    def __init__(self, method: Any, record) -> None:
        self._method = method
        self._record = record

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        ref = self._method.remote(*args, **kwargs)
        self._record(ref, args, kwargs)
        return ref


class _RecordingEngine:
    """An engine handle that forwards everything and records what OpenRLHF's dispatch did:
    the unfinished-request snapshot (``get_num_unfinished_requests``) and the engine each
    prompt was sent to (``generate_responses``)."""

    def __init__(self, handle: Any, index: int, log: dict[str, list]) -> None:
        self._handle = handle

        def snapshot(ref, args, kwargs):
            log["snapshot_refs"].append((index, ref))

        def placement(ref, args, kwargs):
            log["placements"].append(index)

        self.get_num_unfinished_requests = _RecordingMethod(handle.get_num_unfinished_requests, snapshot)
        self.generate_responses = _RecordingMethod(handle.generate_responses, placement)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


def _strategy(n_samples_per_prompt: int, batch_size: int, logprobs: bool) -> SimpleNamespace:
    """A ``strategy`` whose ``args`` hold every field ``SamplesGenerator`` reads (and no
    others, so a new read in another OpenRLHF version fails with its name):
    ``rollout.n_samples_per_prompt`` / ``batch_size`` / ``vllm_generate_batch_size``,
    ``algo.advantage.is_correction_level`` (``"token"`` asks vLLM for the sampled
    token's logprob, as rollout-correction training does), ``algo.dynamic_filtering_*``
    (off) and ``vllm.enable_sleep`` (off)."""
    args = SimpleNamespace(
        rollout=SimpleNamespace(n_samples_per_prompt=n_samples_per_prompt, batch_size=batch_size,
                                vllm_generate_batch_size=None),
        algo=SimpleNamespace(advantage=SimpleNamespace(is_correction_level="token" if logprobs else "off"),
                             dynamic_filtering_enable=False, dynamic_filtering_range=(0.0, 1.0)),
        vllm=SimpleNamespace(enable_sleep=False),
    )
    return SimpleNamespace(args=args)


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: must be an int >= 1, got {value!r}")


def run_openrlhf_rollout(
    engines: Sequence[Any],
    prompts: Sequence[str],
    labels: Sequence[Any],
    *,
    tokenizer: Any,
    n_samples_per_prompt: int,
    max_new_tokens: int | None,
    max_len: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    logprobs: bool = True,
) -> tuple[list[Any], dict[str, Any]]:
    """One rollout of ``prompts`` x ``n_samples_per_prompt`` through OpenRLHF's code.

    ``tokenizer``: a HF tokenizer (sent to the engines with every prompt, pickled by
    Ray, as OpenRLHF does) or a model directory, loaded with OpenRLHF's
    ``get_tokenizer``. ``max_new_tokens`` and ``max_len`` mean what OpenRLHF's
    ``--rollout.max_new_tokens`` and ``--data.max_len`` mean; note that
    ``MultiTurnAgentExecutor`` gives every turn a budget of ``max_len`` minus the
    context so far, so ``max_new_tokens`` only trims over-long prompts there.

    Returns ``(experiences, stats)``: one ``Experience`` per trajectory, in completion
    order, and ``wall_s``, ``action_tokens`` (generated tokens: the action masks'
    sum), ``tokens_per_s``, ``trajectories``, ``prompts_per_engine``,
    ``trajectories_per_engine``, ``placements`` (engine of each prompt, in prompt
    order) and ``load_snapshot`` (the unfinished-request counts the dispatch used).
    """
    prompts, labels = list(prompts), list(labels)
    _check_rollout_args(engines, prompts, labels, n_samples_per_prompt, max_new_tokens, max_len)
    if isinstance(tokenizer, (str, os.PathLike)):
        from openrlhf.utils.utils import get_tokenizer

        tokenizer = get_tokenizer(str(tokenizer), None, "left", None)

    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

    log: dict[str, list] = {"snapshot_refs": [], "placements": []}
    recording = [_RecordingEngine(e, i, log) for i, e in enumerate(engines)]
    generator = SamplesGenerator(
        strategy=_strategy(n_samples_per_prompt, len(prompts), logprobs),
        prompts_dataloader=None,
        eval_dataloader=None,
        tokenizer=tokenizer,
        vllm_engines=recording,
    )
    # What train_ppo_ray passes to the trainer as generate kwargs.
    generate_kwargs = dict(do_sample=True, max_len=max_len, max_new_tokens=max_new_tokens,
                           temperature=temperature, top_p=top_p)
    # The prompt dataloader yields (indices, prompts, labels, images) batches.
    batches = iter([(list(range(len(prompts))), prompts, labels, [None] * len(prompts))])
    t0 = time.perf_counter()
    experiences, consumed, _ = generator._generate_vllm(
        dataloader_iter=batches, num_prompts=len(prompts), dynamic_filtering=False, **generate_kwargs
    )
    wall = time.perf_counter() - t0

    return experiences, _rollout_stats(log, len(engines), experiences, consumed, wall, n_samples_per_prompt)


def _check_rollout_args(engines: Sequence[Any], prompts: list, labels: list, n_samples_per_prompt: int,
                        max_new_tokens: int | None, max_len: int) -> None:
    if not engines:
        raise ValueError("engines: no engines given; start them with start_openrlhf_engines")
    if not prompts:
        raise ValueError("prompts: empty; give at least one prompt")
    if len(labels) != len(prompts):
        raise ValueError(f"labels: {len(labels)} labels for {len(prompts)} prompts; give one label per prompt")
    _check_positive_int("n_samples_per_prompt", n_samples_per_prompt)
    _check_positive_int("max_len", max_len)
    if max_new_tokens is not None:
        _check_positive_int("max_new_tokens", max_new_tokens)
        if max_new_tokens >= max_len:
            raise ValueError(f"max_new_tokens: {max_new_tokens} leaves no room for the prompt in max_len={max_len}")


def _rollout_stats(log: dict[str, list], num_engines: int, experiences: list, consumed: int, wall: float,
                   n_samples_per_prompt: int) -> dict[str, Any]:
    """:func:`run_openrlhf_rollout`'s stats, from what the recording handles saw."""
    import ray

    snapshot = [0] * num_engines
    for index, value in zip([i for i, _ in log["snapshot_refs"]], ray.get([r for _, r in log["snapshot_refs"]])):
        snapshot[index] = int(value)
    placements = list(log["placements"])
    prompts_per_engine = [placements.count(i) for i in range(num_engines)]
    action_tokens = int(sum(int(e.action_mask.sum()) for e in experiences))
    return {
        "wall_s": wall,
        "action_tokens": action_tokens,
        "tokens_per_s": action_tokens / wall if wall > 0 else 0.0,
        "trajectories": len(experiences),
        "prompts": consumed,
        "prompts_per_engine": prompts_per_engine,
        "trajectories_per_engine": [c * n_samples_per_prompt for c in prompts_per_engine],
        "placements": placements,
        "load_snapshot": snapshot,
    }
