"""The WAR rollout pool: engine actors + per-turn dispatch + the global suffix index.

``RolloutPool.start(config)`` starts ``num_engines`` :class:`~war_openrlhf.engine.WarEngine`
Ray actors in one placement group (one core each on CPU, one GPU each on CUDA) and builds the
dispatch policy. ``run_batch(prompts, labels)`` runs ``n_samples_per_prompt`` episodes per
prompt (one GRPO group per prompt), all concurrently on one asyncio loop:

* **per-turn dispatch**: every turn asks the policy for an engine, given a snapshot the pool
  keeps itself (it is the engines' only client): requests in flight and their token budget,
  trajectories parked on a tool per engine (pending turns), KV capacity, health. A policy may
  answer ``DEFER`` for a first turn (KV-aware admission): the episode waits until some turn
  finishes;
* **global index**: every finished turn (context + response) is appended to one
  :class:`~war_openrlhf.speculation.CompletedSequenceLog`; a background task ships new
  entries to every healthy engine's replica every ``log_sync_interval_s``, so a sample on
  engine B drafts from its siblings that finished on engine A;
* **speculation** is switched inside each engine by its own measured load (``engine.speculation:
  auto``); the pool reports the fraction of engine steps that speculated;
* **faults**: an engine call that fails because the actor (or its vLLM) died, or a turn unanswered within
  ``turn_timeout_s``, marks the engine unhealthy and re-dispatches the turn (up to
  ``engine_retries`` times) to a healthy engine; a background thread then probes it and, per
  ``engine_recovery``, brings it back when it answers again or restarts its actor; a tool error,
  a timeout, an over-long context or a broken environment ends or annotates only its own
  episode (:mod:`.episode`). Every episode returns a :class:`~.trajectory.Trajectory`.

The pool also accepts engines it did not start (``RolloutPool(config, engines=[...])``): Ray
actor handles or in-process :class:`~war_openrlhf.engine.WarEngine` objects.

In parts: :class:`~.turn_router.TurnRouter` (dispatch, parking, deferral: the episodes'
``TurnService``), :class:`~.log_shipper.LogShipper` (the record channel to the replicas),
:class:`~.supervisor.EngineSupervisor` (stats, recovery, shutdown); this class runs batches
over them.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import numpy as np

from ..dispatch import DispatchPolicy, make_policy
from ..engine.stats import EngineStats
from ..speculation import CompletedSequenceLog
from .agents import load_agent_class
from .config import RolloutConfig
from .engine_client import ENGINE_METHODS, EngineClient, EngineHandle
from .episode import make_room_for_agent_threads, run_episode
from .gc_heap import frozen_heap
from .log_shipper import LogShipper
from .supervisor import EngineSupervisor
from .trajectory import Trajectory
from .turn_result import TurnResult
from .turn_router import TurnRouter

log = logging.getLogger(__name__)


@dataclass
class BatchResult:
    trajectories: list[Trajectory]
    wall_s: float
    generated_tokens: int
    turns: int
    prompt_tokens: int
    cached_tokens: int
    redispatched_turns: int
    deferrals: int
    engine_turns: list[int]
    engine_stats: list[EngineStats] = field(default_factory=list)
    end_reasons: dict[str, int] = field(default_factory=dict)
    episode_retries: int = 0  # episodes re-run after an engine or environment failure
    deferred_wait_s: float = 0.0  # seconds turns waited, summed, while the dispatcher deferred them (KV short)
    engines_recovered: int = 0  # dead-marked engines back in service during the batch (engine_recovery)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def summary(self) -> dict[str, Any]:
        fr = [s.spec_step_fraction for s in self.engine_stats]
        return {
            "episodes": len(self.trajectories), "wall_s": self.wall_s,
            "generated_tokens": self.generated_tokens, "tokens_per_s": self.tokens_per_s,
            "turns": self.turns, "prefix_hit_rate": self.prefix_hit_rate,
            "redispatched_turns": self.redispatched_turns, "deferrals": self.deferrals,
            "episode_retries": self.episode_retries, "engine_turns": self.engine_turns, "end_reasons": self.end_reasons,
            "mean_reward": float(np.mean([t.reward for t in self.trajectories])) if self.trajectories else 0.0,
            "speculating_fraction": fr,
        }


class RolloutPool:
    """Engines + dispatcher + global index log; runs batches of multi-turn episodes."""

    def __init__(self, config: RolloutConfig, engines: Sequence[Any], *, tokenizer=None,
                 agent_cls: type | None = None, policy: DispatchPolicy | None = None,
                 launcher: Any = None) -> None:
        if not engines:
            raise ValueError("engines: a pool needs at least one engine")
        for i, handle in enumerate(engines):
            if not isinstance(handle, EngineHandle):
                missing = [m for m in ENGINE_METHODS if not hasattr(handle, m)]
                raise ValueError(f"engines[{i}]: a {type(handle).__name__} is not an engine (no "
                                 f"{', '.join(missing)}); pass WarEngine objects or their Ray actor handles")
        self.config = config
        self.engines = [EngineClient(i, h, turn_transport=config.turn_transport) for i, h in enumerate(engines)]
        if policy is None:
            policy = _build_policy(config, len(self.engines))
        self.policy = policy
        if agent_cls is None:
            if not config.agent_func_path:
                raise ValueError("RolloutConfig.agent_func_path: no environment given; pass an OpenRLHF "
                                 "agent file (see examples/)")
            agent_cls = load_agent_class(config.agent_func_path)
        self.agent_cls = agent_cls
        if config.episode_host == "engine" and not config.agent_func_path:
            raise ValueError("RolloutConfig.agent_func_path: episode_host: engine loads the agent from its file "
                             "beside each engine; give the agent file, not only its class")
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(config.engine.model)
        self.tokenizer = tokenizer
        self.pool_id = f"pool-{uuid.uuid4().hex[:12]}"  # owner of the engines' index replicas
        self.shipper = LogShipper(config, self.engines, self.pool_id)
        self.router = TurnRouter(config, self.engines, policy, self.shipper)
        # ``launcher``: given by :meth:`start`, whose engines the pool ends and may restart
        self.supervisor = EngineSupervisor(config, self.engines, launcher=launcher, started_here=launcher is not None)
        self.router.on_newer_weights = self.advance_policy_version
        self.router.before_dispatch = self._install_recovered
        self._batch_index = 0
        self._restored = False  # a saved state's index records wait to be flushed to the replicas
        self._episode_retries = 0
        self._stats_errors = 0

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def start(cls, config: RolloutConfig, **kwargs: Any) -> "RolloutPool":
        """Start the engine actors (Ray must be initialised) and build the pool."""
        from ..engine.actors import EngineLauncher, stop_engines

        if kwargs.get("policy") is None:  # built (its options checked) before any engine starts
            kwargs["policy"] = _build_policy(config, config.num_engines)
        launcher = EngineLauncher(config.num_engines, config.engine, placement_group=True)
        handles = launcher.start_all()
        try:
            return cls(config, handles, launcher=launcher, **kwargs)
        except BaseException:  # engines started for a pool that failed to build: stop them
            stop_engines(handles)
            raise

    def shutdown(self) -> None:
        self.supervisor.shutdown()

    # ------------------------------------------------------------------ the parts, as the episodes and callers see them
    @property
    def log(self) -> CompletedSequenceLog:
        """The global log of finished turns (what the replicas keep of each)."""
        return self.shipper.log

    @property
    def policy_version(self) -> int:
        return self.shipper.policy_version

    def park(self, trajectory_id: str, engine: int) -> None:
        self.router.park(trajectory_id, engine)

    def unpark(self, trajectory_id: str) -> None:
        self.router.unpark(trajectory_id)

    async def generate_turn(self, trajectory_id: str, group_id: str, context: Sequence[int],
                            sampling_params: dict[str, Any], turn_index: int, tokens_so_far: int) -> TurnResult:
        return await self.router.generate_turn(trajectory_id, group_id, context, sampling_params, turn_index,
                                               tokens_so_far)

    async def sync_log(self, flush: bool = False) -> None:
        await self.shipper.sync(flush)

    async def poll_kv_events(self) -> None:
        await self.router.poll_kv_events()

    async def engine_stats(self) -> list[EngineStats]:
        """Every engine's report (the last one for an engine that died, with ``healthy`` False)."""
        return await self.supervisor.stats()

    def speculating_fraction(self) -> float | None:
        return self.supervisor.speculating_fraction()

    def advance_policy_version(self, version: int | None = None) -> int:
        """New weights: later records carry the new version (the index can age out old ones).
        Called by the weight-sync hook (:func:`war_openrlhf.training.weight_sync_hook.after_weight_sync`
        returns the engines' version) and by the router when a turn reports a newer one."""
        version = self.policy_version + 1 if version is None else int(version)
        if version <= self.policy_version:
            return self.policy_version
        self.shipper.advance_policy_version(version)
        self.supervisor.policy_version = version
        # a weight sync resets the engines' prefix caches: the dispatcher's model of them goes too
        self.policy.on_prefix_cache_reset()
        return version

    def forget_index_records(self) -> int:
        """Start the suffix index afresh on every engine: the log's records, the archive and every
        replica dropped, the policy version kept. What an index without history across steps
        drafts from at the start of a step (the ablation of drafting from earlier steps' rollouts);
        for a job, a reset when the prompts change meaning (a new task set). Returns the records
        the replicas held."""
        return asyncio.run(self.shipper.forget())

    def save_state(self, directory) -> Any:
        """The pool's state beside a training checkpoint (:mod:`.checkpoint`)."""
        from .checkpoint import save_pool_state

        return save_pool_state(self, directory)

    def load_state(self, directory) -> dict[str, Any]:
        """Restore a saved state before the first batch (:mod:`.checkpoint`)."""
        from .checkpoint import load_pool_state

        got = load_pool_state(self, directory)
        self._restored = True
        return got

    async def _install_recovered(self) -> None:
        """Put engines the supervisor brought back into service (on the pool's loop): after a
        restart the dispatcher forgets its model of the caches; the index replica re-attaches."""
        if not self.supervisor.has_recovered:
            return
        for engine, restarted in self.supervisor.take_recovered():
            if restarted:
                self.router.engine_restarted(engine.index)
            await self.shipper.attach(engine)

    async def _background(self, bar, tokens0: int, t0: float) -> None:
        """Every ``log_sync_interval_s``: ship the log (and read KV events); every
        ``load_interval_s``: the engines' loads for the dispatcher (queue, KV, step cost); every
        ``stats_interval_s``: the engines' reports, and the progress bar."""
        async def log_loop() -> None:
            while True:
                await asyncio.sleep(self.config.log_sync_interval_s)
                await self.shipper.sync_in_background()
                if self.config.kv_events:
                    await self.router.poll_kv_events()

        async def load_loop() -> None:
            while True:
                await asyncio.sleep(self.config.load_interval_s)
                try:
                    await asyncio.gather(*(e.refresh_load(self.config.load_interval_s) for e in self.engines))
                except Exception:  # noqa: BLE001 - reported; the dispatcher keeps the last reports
                    self._stats_errors += 1
                    log.exception("engine load poll failed (the dispatcher keeps the last reports)")

        async def stats_loop() -> None:
            while True:
                await asyncio.sleep(self.config.stats_interval_s)
                try:
                    await self.engine_stats()
                except Exception:  # noqa: BLE001 - reported; the dispatcher keeps the last reports
                    self._stats_errors += 1
                    log.exception("engine stats poll failed (the dispatcher keeps the last reports)")
                    continue
                if bar is not None:
                    spec = self.speculating_fraction()
                    rate = (self.router.tokens_generated - tokens0) / max(time.perf_counter() - t0, 1e-9)
                    bar.set_postfix({"tok/s": f"{rate:.0f}",
                                     "spec": "n/a" if spec is None else f"{spec:.0%}"}, refresh=True)

        loops = [log_loop(), stats_loop()]
        if self.config.load_interval_s > 0:
            loops.append(load_loop())
        await asyncio.gather(*loops)

    @property
    def background_errors(self) -> int:
        """Failures of the log-sync, KV-event and stats loops (each logged)."""
        return self.shipper.errors + self.router.kv_event_errors + self._stats_errors

    # ------------------------------------------------------------------ batches
    async def _run_batch(self, prompts: Sequence[str], labels: Sequence[Any] | None = None, *,
                         n_samples_per_prompt: int | None = None) -> BatchResult:
        labels = list(labels) if labels is not None else [None] * len(prompts)
        if len(labels) != len(prompts):
            raise ValueError(f"labels: {len(labels)} labels for {len(prompts)} prompts")
        n = n_samples_per_prompt or self.config.n_samples_per_prompt
        if not prompts:
            raise ValueError("prompts: empty batch")
        if self.config.agent_runner == "thread":
            make_room_for_agent_threads(len(prompts) * n)
        b = self._batch_index
        self._batch_index += 1
        self.router.start_batch()
        for e in self.engines:
            e.peak_kv_usage = 0.0
        recovered0 = self.supervisor.recovered_total
        await self._install_recovered()
        await self.shipper.attach_all(await self.engine_stats())  # the stats also give the dispatcher KV capacities
        if self._restored:  # a resumed job's index records: in every replica before the first turn
            await self.shipper.sync(flush=True)
            self._restored = False
        if self.config.kv_events:
            await self.router.poll_kv_events()  # what changed in the caches between batches
        await asyncio.gather(*(e.open_channel() for e in self.engines))  # on an idle loop, before any turn
        self._episode_retries = 0
        turns0 = [e.turns for e in self.engines]
        t0 = time.perf_counter()
        tokens0 = self.router.tokens_generated
        bar = None
        if self.config.progress:
            from tqdm import tqdm

            bar = tqdm(total=len(prompts) * n, desc="rollout episodes", unit="ep")

        limiter = asyncio.Semaphore(self.config.max_agent_calls_in_flight)

        hosted = HostedEpisodes(self, t0) if self.config.episode_host == "engine" else None

        async def one(p: int, s: int) -> Trajectory:
            tid = f"b{b}-p{p}-s{s}"
            for attempt in range(self.config.engine_retries + 1):
                run_id = tid if not attempt else f"{tid}-r{attempt}"
                if hosted is not None:
                    traj = await hosted.run(prompts[p], labels[p], run_id, f"b{b}-p{p}", s)
                else:
                    traj = await run_episode(self, self.agent_cls, self.tokenizer, self.config, prompt=prompts[p],
                                             label=labels[p], trajectory_id=run_id, group_id=f"b{b}-p{p}", t0=t0,
                                             limiter=limiter, sample_index=s)
                self.router.trajectory_finished(traj.trajectory_id, traj.group_id, len(traj.turns))
                # an engine or environment failure is retried from the start (on whichever engine the
                # dispatcher picks); an agent file's contract error would fail again: not retried
                if traj.end_reason not in ("engine_error", "episode_error") or not self.supervisor.any_healthy():
                    break
                self._episode_retries += 1
            if attempt:
                traj.extra_logs["episode_retries"] = float(attempt)
            await self.router.notify()  # a finished trajectory frees room for deferred ones
            if bar is not None:
                bar.update(1)
            return traj

        background = asyncio.get_running_loop().create_task(self._background(bar, tokens0, t0))
        try:
            trajs = await asyncio.gather(*(one(p, s) for p in range(len(prompts)) for s in range(n)))
        finally:
            background.cancel()
            if bar is not None:
                bar.close()
            for e in self.engines:  # bound to this batch's event loop
                e.close_channel()
        wall = time.perf_counter() - t0
        await self.shipper.sync(flush=True)
        engine_stats = await self.engine_stats()
        reasons: dict[str, int] = {}
        for t in trajs:
            reasons[t.end_reason] = reasons.get(t.end_reason, 0) + 1
        return BatchResult(
            trajectories=list(trajs), wall_s=wall,
            generated_tokens=sum(t.generated_tokens for t in trajs),
            turns=sum(len(t.turns) for t in trajs),
            prompt_tokens=sum(r.prompt_tokens for t in trajs for r in t.turns),
            cached_tokens=sum(r.cached_tokens for t in trajs for r in t.turns),
            redispatched_turns=self.router.redispatched, deferrals=self.router.deferrals,
            episode_retries=self._episode_retries, deferred_wait_s=self.router.deferred_wait_s,
            engines_recovered=self.supervisor.recovered_total - recovered0,
            engine_turns=[e.turns - t for e, t in zip(self.engines, turns0)], engine_stats=engine_stats, end_reasons=reasons)

    async def warm_up_async(self, prompt: str, label: Any = None) -> float:
        """Run one episode of ``prompt`` per engine and forget it; returns the seconds it took.

        An engine's first rollout costs seconds more than later ones (on CPU: 4 s of a
        5.5 s first step of 16 short episodes on 2 engines, against 1.3 s for the next:
        first requests through the drafter, index replica and sampler), which would land in
        the first training step's generation time. The episodes' records stay in the index
        (samples of the current weights), the dispatcher forgets its cache model, and the
        engines' prefix caches are emptied."""
        t0 = time.perf_counter()
        settings, self.config = self.config, replace(self.config, progress=False)  # settings are frozen
        try:
            await self.run_batch_async([prompt], [label], n_samples_per_prompt=len(self.engines))
        finally:
            self.config = settings
        await asyncio.gather(*(e.reset_prefix_cache() for e in self.engines if e.healthy))
        self.policy.on_prefix_cache_reset()
        return time.perf_counter() - t0

    def run_batch(self, prompts: Sequence[str], labels: Sequence[Any] | None = None, *,
                  n_samples_per_prompt: int | None = None) -> BatchResult:
        """Synchronous wrapper (one event loop per call)."""
        return asyncio.run(self.run_batch_async(prompts, labels, n_samples_per_prompt=n_samples_per_prompt))

    async def run_batch_async(self, prompts: Sequence[str], labels: Sequence[Any] | None = None, *,
                              n_samples_per_prompt: int | None = None) -> BatchResult:
        """Run ``n_samples_per_prompt`` episodes of every prompt (one GRPO group per prompt), all at
        once; the process's heap from before the batch is left out of garbage collections while it
        runs (``freeze_heap``, :mod:`.gc_heap`)."""
        with frozen_heap(self.config.freeze_heap):
            return await self._run_batch(prompts, labels, n_samples_per_prompt=n_samples_per_prompt)


