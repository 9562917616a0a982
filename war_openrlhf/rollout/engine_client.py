"""The pool's client for one engine: typed calls, one dead-actor guard, the engine's load.

The pool is every engine's only client, so it keeps what the dispatcher needs (requests in
flight, their token budget, trajectories parked on a tool, KV capacity, health) here rather
than asking the engine each turn. An engine is a :class:`EngineHandle`: a
:class:`~war_openrlhf.engine.WarEngine` in this process or its Ray actor handle.

Turns to an engine actor travel on its turn channel (:mod:`war_openrlhf.engine.turn_channel`,
``RolloutConfig.turn_transport: direct``), every other call on Ray. A channel that closes under
a turn is a question for Ray: an actor that is gone is a dead engine (the turn is re-dispatched),
one that answers gets the turn over Ray and a new connection at the next turn.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any, Protocol, Sequence, runtime_checkable

import msgpack
import numpy as np

from ..dispatch import EngineState
from ..engine.stats import EngineStats
from ..engine.turn_channel import ChannelClosed, RemoteError, TurnChannelClient
from .deadline import within

log = logging.getLogger(__name__)

__all__ = ["ENGINE_METHODS", "EngineHandle", "EngineClient", "EngineDead", "actor_died", "kill_actor"]

#: The class an engine runs hosted episodes with (``WarEngine.host_episode``).
EPISODE_HOST = "war_openrlhf.rollout.episode_host:EpisodeHost"

#: KV capacity assumed until an engine reports its own.
UNKNOWN_KV_TOKENS = 1 << 40


@runtime_checkable
class EngineHandle(Protocol):
    """What the pool calls on an engine (``WarEngine``'s methods; on a Ray handle, ``.remote``)."""

    async def generate_tokens(self, prompt_token_ids: Sequence[int], sampling_params: Any = None,
                              request_id: str | None = None, trajectory_id: str | None = None,
                              group_id: str | None = None) -> dict[str, Any]: ...

    async def push_log(self, wire_entries: Any) -> int: ...

    async def flush_log(self) -> int: ...

    async def reset_index(self, owner: str | None = None, start_seq: int = 0) -> dict[str, Any]: ...

    async def stats(self) -> dict[str, Any]: ...

    # optional: ``load()`` (the dispatcher's queue, KV and step-cost feed; EngineClient.refresh_load)


#: The methods of :class:`EngineHandle` (for error messages).
ENGINE_METHODS = ("generate_tokens", "push_log", "flush_log", "reset_index", "stats")


class EngineDead(RuntimeError):
    """The engine's actor is gone; the client is marked unhealthy."""


#: errors (by class name, as they cross Ray) that say the actor lives but its vLLM engine died
_VLLM_DIED = ("EngineDeadError", "WorkerKilled")


def kill_actor(handle: Any) -> None:
    """End a Ray actor (already gone: nothing to do)."""
    import ray

    try:
        ray.kill(handle)
    except Exception:  # noqa: BLE001 - already gone
        pass


def actor_died(exc: BaseException) -> bool:
    """True if ``exc`` means the engine is gone (not a bad request): its actor died, or its vLLM
    engine inside a live actor did (a worker killed by a signal)."""
    if any(cls.__name__ in _VLLM_DIED for cls in type(exc).__mro__):
        return True
    if isinstance(exc, RemoteError):  # raised in the engine, carried by the turn channel
        return any(name in _VLLM_DIED for name in exc.class_names)
    try:
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
    except ImportError:  # pragma: no cover
        return False
    return isinstance(exc, (RayActorError, ActorDiedError, ActorUnavailableError))


def _retrieve(task: asyncio.Task) -> None:
    """Mark a finished task's outcome as read (its exception is then never logged at collection)."""
    if not task.cancelled():
        task.exception()


class EngineClient:
    """One engine as the pool sees it."""

    #: seconds a channel connection, and the liveness question after a lost one, may take
    CHANNEL_TIMEOUT_S = 10.0

    def __init__(self, index: int, handle: Any, *, turn_transport: str = "direct") -> None:
        self.index = index
        self.handle = handle
        self.remote = hasattr(handle, "generate_tokens") and hasattr(handle.generate_tokens, "remote")
        self.turn_transport = turn_transport
        self._channel: TurnChannelClient | None = None
        self._channel_address: dict[str, Any] | None = None
        self._channel_lock: tuple[Any, asyncio.Lock] | None = None  # (event loop, its lock)
        self.channel_off_reason: str | None = None  # why turns go over Ray although direct was asked
        self._channel_retry = False  # the channel timed out opening: tried again at the next batch
        self.channel_fallbacks = 0  # turns sent over Ray after their channel closed under them
        self.channel_turns = 0  # turns answered on the channel
        self.channel_calls = 0  # periodic calls (in-flight chunks, log pushes, load polls) answered on it
        self.healthy = True
        self.error: str | None = None
        self.in_flight = 0
        self.queued_tokens = 0
        self.parked = 0
        self.kv_capacity_tokens = UNKNOWN_KV_TOKENS
        self.kv_block_size = 16  # until the engine reports its own
        self.log_sent = 0
        self.has_war_index = True  # until its stats say it runs no WAR replica (speculation none / vllm_suffix)
        self.sync_errors = 0  # index log pushes the engine refused (not a dead actor)
        self.last_sync_error: str | None = None
        self.peak_kv_usage = 0.0  # highest KV-cache usage in a stats report this batch (the pool resets it)
        self.turns = 0
        self.last_stats = EngineStats(engine=index)
        self.load: dict[str, Any] = {}  # the engine's last load report (refresh_load): queue, KV, step cost
        # which of the engine's step regressions prices prefill: "computed" (prefilled tokens) or
        # "all_prompt" (vLLM's count with prefix-cached tokens: the meter before its fix, an ablation)
        self.step_cost_source = "computed"
        self.load_at = 0.0  # monotonic time of the last queue report (a poll or a turn's answer)
        self.step_cost_at = 0.0  # ... and of the last step-cost report (polls only)
        self._probe: asyncio.Task | None = None  # a liveness question in flight (_confirm_alive)
        self.on_dead: Any = None  # called once with this client when it is marked dead (the pool's recovery)

    # ------------------------------------------------------------------ calls
    async def _call(self, method: str, *args: Any) -> Any:
        """The one place an engine is called: a dead actor marks this client unhealthy and
        raises :class:`EngineDead`; any other error propagates unchanged."""
        fn = getattr(self.handle, method)
        try:
            # no task events: load polls, stats and log pushes run every interval of a long job,
            # and Ray's GCS keeps an event record of every task (up to its cap) for its dashboard
            return await (fn.options(enable_task_events=False).remote(*args) if self.remote else fn(*args))
        except Exception as exc:
            if not actor_died(exc):
                raise
            self.mark_dead(exc)
            raise EngineDead(f"engine {self.index}: {self.error}") from exc

    def _raise_if_died_inside(self, exc: RemoteError) -> None:
        """An error the channel carried back: when it says the engine's vLLM died inside its live
        actor, the engine is marked dead and :class:`EngineDead` raised; otherwise nothing."""
        if actor_died(exc):
            self.mark_dead(exc)
            raise EngineDead(f"engine {self.index}: {self.error}") from exc

    async def _hot_call(self, method: str, *args: Any) -> Any:
        """A call the pool makes every few tens of milliseconds while a batch runs (in-flight chunks,
        log pushes, load polls): on this loop's open turn channel when there is one (a socket frame,
        not a Ray task: tens of microseconds of CPU on each side instead of milliseconds), else
        over Ray. It never opens a channel (the pool opens them before a batch), and a channel that
        closed under it sends this call over Ray, which also tells whether the actor lives."""
        channel = self._channel
        if channel is not None and not channel.closed and channel.loop is asyncio.get_running_loop():
            try:
                result = await channel.call(method, *args)
                self.channel_calls += 1
                return result
            except RemoteError as exc:
                self._raise_if_died_inside(exc)
                raise
            except ChannelClosed:
                pass  # over Ray below: EngineDead if the actor is gone
        return await self._call(method, *args)

    async def generate_tokens(self, context: Sequence[int], sampling_params: dict[str, Any], trajectory_id: str,
                              group_id: str, timeout_s: float | None = None, priority: int = 0) -> dict[str, Any]:
        """One turn. ``timeout_s``: an engine that has not answered by then is hung; it is
        treated as dead (marked unhealthy, :class:`EngineDead` raised so the turn is re-dispatched)."""
        # an int32 array crosses Ray as one buffer; a list of a long context is pickled int by int
        ids = np.asarray(context, dtype=np.int32)

        async def turn() -> dict[str, Any]:
            channel = await self._turn_channel()  # inside the deadline: a hung engine cannot connect either
            if channel is not None:
                try:
                    fields = channel.encode(ids, sampling_params, trajectory_id, group_id, priority)
                except (TypeError, ValueError):  # kwargs msgpack cannot carry (an agent's object): over Ray
                    fields = None
                if fields is not None:
                    return await self._channel_turn(channel, fields, ids, sampling_params, trajectory_id, group_id,
                                                    priority)
            return await self._ray_turn(ids, sampling_params, trajectory_id, group_id, priority)

        if timeout_s is None:
            return self._took_load(await turn())
        try:
            return self._took_load(await within(turn(), timeout_s))
        except asyncio.TimeoutError:
            exc = TimeoutError(f"no answer to a turn within {timeout_s:g} s: treated as hung")
            self.mark_dead(exc)
            raise EngineDead(f"engine {self.index}: {self.error}") from None

    def _took_load(self, answer: dict[str, Any]) -> dict[str, Any]:
        """A turn's answer carries the engine's queue and KV (``load_now``): fresher than any poll."""
        now = answer.pop("load_now", None) if isinstance(answer, dict) else None
        if now:
            self.load = {**self.load, **now}
            self.load_at = time.monotonic()
        return answer

    def _ray_turn(self, ids: np.ndarray, sampling_params: dict[str, Any], trajectory_id: str, group_id: str,
                  priority: int):
        extra = (int(priority),) if priority else ()  # vLLM's request priority (engines with priority scheduling)
        return self._call("generate_tokens", ids, dict(sampling_params), None, trajectory_id, group_id, *extra)

    async def _channel_turn(self, channel: TurnChannelClient, fields: bytes, ids: np.ndarray,
                            sampling_params: dict[str, Any], trajectory_id: str, group_id: str,
                            priority: int) -> dict[str, Any]:
        try:
            answer = await channel.request(fields)
            self.channel_turns += 1
            return answer
        except RemoteError as exc:
            self._raise_if_died_inside(exc)
            raise
        except ChannelClosed as exc:
            await self._check_alive(exc)  # EngineDead when the actor is gone
            self.channel_fallbacks += 1
            return await self._ray_turn(ids, sampling_params, trajectory_id, group_id, priority)

    async def _check_alive(self, cause: BaseException) -> None:
        """After a lost channel: the actor answers Ray (returns) or is gone / silent (marked dead,
        :class:`EngineDead`)."""
        if not self.healthy:
            raise EngineDead(f"engine {self.index}: {self.error}") from cause
        if self.remote:
            # a blocking ray.get with a timeout, on a worker thread: an awaited call abandoned at its
            # deadline would leave Ray a callback onto this loop, which fires (and fails, logging a
            # traceback on Ray's thread) whenever the silent engine answers, maybe long after
            report, gone = await asyncio.to_thread(self.probe_stats, self.CHANNEL_TIMEOUT_S)
            if report is not None:
                return
            if gone:
                self.mark_dead(RuntimeError(f"{cause}; and the actor is gone"))
                raise EngineDead(f"engine {self.index}: {self.error}") from cause
            self.mark_dead(TimeoutError(f"{cause}; and no answer over Ray within {self.CHANNEL_TIMEOUT_S:g} s"))
            raise EngineDead(f"engine {self.index}: {self.error}") from cause
        try:
            await asyncio.wait_for(self._call("stats"), self.CHANNEL_TIMEOUT_S)
        except EngineDead:
            raise
        except asyncio.TimeoutError:
            self.mark_dead(TimeoutError(f"{cause}; and no answer within {self.CHANNEL_TIMEOUT_S:g} s"))
            raise EngineDead(f"engine {self.index}: {self.error}") from cause

    async def _turn_channel(self) -> TurnChannelClient | None:
        """This loop's connection to the engine's turn channel, opened at its first turn; None when
        turns go over Ray (``turn_transport: ray``, an in-process engine, an actor without a
        channel, or a channel that could not be opened: the reason is in ``channel_off_reason``)."""
        if self.turn_transport != "direct" or not self.remote or self.channel_off_reason is not None:
            return None
        loop = asyncio.get_running_loop()
        channel = self._channel
        if channel is not None and channel.loop is loop and not channel.closed:
            return channel
        if self._channel_lock is None or self._channel_lock[0] is not loop:
            self._channel_lock = (loop, asyncio.Lock())
        async with self._channel_lock[1]:
            channel = self._channel
            if channel is not None and channel.loop is loop and not channel.closed:
                return channel
            self.close_channel()
            if not hasattr(self.handle, "turn_channel"):
                self.channel_off_reason = f"{type(self.handle).__name__} serves no turn channel"
                return None
            try:
                if self._channel_address is None:  # the caller's turn deadline bounds a silent engine
                    self._channel_address = await self._call("turn_channel")
                self._channel = await TurnChannelClient.connect(self._channel_address, self.CHANNEL_TIMEOUT_S)
            except EngineDead:
                raise
            except Exception as exc:  # noqa: BLE001 - unreachable port, firewall: Ray carries the turns
                self.channel_off_reason = f"{type(exc).__name__}: {exc}"[:300]
                # a connection that only took too long (a loop busy with thousands of episodes) is
                # tried again at the next batch; a refused or unreachable one stays off
                self._channel_retry = isinstance(exc, asyncio.TimeoutError)
                log.warning("engine %d: no turn channel (%s); its turns go over Ray calls%s", self.index,
                            self.channel_off_reason, " until the next batch" if self._channel_retry else "")
                return None
            return self._channel

    async def open_channel(self) -> None:
        """Open this loop's turn channel now (the pool: before a batch's episodes start, while its
        loop is idle, so that thousands of first turns do not race the connection's deadline).
        A channel that timed out in an earlier batch is tried again; errors leave turns on Ray."""
        if self._channel_retry:
            self.channel_off_reason, self._channel_retry = None, False
        if self.healthy:
            try:
                await within(self._turn_channel(), self.CHANNEL_TIMEOUT_S)
            except (EngineDead, asyncio.TimeoutError):
                pass  # a silent engine: its first turn tries again within the turn's deadline

    def close_channel(self) -> None:
        """Close this engine's turn channel (the pool: at the end of a batch, whose event loop ends)."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    async def refresh_load(self, max_age_s: float | None = None) -> None:
        """Read the engine's load (``WarEngine.load``: its waiting queue, KV in use, measured
        step cost) for the dispatcher; a dead engine is marked so, an engine without the call
        (another actor kind) is left at its last report. ``max_age_s``: skip the call when a
        turn's answer brought the queue within that many seconds (and the step cost within ten
        times that)."""
        if not self.healthy or not hasattr(self.handle, "load"):
            return
        now = time.monotonic()
        cost_fresh = max_age_s is not None and now - self.step_cost_at < 10 * max_age_s
        if max_age_s is not None and now - self.load_at < max_age_s and cost_fresh:
            return  # turns keep the queue fresh; the step cost is read every tenth poll
        try:
            # the step cost (a fit in the engine) only when due; the queue and KV every poll
            ask = (not cost_fresh, True) if self.step_cost_source == "all_prompt" else (not cost_fresh,)
            report = await self._hot_call("load", *ask)  # the ablation's flag only when asked for
        except EngineDead:
            return
        if isinstance(report, dict):
            self.load = {**self.load, **report}
            self.load_at = time.monotonic()
            if not cost_fresh:
                self.step_cost_at = self.load_at

    async def host_episode(self, key: str, config: dict[str, Any], prompt: str, label: Any, trajectory_id: str,
                           group_id: str, sample_index: int, *, check_every_s: float) -> dict[str, Any]:
        """One whole episode beside this engine (``WarEngine.host_episode``); its trajectory as a
        dict. On this loop's turn channel when its arguments are msgpack-native, else over Ray.
        While it runs, the engine is asked every ``check_every_s`` whether it lives (one question
        per engine at a time, however many episodes it hosts): a dead or silent engine is marked
        dead and :class:`EngineDead` raised, so a frozen actor never holds the batch."""
        args = (EPISODE_HOST, key, config, prompt, label, trajectory_id, group_id, int(sample_index))
        loop = asyncio.get_running_loop()
        channel = self._channel
        work = None
        if channel is not None and not channel.closed and channel.loop is loop:
            try:
                msgpack.packb(label, use_bin_type=True)  # the rest is the pool's own: str and plain dicts
            except (TypeError, ValueError, OverflowError):
                pass  # an agent's label msgpack cannot carry: over Ray
            else:
                work = loop.create_task(channel.call("host_episode", *args))
        if work is None:
            work = loop.create_task(self._call("host_episode", *args))
        try:
            while True:
                done, _ = await asyncio.wait({work}, timeout=check_every_s)
                if done:
                    break
                await self._confirm_alive(TimeoutError(f"a hosted episode ran {check_every_s:g} s more"))
            return work.result()
        except RemoteError as exc:
            self._raise_if_died_inside(exc)
            raise
        except ChannelClosed as exc:
            await self._check_alive(exc)  # EngineDead when the actor is gone
            raise RuntimeError(f"engine {self.index}: the turn channel closed under a hosted episode "
                               "(the engine lives; the episode runs again)") from exc
        finally:
            # an episode given up (its engine dead) may still end in an error: read it, so that it
            # is not logged when the task is collected
            work.add_done_callback(_retrieve)
            if not work.done():
                work.cancel()

    async def _confirm_alive(self, cause: BaseException) -> None:
        """:meth:`_check_alive`, shared: one question in flight per engine and loop, answered for
        every caller waiting on it."""
        if not self.healthy:
            raise EngineDead(f"engine {self.index}: {self.error}") from cause
        loop = asyncio.get_running_loop()
        probe = self._probe
        if probe is None or probe.done() or probe.get_loop() is not loop:
            probe = self._probe = loop.create_task(self._check_alive(cause))
            probe.add_done_callback(_retrieve)  # its callers may all have stopped waiting
        await asyncio.shield(probe)

    async def kv_events(self) -> list:
        return await self._call("kv_events")

    async def inflight_chunks(self) -> list:
        return await self._hot_call("inflight_chunks")

    async def reset_prefix_cache(self) -> None:
        await self._call("reset_prefix_cache")

    async def push_log(self, entries: list) -> None:
        await self._hot_call("push_log", entries)

    async def flush_log(self) -> None:
        await self._call("flush_log")

    async def reset_index(self, owner: str, start_seq: int) -> None:
        await self._call("reset_index", owner, start_seq)

    async def stats(self) -> EngineStats:
        """Ask the engine; remember its report and its KV capacity (kept on failure)."""
        if self.healthy:
            try:
                wire = await self._call("stats")
            except EngineDead:
                pass
            else:
                self.last_stats = EngineStats.from_wire(wire)
                self.peak_kv_usage = max(self.peak_kv_usage, self.last_stats.kv_cache_usage)
                if self.last_stats.kv_capacity_tokens:
                    self.kv_capacity_tokens = self.last_stats.kv_capacity_tokens
                if self.last_stats.kv_block_size:
                    self.kv_block_size = self.last_stats.kv_block_size
        return replace(self.last_stats, engine=self.index, healthy=self.healthy, error=self.error)

    # ------------------------------------------------------------------ state
    def sync_failed(self, exc: BaseException) -> None:
        """The engine refused index-log entries (not a dead actor): count it; the pool re-attaches
        the engine's replica at its next batch and skips it until then."""
        self.sync_errors += 1
        cause = getattr(exc, "cause", None) or exc  # a RayTaskError carries the engine's own exception
        self.last_sync_error = f"{type(cause).__name__}: {cause}"[:500]

    def mark_dead(self, exc: BaseException) -> None:
        self.close_channel()
        if self.healthy:
            self.healthy = False
            cause = getattr(exc, "cause", None) or exc  # Ray's task error carries the actor's own
            self.error = f"{type(cause).__name__}: {cause}"[:500]
            import logging

            logging.getLogger(__name__).warning("engine %d marked dead (%s); its turns go to the other engines",
                                                self.index, self.error)
            if self.on_dead is not None:
                self.on_dead(self)

    def revive(self, handle: Any) -> None:
        """Back in service: the same actor answering again, or a restarted one (``handle``).
        The index replica is re-attached by the caller."""
        self.handle = handle
        self.healthy = True
        self.error = None
        self.last_sync_error = None
        self.close_channel()  # a restarted actor serves its own channel
        self._channel_address = None
        self.channel_off_reason = None

    def probe_stats(self, timeout_s: float) -> tuple[dict[str, Any] | None, bool]:
        """A blocking ``stats`` call for a recovery thread (off the pool's event loop): returns
        ``(report, gone)``: the report, or None with ``gone`` True when the actor is gone and False
        when it did not answer in ``timeout_s``."""
        import ray

        try:
            return ray.get(self.handle.stats.remote(), timeout=timeout_s), False
        except Exception as exc:  # noqa: BLE001 - hung (timeout) or gone (actor died)
            return None, actor_died(exc)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Shut the engine down (if it answers) and end its actor."""
        import ray

        if self.healthy:
            try:
                ray.get(self.handle.shutdown.remote(), timeout=timeout_s)
            except Exception:  # noqa: BLE001 - hung or gone: killed below
                pass
        kill_actor(self.handle)

    def dispatch_state(self) -> EngineState:
        """The dispatcher's snapshot of this engine: the requests in flight (exact: this client
        sent them), of which the engine last reported ``waiting`` still queued; KV in use and
        the measured step cost from its latest load report (:meth:`refresh_load`, else the
        latest stats)."""
        load = self.load or {}
        usage = float(load.get("kv_cache_usage", self.last_stats.kv_cache_usage if self.last_stats else 0.0) or 0.0)
        used = int(usage * self.kv_capacity_tokens) if self.kv_capacity_tokens != UNKNOWN_KV_TOKENS else 0
        waiting = min(max(int(load.get("waiting", 0) or 0), 0), self.in_flight)
        stats = self.last_stats
        if self.step_cost_source == "all_prompt" and isinstance(load.get("all_prompt"), dict):
            load = {**load, **load["all_prompt"]}
        return EngineState(self.index, self.in_flight - waiting, waiting, self.queued_tokens, self.kv_capacity_tokens,
                           max(0, self.parked), self.healthy, self.kv_block_size,
                           step_s=float(load.get("step_s", stats.step_s) or 0.0),
                           step_per_seq_s=float(load.get("step_per_seq_s", stats.step_per_seq_s) or 0.0),
                           prefill_token_s=float(load.get("prefill_token_s", stats.prefill_token_s) or 0.0),
                           kv_used_tokens=max(used, 0))

