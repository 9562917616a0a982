"""Turn routing: each turn to the engine the dispatch policy names, from the pool's own snapshot.

The pool is every engine's only client, so the snapshot the policy reads (requests in flight and
their token budget, trajectories parked on a tool per engine, KV capacity, health) is kept here
rather than asked of the engines each turn. A policy may answer ``DEFER`` for a first turn
(KV-aware admission): the turn waits until some turn or trajectory finishes. A turn whose engine
dies or hangs (:class:`~.engine_client.EngineDead`) is sent again, to a healthy engine, up to
``engine_retries`` times. Every finished turn is told to the policy (what it generated, how long
it took) and handed to the :class:`~.log_shipper.LogShipper` for the global index.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Sequence

import numpy as np

from ..dispatch import DEFER, DispatchPolicy, EngineState, TurnRequest
from ..dispatch.kv_events import KvEventTranslator
from ..dispatch.turn_priority import TurnPriorities
from .config import RolloutConfig
from .engine_client import EngineClient, EngineDead
from .log_shipper import LogShipper
from .turn_result import TurnResult

__all__ = ["TurnRouter"]

log = logging.getLogger(__name__)


class TurnRouter:
    """The pool's ``TurnService``: dispatch, parking, deferral, and what the policy learns."""

    def __init__(self, config: RolloutConfig, engines: Sequence[EngineClient], policy: DispatchPolicy,
                 shipper: LogShipper) -> None:
        self.config = config
        self.engines = list(engines)
        self.policy = policy
        self.shipper = shipper
        self.on_newer_weights: Any = None  # called with a version a turn reports above the pool's
        self.before_dispatch: Any = None  # awaited before each dispatch (the pool installs recovered engines)
        self._parked: dict[str, int] = {}
        # first turns the policy deferred: (arrival number, request, future set when room may exist)
        self._deferred: list[tuple[int, TurnRequest, asyncio.Future]] = []
        self._deferred_seq = 0
        self._kv_translators: dict[int, KvEventTranslator] = {}  # engine -> its events' block hashes
        self.tokens_generated = 0
        self.kv_event_errors = 0
        self.priorities = TurnPriorities() if config.turn_priority == "longest_first" else None
        self.reset_counters()

    def reset_counters(self) -> None:
        """Per-batch counters: turns sent again, deferrals and the seconds deferred turns waited."""
        self.redispatched = 0
        self.deferrals = 0
        self.deferred_wait_s = 0.0

    def start_batch(self) -> None:
        """A new event loop runs the batch: its condition, and the policy's per-batch state."""
        self._deferred = []
        self.policy.start_batch()
        if self.priorities is not None:
            self.priorities.start_batch()
        self.reset_counters()

    def trajectory_finished(self, trajectory_id: str, group_id: str, turns: int) -> None:
        """A trajectory ended: the policy forgets it, the priorities learn its length."""
        self.policy.on_trajectory_finished(trajectory_id)
        if self.priorities is not None:
            self.priorities.finished(trajectory_id, group_id, turns)

    # ------------------------------------------------------------------ TurnService
    def park(self, trajectory_id: str, engine: int) -> None:
        if trajectory_id not in self._parked:
            self._parked[trajectory_id] = engine
            self.engines[engine].parked += 1

    def unpark(self, trajectory_id: str) -> None:
        engine = self._parked.pop(trajectory_id, None)
        if engine is not None:
            self.engines[engine].parked -= 1

    async def notify(self) -> None:
        """A turn or trajectory finished: deferred turns may find room now. They try again in
        the policy's admission order (highest ``admission_priority`` first, then arrival),
        each choosing before the next, so the first offered gets the room."""
        if not self._deferred:
            return
        waiting, self._deferred = self._deferred, []
        if self.policy.orders_admission:
            prio = self.policy.admission_priority
            waiting.sort(key=lambda w: (-prio(w[1]), w[0]))
        for _, _, fut in waiting:  # resumed in this order (the loop runs callbacks FIFO)
            if not fut.done():
                fut.set_result(None)

    async def generate_turn(self, trajectory_id: str, group_id: str, context: Sequence[int],
                            sampling_params: dict[str, Any], turn_index: int, tokens_so_far: int) -> TurnResult:
        ctx = np.asarray(context, dtype=np.int32)  # one array for the dispatcher, the log and the wire
        request = TurnRequest(trajectory_id, group_id, ctx, turn_index, tokens_so_far, arrival_s=time.monotonic())
        priority = (self.priorities.priority(trajectory_id, group_id, turn_index)
                    if self.priorities is not None else 0)
        attempts = 0
        while True:
            eid, estimates = await self.choose(request)
            eng = self.engines[eid]
            budget = int(sampling_params.get("max_tokens", 0))
            batch = eng.in_flight
            t_sent = time.perf_counter()
            eng.in_flight += 1
            eng.queued_tokens += budget
            attempts += 1
            try:
                answer = await eng.generate_tokens(ctx, sampling_params, trajectory_id, group_id,
                                                   timeout_s=self.config.turn_timeout_s, priority=priority)
            except EngineDead:
                if attempts > self.config.engine_retries:
                    raise
                self.redispatched += 1
                continue
            finally:
                eng.in_flight -= 1
                eng.queued_tokens -= budget
            result = TurnResult.from_engine(answer, engine=eid, prompt_tokens=len(ctx), attempts=attempts,
                                            estimated_cached_tokens=None if estimates is None else estimates.get(eid))
            self._finished(request, eid, result, latency_s=time.perf_counter() - t_sent, batch=batch)
            await self.notify()
            return result

    async def choose(self, request: TurnRequest) -> tuple[int, dict[int, int] | None]:
        """The engine the policy names for ``request`` (and, with ``record_cache_estimates``, its
        estimate of every engine's cached prefix before it chose); while the policy defers a first
        turn (KV-aware admission) the request waits for a turn or trajectory to finish. Raises
        ``NoHealthyEngineError`` when every engine died."""
        while True:
            if self.before_dispatch is not None:
                await self.before_dispatch()
            states = [e.dispatch_state() for e in self.engines]
            estimates = (self._cache_estimates(request.context_token_ids, states)
                         if self.config.record_cache_estimates else None)
            eid = self.policy.choose(request, states)
            if eid != DEFER:
                return eid, estimates
            self.deferrals += 1
            waited = time.perf_counter()
            room = asyncio.get_running_loop().create_future()
            self._deferred.append((self._deferred_seq, request, room))
            self._deferred_seq += 1
            await room
            self.deferred_wait_s += time.perf_counter() - waited

    def hosted_episode_finished(self, traj: Any, eid: int) -> None:
        """An episode that ran beside engine ``eid`` (``episode_host: engine``) came back: each of
        its turns goes to the global index, as a turn the pool dispatched does when it finishes,
        and its last turn tells the policy what that engine now holds (its context holds every
        earlier turn, so the policy's model of the caches ends where turn-by-turn calls would
        leave it). The policy's turn-cost fit learns nothing from them: their latencies were not
        measured at a batch size the pool knows."""
        tokens = np.asarray(traj.token_ids, dtype=np.int32)
        generated = 0
        request = response = None
        for rec in traj.turns:
            request = TurnRequest(traj.trajectory_id, traj.group_id, tokens[:rec.start], rec.index, generated)
            response = tokens[rec.start:rec.end]
            generated += len(response)
            self._record(request, rec.policy_versions, response)
        if request is not None:
            self.engines[eid].turns += len(traj.turns)
            self.tokens_generated += generated
            self.policy.on_turn_finished(request, eid, response)

    def _record(self, request: TurnRequest, versions: Sequence[int], response: np.ndarray) -> None:
        first, last = versions
        if last > self.shipper.policy_version and self.on_newer_weights is not None:  # the weights moved on
            self.on_newer_weights(last)
        # the record ages from the oldest weights that produced any of its tokens
        self.shipper.record(request.trajectory_id, request.group_id, first, request.context_token_ids, response)

    def _finished(self, request: TurnRequest, eid: int, result: TurnResult, *, latency_s: float, batch: int) -> None:
        """What a finished turn teaches the policy, and its record for the global index."""
        self.engines[eid].turns += 1
        self.tokens_generated += len(result.token_ids)
        response = np.asarray(result.token_ids, dtype=np.int32)
        self.policy.on_turn_finished(request, eid, response)
        self.policy.observe_turn(eid, prompt_tokens=len(request.context_token_ids), cached_tokens=result.num_cached_tokens,
                                 response_tokens=len(response), latency_s=latency_s, batch=batch,
                                 trajectory_id=request.trajectory_id)
        self._record(request, result.weight_versions, response)

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

    # ------------------------------------------------------------------ the policy's model of the caches
    def engine_restarted(self, index: int) -> None:
        """A new engine actor: its caches start empty."""
        self.policy.on_prefix_cache_reset()
        self._kv_translators.pop(index, None)

    async def poll_kv_events(self) -> None:
        """Hand each healthy engine's KV-cache events since the last poll to the policy
        (``kv_events``): one caller per engine, so they arrive in order. A failed poll loses
        nothing the next one would not bring (the engine keeps them) except on a dead engine,
        whose model the policy no longer uses."""
        for e in self.engines:
            if not e.healthy:
                continue
            try:
                events = await e.kv_events()
            except EngineDead:
                continue
            except Exception:  # noqa: BLE001 - reported; the model keeps its own guess
                self.kv_event_errors += 1
                log.exception("KV events from engine %d could not be read", e.index)
                continue
            if events:
                translator = self._kv_translators.setdefault(e.index, KvEventTranslator())
                self.policy.on_kv_events(e.index, translator.translate(events))