class HostedEpisodes:
    """One batch's episodes run beside their engines (``episode_host: engine``,
    :mod:`.episode_host`): the pool places each (its dispatcher's admission and placement of the
    first turn, on the prompt's tokens), sends it whole, and takes what it learnt when it returns."""

    def __init__(self, pool: RolloutPool, t0: float) -> None:
        import hashlib
        import json

        self.pool = pool
        self.t0 = t0
        self.config = pool.config.as_dict()
        digest = hashlib.sha1(json.dumps(self.config, sort_keys=True, default=str).encode()).hexdigest()[:16]
        self.key = f"{pool.pool_id}-{digest}"  # the engines parse these settings once
        self._prompt_tokens: dict[str, np.ndarray] = {}

    def _context(self, prompt: str) -> np.ndarray:
        ids = self._prompt_tokens.get(prompt)
        if ids is None:  # a GRPO group's samples share it
            ids = self._prompt_tokens[prompt] = np.asarray(
                self.pool.tokenizer(text=prompt, add_special_tokens=False)["input_ids"], dtype=np.int32)
        return ids

    async def run(self, prompt: str, label: Any, trajectory_id: str, group_id: str, sample_index: int) -> Trajectory:
        """The episode, never raising: a placement or engine failure is an ``engine_error``."""
        from ..dispatch.base import TurnRequest
        from .episode_host import trajectory_from_wire

        pool, router = self.pool, self.pool.router
        start = time.perf_counter()
        eid = None
        try:
            request = TurnRequest(trajectory_id, group_id, self._context(prompt), 0, 0, arrival_s=time.monotonic())
            eid, _ = await router.choose(request)
            eng = router.engines[eid]
            eng.in_flight += 1  # the engine's live trajectory, running or on its tool, until it returns
            sent = time.perf_counter()
            try:
                wire = await eng.host_episode(self.key, self.config, prompt, label, trajectory_id, group_id,
                                              sample_index, check_every_s=min(pool.config.turn_timeout_s, 30.0))
            finally:
                eng.in_flight -= 1
            traj = trajectory_from_wire(wire, prompt, label, engine=eid, time_offset_s=sent - self.t0)
        except Exception as exc:  # noqa: BLE001 - the episode's failure, retried by the batch
            where = "" if eid is None else f"engine {eid}: "
            traj = Trajectory(trajectory_id=trajectory_id, group_id=group_id, prompt=prompt, label=label,
                              end_reason="engine_error", error=f"{where}{type(exc).__name__}: {exc}"[:2000])
            traj.wall_s = time.perf_counter() - start
        else:
            router.hosted_episode_finished(traj, eid)
        traj.finished_s = time.perf_counter() - self.t0
        return traj


def _build_policy(config: RolloutConfig, num_engines: int) -> DispatchPolicy:
    try:
        return make_policy(config.dispatch_policy, num_engines, **config.dispatch_kwargs)
    except ValueError as exc:
        raise ValueError(f"RolloutConfig.dispatch_kwargs: {exc}") from None
