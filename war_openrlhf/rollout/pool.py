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
* **faults**: an engine call that fails because the actor died, or a turn unanswered within
  ``turn_timeout_s``, marks the engine unhealthy and re-dispatches the turn (up to
  ``engine_retries`` times) to a healthy engine; a background thread then probes it and, per
  ``engine_recovery``, brings it back when it answers again or restarts its actor; a tool error,
  a timeout, an over-long context or a broken environment ends or annotates only its own
  episode (:mod:`.episode`). Every episode returns a :class:`~.trajectory.Trajectory`.

The pool also accepts engines it did not start (``RolloutPool(config, engines=[...])``): Ray
actor handles or in-process :class:`~war_openrlhf.engine.WarEngine` objects.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import numpy as np

from ..dispatch import DEFER, DispatchPolicy, EngineState, TurnRequest, make_policy
from ..dispatch.kv_events import KvEventTranslator
from ..engine.stats import EngineStats
from ..speculation import CompletedSequence, CompletedSequenceLog
from .agents import load_agent_class
from .config import RolloutConfig
from .engine_client import ENGINE_METHODS, EngineClient, EngineDead, EngineHandle, actor_died
from .episode import run_episode
from .trajectory import Trajectory

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
                 agent_cls: type | None = None, policy: DispatchPolicy | None = None) -> None:
        if not engines:
            raise ValueError("engines: a pool needs at least one engine")
        for i, handle in enumerate(engines):
            if not isinstance(handle, EngineHandle):
                missing = [m for m in ENGINE_METHODS if not hasattr(handle, m)]
                raise ValueError(f"engines[{i}]: a {type(handle).__name__} is not an engine (no "
                                 f"{', '.join(missing)}); pass WarEngine objects or their Ray actor handles")
        self.config = config
        self.engines = [EngineClient(i, h) for i, h in enumerate(engines)]
        if policy is None:
            try:
                policy = make_policy(config.dispatch_policy, len(self.engines), **config.dispatch_kwargs)
            except ValueError as exc:
                raise ValueError(f"RolloutConfig.dispatch_kwargs: {exc}") from exc
        self.policy = policy
        if agent_cls is None:
            if not config.agent_func_path:
                raise ValueError("RolloutConfig.agent_func_path: no environment given; pass an OpenRLHF "
                                 "agent file (see examples/)")
            agent_cls = load_agent_class(config.agent_func_path)
        self.agent_cls = agent_cls
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(config.engine.model)
        self.tokenizer = tokenizer
        self.log = CompletedSequenceLog()
        self.policy_version = 0
        self._parked: dict[str, int] = {}
        self._turn_done: asyncio.Condition | None = None
        self._batch_index = 0
        self._redispatched = 0
        self._deferrals = 0
        self._episode_retries = 0
        self._deferred_wait_s = 0.0
        self._tokens_generated = 0
        self._started_handles = False
        self._background_errors = 0  # failures of the log-sync and stats loops (logged)
        self.pool_id = f"pool-{uuid.uuid4().hex[:12]}"  # owner of the engines' index replicas
        # engine recovery (engine_recovery): a thread per dead-marked engine probes or restarts it
        # and posts the engine's handle here; the pool's own loop puts it back in service
        self._launcher = None  # set by start(): the pool can restart the engines it started
        self._recovery_lock = threading.Lock()
        self._recovering: set[int] = set()
        self._recovered: dict[int, tuple[Any, bool]] = {}
        self._closed = threading.Event()
        self._engines_recovered = 0
        self._kv_translators: dict[int, KvEventTranslator] = {}  # engine -> its events' block hashes
        for e in self.engines:
            e.on_dead = self._engine_died

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def start(cls, config: RolloutConfig, **kwargs: Any) -> "RolloutPool":
        """Start the engine actors (Ray must be initialised) and build the pool."""
        from ..engine.actors import EngineLauncher, stop_engines

        if kwargs.get("policy") is None:  # built (its options checked) before any engine starts
            try:
                kwargs["policy"] = make_policy(config.dispatch_policy, config.num_engines, **config.dispatch_kwargs)
            except ValueError as exc:
                raise ValueError(f"RolloutConfig.dispatch_kwargs: {exc}") from None
        launcher = EngineLauncher(config.num_engines, config.engine, placement_group=True)
        handles = launcher.start_all()
        try:
            pool = cls(config, handles, **kwargs)
        except BaseException:  # engines started for a pool that failed to build: stop them
            stop_engines(handles)
            raise
        pool._started_handles = True
        pool._launcher = launcher
        return pool

    def shutdown(self) -> None:
        self._closed.set()  # recovery threads stop probing
        if not self._started_handles:
            return
        import ray

        with self._recovery_lock:  # restarted actors not yet put in service
            for handle, restarted in self._recovered.values():
                if restarted:
                    try:
                        ray.kill(handle)
                    except Exception:  # noqa: BLE001 - already gone
                        pass
            self._recovered.clear()

        for e in self.engines:
            if e.healthy:
                try:
                    ray.get(e.handle.shutdown.remote(), timeout=30)
                except Exception:
                    pass
            try:
                ray.kill(e.handle)
            except Exception:
                pass

    # ------------------------------------------------------------------ TurnService
    def park(self, trajectory_id: str, engine: int) -> None:
        if trajectory_id not in self._parked:
            self._parked[trajectory_id] = engine
            self.engines[engine].parked += 1

    def unpark(self, trajectory_id: str) -> None:
        engine = self._parked.pop(trajectory_id, None)
        if engine is not None:
            self.engines[engine].parked -= 1

    async def _notify(self) -> None:
        async with self._turn_done:
            self._turn_done.notify_all()

    async def generate_turn(self, trajectory_id: str, group_id: str, context: Sequence[int],
                            sampling_params: dict[str, Any], turn_index: int,
                            tokens_so_far: int) -> dict[str, Any]:
        ctx = np.asarray(context, dtype=np.int32)  # one array for the dispatcher, the log and the wire
        request = TurnRequest(trajectory_id, group_id, ctx, turn_index, tokens_so_far,
                              arrival_s=time.monotonic())
        attempts = 0
        while True:
            if self._recovered:
                await self._install_recovered()
            states = [e.state() for e in self.engines]
            estimates = self._cache_estimates(ctx, states) if self.config.record_cache_estimates else None
            eid = self.policy.choose(request, states)  # NoHealthyEngineError when all died
            if eid == DEFER:
                self._deferrals += 1
                waited = time.perf_counter()
                async with self._turn_done:
                    await self._turn_done.wait()
                self._deferred_wait_s += time.perf_counter() - waited
                continue
            eng = self.engines[eid]
            budget = int(sampling_params.get("max_tokens", 0))
            batch = eng.in_flight
            t_sent = time.perf_counter()
            eng.in_flight += 1
            eng.queued_tokens += budget
            attempts += 1
            try:
                out = await eng.generate_tokens(ctx.tolist(), sampling_params, trajectory_id, group_id,
                                                timeout_s=self.config.turn_timeout_s)
            except EngineDead:
                if attempts > self.config.engine_retries:
                    raise
                self._redispatched += 1
                continue
            finally:
                eng.in_flight -= 1
                eng.queued_tokens -= budget
            out["engine"] = eid
            out["attempts"] = attempts
            if estimates is not None:
                out["estimated_cached_tokens"] = estimates.get(eid)
            eng.turns += 1
            self._tokens_generated += len(out["token_ids"])
            response = np.asarray(out["token_ids"], dtype=np.int32)
            self.policy.on_turn_finished(request, eid, response)
            self.policy.observe_turn(eid, prompt_tokens=len(ctx),
                                     cached_tokens=int(out.get("num_cached_tokens", 0)),
                                     response_tokens=len(response),
                                     latency_s=time.perf_counter() - t_sent, batch=batch,
                                     trajectory_id=trajectory_id)
            versions = out.get("weight_versions")
            if versions and max(versions) > self.policy_version:  # the engines' weights moved on
                self.advance_policy_version(int(max(versions)))
            # the record ages from the oldest weights that produced any of its tokens
            version = int(min(versions)) if versions else self.policy_version
            self.log.append(CompletedSequence.create(trajectory_id, group_id, version, ctx, response))
            await self._notify()
            return out

    def _cache_estimates(self, ctx: np.ndarray, states: Sequence[EngineState]) -> dict[int, int] | None:
        """The dispatcher's estimate of each healthy engine's cached prefix of ``ctx`` before it
        chooses (choosing updates its model), capped as vLLM caps a hit: whole blocks of all but
        the last prompt token. None for policies that keep no model of the caches."""
        from ..dispatch.block_index import whole_blocks

        out = {}
        for s in states:
            if s.healthy:
                est = self.policy.estimated_cached_tokens(s.engine_id, ctx)
                if est is None:
                    return None
                out[s.engine_id] = min(int(est), whole_blocks(max(len(ctx) - 1, 0), s.kv_block_size))
        return out

    # ------------------------------------------------------------------ engine recovery
    def _engine_died(self, engine: EngineClient) -> None:
        """An engine was marked dead (its actor died, or a turn went unanswered): unless
        ``engine_recovery`` is off, a background thread probes it and restarts it if asked.
        Only Ray actors are recovered (an in-process engine dies with its process)."""
        if self.config.engine_recovery == "off" or not engine.remote or self._closed.is_set():
            return
        with self._recovery_lock:
            if engine.index in self._recovering:
                return
            self._recovering.add(engine.index)
        threading.Thread(target=self._recover, args=(engine.index, engine.handle), daemon=True,
                         name=f"war-recover-engine{engine.index}").start()

    def _recover(self, index: int, handle: Any) -> None:
        """Runs on its own thread (batches come and go on short-lived event loops; a restart
        takes longer than a batch). Probes the engine's ``stats``: an answer with the current
        weights means it was hung and is back; otherwise, with ``engine_recovery: restart`` on a
        pool that started its engines and whose weights are still the model file's, its actor
        is replaced. Retries every ``recovery_probe_interval_s`` until it succeeds, the actor is
        gone for good, or the pool shuts down."""
        import ray

        restart = self.config.engine_recovery == "restart" and self._launcher is not None
        probe_s = min(self.config.turn_timeout_s, 30.0)
        try:
            while not self._closed.is_set():
                wire, gone = None, False
                try:
                    wire = ray.get(handle.stats.remote(), timeout=probe_s)
                except Exception as exc:  # noqa: BLE001 - hung (timeout) or gone (actor died)
                    gone = actor_died(exc)
                if wire is not None and int(wire.get("weight_version", 0)) >= self.policy_version:
                    self._post_recovered(index, handle, restarted=False)
                    return
                if restart and self.policy_version == 0:
                    try:
                        new = self._launcher.restart(index, handle)
                    except Exception as exc:  # noqa: BLE001 - retried after the interval
                        log.warning("engine %d: restart failed (%s); retrying in %g s", index, exc,
                                    self.config.recovery_probe_interval_s)
                    else:
                        if self._closed.is_set():  # the pool shut down meanwhile: no orphan actor
                            from ..engine.actors import stop_engines

                            stop_engines([new])
                            return
                        self._post_recovered(index, new, restarted=True)
                        return
                elif gone or wire is not None:  # gone, or answering with weights a sync moved past
                    why = ("its actor is gone" if gone else
                           f"it answers with weights {wire.get('weight_version')} < {self.policy_version}")
                    hint = ("a new actor would roll out the model file's weights, not the trained ones"
                            if restart else "engine_recovery: restart starts a new actor in pools that started their engines")
                    log.warning("engine %d stays out of service: %s (%s)", index, why, hint)
                    return
                self._closed.wait(self.config.recovery_probe_interval_s)
        finally:
            with self._recovery_lock:
                self._recovering.discard(index)

    def _post_recovered(self, index: int, handle: Any, restarted: bool) -> None:
        with self._recovery_lock:
            self._recovered[index] = (handle, restarted)

    async def _install_recovered(self) -> None:
        """Put engines the recovery threads brought back into service (on the pool's loop):
        healthy again, index replica re-attached to this pool's log; after a restart the
        dispatcher forgets its model of the caches (the new engine's is empty)."""
        with self._recovery_lock:
            items = list(self._recovered.items())
            self._recovered.clear()
        for index, (handle, restarted) in items:
            e = self.engines[index]
            e.revive(handle)
            if restarted:
                self.policy.on_prefix_cache_reset()
                self._kv_translators.pop(index, None)  # a new engine: its blocks start afresh
            if self.config.engine.speculation != "vllm_suffix":
                try:
                    await e.reset_index(self.pool_id, self.log.first_seq - 1)
                except EngineDead:
                    continue
                e.log_sent = self.log.first_seq - 1
            self._engines_recovered += 1
            log.warning("engine %d %s: back in service", index, "restarted" if restarted else "answers again")

    # ------------------------------------------------------------------ index sync & stats
    async def sync_log(self, flush: bool = False) -> None:
        """Ship log entries each healthy engine has not seen yet; truncate what all have.
        ``flush``: also make every replica apply them now (end of a batch), instead of within
        the engine's lag bound. A dead engine is marked so and skipped; an engine that refuses
        the entries (its index was reset by another client) is counted in ``sync_errors`` and
        re-attached at the next batch: drafting is lost there meanwhile, rollouts are not."""
        last = self.log.last_seq
        for e in self.engines:
            if not e.healthy or e.log_sent >= last or e.last_sync_error:
                continue
            entries = self.log.read(e.log_sent)
            try:
                await e.push_log(entries)
                e.log_sent = entries[-1].seq if entries else e.log_sent
            except EngineDead:
                pass
            except Exception as exc:  # noqa: BLE001 - reported, and repaired at the next batch
                e.sync_failed(exc)
        if flush:
            for e in self.engines:
                if e.healthy and not e.last_sync_error:
                    try:
                        await e.flush_log()
                    except EngineDead:
                        pass
                    except Exception as exc:  # noqa: BLE001
                        e.sync_failed(exc)
        alive = [e.log_sent for e in self.engines if e.healthy and not e.last_sync_error]
        if alive and min(alive) > self.log.first_seq:
            self.log.truncate(min(alive))

    async def _attach_indexes(self, stats: Sequence[EngineStats]) -> None:
        """Make every healthy engine's replica follow this pool's log: engines never attached,
        taken over by another pool since (``index_owner`` in ``stats``), or that refused entries
        start afresh at the log's first retained entry."""
        if self.config.engine.speculation == "vllm_suffix":
            return
        for e, stats in zip(self.engines, stats):
            if not e.healthy or (stats.index_owner == self.pool_id and not e.last_sync_error):
                continue
            try:
                await e.reset_index(self.pool_id, self.log.first_seq - 1)
            except EngineDead:
                continue
            e.log_sent = self.log.first_seq - 1
            e.last_sync_error = None

    async def _sync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.log_sync_interval_s)
            try:
                await self.sync_log()
            except Exception:  # noqa: BLE001 - reported; drafting degrades, rollouts go on
                self._background_errors += 1
                log.exception("index log sync failed (rollouts go on; drafting may lag)")
            if self.config.kv_events:
                await self.poll_kv_events()

    async def poll_kv_events(self) -> None:
        """Hand each healthy engine's KV-cache events since the last poll to the dispatcher
        (``kv_events``), every ``log_sync_interval_s``: one caller per engine, so they arrive
        in order. A failed poll loses nothing the next one would not bring (the engine keeps
        them) except on a dead engine, whose model the dispatcher no longer uses."""
        for e in self.engines:
            if not e.healthy:
                continue
            try:
                events = await e.kv_events()
            except EngineDead:
                continue
            except Exception:  # noqa: BLE001 - reported; the model keeps its own guess
                self._background_errors += 1
                log.exception("KV events from engine %d could not be read", e.index)
                continue
            if events:
                translator = self._kv_translators.setdefault(e.index, KvEventTranslator())
                self.policy.on_kv_events(e.index, translator.translate(events))

    async def engine_stats(self) -> list[EngineStats]:
        """Every engine's report (the last one for an engine that died, with ``healthy`` False)."""
        return [await e.stats() for e in self.engines]

    def speculating_fraction(self) -> float | None:
        fr = [e.last_stats.spec_step_fraction for e in self.engines if e.healthy]
        fr = [f for f in fr if f is not None]
        return float(np.mean(fr)) if fr else None

    async def _stats_loop(self, bar, tokens0: int, t0: float) -> None:
        while True:
            await asyncio.sleep(self.config.stats_interval_s)
            try:
                await self.engine_stats()
            except Exception:  # noqa: BLE001 - reported; the dispatcher keeps the last reports
                self._background_errors += 1
                log.exception("engine stats poll failed (the dispatcher keeps the last reports)")
                continue
            if bar is not None:
                spec = self.speculating_fraction()
                rate = (self._tokens_generated - tokens0) / max(time.perf_counter() - t0, 1e-9)
                bar.set_postfix({"tok/s": f"{rate:.0f}",
                                 "spec": "n/a" if spec is None else f"{spec:.0%}"}, refresh=True)

    def advance_policy_version(self, version: int | None = None) -> int:
        """New weights: later records carry the new version (the index can age out old ones).
        Called by the weight-sync hook (:func:`war_openrlhf.training.weight_sync_hook.after_weight_sync`
        returns the engines' version) and by the pool itself when a turn reports a newer one."""
        version = self.policy_version + 1 if version is None else int(version)
        if version <= self.policy_version:
            return self.policy_version
        self.policy_version = version
        self.log.advance_policy_version(self.policy_version)
        # a weight sync resets the engines' prefix caches: the dispatcher's model of them goes too
        self.policy.on_prefix_cache_reset()
        return self.policy_version

    # ------------------------------------------------------------------ batches
    async def run_batch_async(self, prompts: Sequence[str], labels: Sequence[Any] | None = None, *,
                              n_samples_per_prompt: int | None = None) -> BatchResult:
        labels = list(labels) if labels is not None else [None] * len(prompts)
        if len(labels) != len(prompts):
            raise ValueError(f"labels: {len(labels)} labels for {len(prompts)} prompts")
        n = n_samples_per_prompt or self.config.n_samples_per_prompt
        if not prompts:
            raise ValueError("prompts: empty batch")
        self._turn_done = asyncio.Condition()
        b = self._batch_index
        self._batch_index += 1
        self.policy.start_batch()
        for e in self.engines:
            e.peak_kv_usage = 0.0
        recovered0 = self._engines_recovered
        if self._recovered:
            await self._install_recovered()
        await self._attach_indexes(await self.engine_stats())  # the stats also give the dispatcher KV capacities
        if self.config.kv_events:
            await self.poll_kv_events()  # what changed in the caches between batches
        self._redispatched = self._deferrals = self._episode_retries = 0
        self._deferred_wait_s = 0.0
        turns0 = [e.turns for e in self.engines]
        t0 = time.perf_counter()
        tokens0 = self._tokens_generated
        bar = None
        if self.config.progress:
            from tqdm import tqdm

            bar = tqdm(total=len(prompts) * n, desc="rollout episodes", unit="ep")

        limiter = asyncio.Semaphore(self.config.max_agent_calls_in_flight)

        async def one(p: int, s: int) -> Trajectory:
            tid = f"b{b}-p{p}-s{s}"
            for attempt in range(self.config.engine_retries + 1):
                traj = await run_episode(self, self.agent_cls, self.tokenizer, self.config, prompt=prompts[p],
                                         label=labels[p], trajectory_id=tid if not attempt else f"{tid}-r{attempt}",
                                         group_id=f"b{b}-p{p}", t0=t0, limiter=limiter)
                self.policy.on_trajectory_finished(traj.trajectory_id)
                # an engine or environment failure is retried from the start (on whichever engine the
                # dispatcher picks); an agent file's contract error would fail again: not retried
                if traj.end_reason not in ("engine_error", "episode_error") or not any(e.healthy for e in self.engines):
                    break
                self._episode_retries += 1
            if attempt:
                traj.extra_logs["episode_retries"] = float(attempt)
            await self._notify()  # a finished trajectory frees room for deferred ones
            if bar is not None:
                bar.update(1)
            return traj

        sync = asyncio.get_running_loop().create_task(self._sync_loop())
        stats = asyncio.get_running_loop().create_task(self._stats_loop(bar, tokens0, t0))
        try:
            trajs = await asyncio.gather(*(one(p, s) for p in range(len(prompts)) for s in range(n)))
        finally:
            sync.cancel()
            stats.cancel()
            if bar is not None:
                bar.close()
        wall = time.perf_counter() - t0
        await self.sync_log(flush=True)
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
            redispatched_turns=self._redispatched, deferrals=self._deferrals, episode_retries=self._episode_retries,
            deferred_wait_s=self._deferred_wait_s, engines_recovered=self._engines_recovered - recovered0,
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
