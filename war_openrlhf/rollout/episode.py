"""One multi-turn episode: generate a turn -> environment step -> next turn, until done.

The loop follows OpenRLHF 0.11.2's ``MultiTurnAgentExecutor.execute`` (openrlhf/utils/agent.py:37-185)
token for token (the prompt and each environment feedback are tokenized with
``add_special_tokens=False`` and appended to the model's own sampled tokens, never re-tokenized;
the feedback of the last step too, agent.py:148-169), and shows the agent what it shows
(:mod:`.agents` lists it), so a trajectory from the pool and one from OpenRLHF's executor are
interchangeable for the trainer. The agent runs in this process, not in an engine actor: on a
thread of its own (:class:`AgentThread`, ``agent_runner: thread``) or on the pool's event loop
(:class:`AgentOnLoop`, ``agent_runner: loop``, as OpenRLHF runs it on its actor's loop). What differs:

* each turn goes through the pool (``TurnService.generate_turn``), which picks the engine
  per turn, re-dispatches it if an engine dies, and records it in the global suffix index;
* while the environment runs, the trajectory is *parked* on its engine (the dispatcher
  counts it as a pending turn there);
* ``max_turns`` ends an episode (OpenRLHF has no such bound), ``max_new_tokens_per_turn``
  caps each turn (None: only the context, as OpenRLHF does), and the last observation is kept
  up to ``max_context_tokens`` (OpenRLHF keeps all of it; its experience cuts it there);
* every failure ends or annotates only this episode, with a recorded reason: a tool that
  raises or times out (``on_tool_error``: ``observe`` turns the error into the tool's output,
  ``end`` ends the episode with reward 0), a context that would exceed
  ``max_context_tokens``, an engine error that survives the retries, a broken environment.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from typing import Any, Protocol, Sequence

from .action_text import action_text as vllm_text
from .agents import (WAR_SAMPLE_INDEX, WAR_TURN_LIMITS, AgentContractError, check_step_result, engine_sampling_kwargs,
                     initial_sampling_params, turn_limits)
from .config import RolloutConfig
from .deadline import within
from .trajectory import Trajectory, TurnRecord
from .turn_result import TurnResult

log = logging.getLogger(__name__)


class TurnService(Protocol):
    """What an episode needs from the pool."""

    async def generate_turn(self, trajectory_id: str, group_id: str, context: Sequence[int],
                            sampling_params: dict[str, Any], turn_index: int,
                            tokens_so_far: int) -> TurnResult: ...

    def park(self, trajectory_id: str, engine: int) -> None: ...

    def unpark(self, trajectory_id: str) -> None: ...


try:  # a fast tokenizer's backend (transformers depends on it); None: every tokenizer is called
    from tokenizers import Tokenizer as _FastBackend
except ImportError:  # pragma: no cover - transformers without its fast tokenizers
    _FastBackend = None


def tool_error_text(message: str) -> str:
    """The observation an episode sees when its tool failed (``on_tool_error: observe``)."""
    return f"\n<tool_error>{message}</tool_error>\n"


def _encode(tokenizer, text: str) -> list[int]:
    """``tokenizer(text, add_special_tokens=False)["input_ids"]`` (OpenRLHF's executor's call), every
    turn's observation. A fast tokenizer's call wraps the encode in argument checks, truncation and
    padding set-up and a ``BatchEncoding``, and encodes through the backend's batch encoder, which
    releases the interpreter lock (in the pool's driver, beside agent and Ray threads, each call then
    waits to take it back). When the backend (a ``tokenizers.Tokenizer``) is in the state that call
    would put it in (no truncation, no padding, special tokens split as the tokenizer splits them),
    its single encode gives the same ids; otherwise the call itself runs."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if type(text) is str else None
    if type(backend) is _FastBackend and backend.truncation is None and backend.padding is None \
            and backend.encode_special_tokens == bool(getattr(tokenizer, "split_special_tokens", False)):
        return backend.encode(text, add_special_tokens=False).ids
    return list(tokenizer(text=text, add_special_tokens=False)["input_ids"])


class AgentThread:
    """One episode's agent on a thread of its own, with its own event loop.

    OpenRLHF agents' ``reset`` / ``step`` are coroutines, but tools often block inside them
    (a synchronous SQL query, a subprocess): on the pool's event loop that would stall every
    episode, and ``asyncio.wait_for`` could not stop it. Here every call runs on this
    episode's thread and loop (so loop-bound objects an agent creates in ``reset`` keep
    working in ``step``) and the pool waits for it with a wall-clock deadline that always
    fires. A call past its deadline is cancelled where it awaits; one blocked in a call
    cannot be killed and keeps its thread until it returns (counted in
    :data:`ABANDONED`), while its episode ends and the batch goes on.
    """

    def __init__(self, name: str) -> None:
        import threading

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name=f"war-agent-{name}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    async def call(self, coro, timeout_s: float, limiter: asyncio.Semaphore | None = None):
        """Run ``coro`` on this episode's thread; at most ``timeout_s`` seconds from its start.
        ``limiter``: a slot is taken first (bounding agent calls in flight across episodes) and
        given back when the call returns or is abandoned at its deadline."""
        if limiter is not None:
            await limiter.acquire()
        try:
            fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
            try:
                return await asyncio.wait_for(asyncio.wrap_future(fut), timeout_s)
            except asyncio.TimeoutError:
                fut.cancel()
                ABANDONED["calls"] += 1
                raise
        finally:
            if limiter is not None:
                limiter.release()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)


#: File descriptors an :class:`AgentThread` holds while its episode runs (its event loop's
#: epoll and self-pipe pair).
FDS_PER_AGENT_THREAD = 3
#: Descriptors left for everything else in the process (Ray, sockets, files).
FD_HEADROOM = 512


def make_room_for_agent_threads(episodes: int) -> None:
    """A batch of ``episodes`` with ``agent_runner: thread`` holds ``FDS_PER_AGENT_THREAD`` file
    descriptors per episode at once (4,096 episodes: ~12,000). Raise the process's soft limit
    towards its hard one if needed; if even the hard limit is too low, refuse the batch before
    any episode starts (naming the remedies) rather than fail episodes mid-batch with EMFILE."""
    try:
        import resource
    except ImportError:  # not a POSIX system: nothing to check
        return
    need = episodes * FDS_PER_AGENT_THREAD + FD_HEADROOM
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    target = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft < need:
        raise RuntimeError(f"RolloutConfig.agent_runner: thread runs {episodes} episodes with a thread and event loop "
                           f"each, ~{need} file descriptors, but this process may open {soft} (ulimit -n; hard "
                           f"limit {hard}). Use agent_runner: loop for agents whose tools await, raise the limit "
                           "(ulimit -n), or run fewer episodes per batch.")


#: Agent calls given up at their deadline since the process started (their threads end when
#: the blocked call returns).
ABANDONED = {"calls": 0}


class AgentOnLoop:
    """One episode's agent on the pool's own event loop (``agent_runner: loop``).

    No thread and no cross-thread hop per ``reset`` / ``step`` (two wake-ups of another thread and
    a GIL hand-over each: ``docs/benchmarks.md`` measures the turn path both ways). The price is
    OpenRLHF's: a tool that blocks instead of awaiting stalls every episode, and its deadline can
    only fire once it yields. A call that returns past its deadline is therefore failed as a
    timeout all the same, counted in :data:`LOOP_OVERRUNS`, and logged once per process with the
    remedy (``agent_runner: thread``)."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def call(self, coro, timeout_s: float, limiter: asyncio.Semaphore | None = None):
        if limiter is not None:
            await limiter.acquire()
        try:
            started = time.monotonic()
            result = await within(coro, timeout_s)
            if time.monotonic() - started > timeout_s:  # it blocked the loop past its deadline
                LOOP_OVERRUNS["calls"] += 1
                if LOOP_OVERRUNS["calls"] == 1:
                    log.warning("agent of %s blocked the pool's event loop past tool_timeout_s (%g s): with "
                                "agent_runner: loop a blocking tool stalls every episode; use agent_runner: "
                                "thread for it", self.name, timeout_s)
                raise asyncio.TimeoutError
            return result
        finally:
            if limiter is not None:
                limiter.release()

    def close(self) -> None:
        pass


#: ``agent_runner: loop`` calls that returned only after their deadline (they blocked the loop).
LOOP_OVERRUNS = {"calls": 0}


def turn_seed(seed: int | None, trajectory_id: str, turn: int) -> int | None:
    """A reproducible per-request sampling seed (None: vLLM's own randomness)."""
    if seed is None:
        return None
    import zlib

    return (seed * 1_000_003 + zlib.crc32(f"{trajectory_id}/{turn}".encode())) % (2**31 - 1)


async def run_episode(service: TurnService, agent_cls: type, tokenizer, cfg: RolloutConfig, *,
                      prompt: str, label: Any, trajectory_id: str, group_id: str,
                      t0: float | None = None, limiter: asyncio.Semaphore | None = None,
                      sample_index: int | None = None) -> Trajectory:
    """Run one episode to its end; never raises (failures become ``end_reason``/``error``).
    ``sample_index``: the episode's number in its GRPO group, shown to the agent's ``reset``."""
    t0 = time.perf_counter() if t0 is None else t0
    start = time.perf_counter()
    traj = Trajectory(trajectory_id=trajectory_id, group_id=group_id, prompt=prompt, label=label)
    agent = AgentThread(trajectory_id) if cfg.agent_runner == "thread" else AgentOnLoop(trajectory_id)
    try:
        await _run(service, agent_cls, tokenizer, cfg, traj, t0, agent, limiter, sample_index)
    except AgentContractError as exc:  # the agent file's bug: named, never trained on
        traj.end_reason = "agent_error"
        traj.error = f"{exc}"
    except Exception as exc:  # the environment itself is broken: keep the batch going
        traj.end_reason = traj.end_reason or "episode_error"
        traj.error = f"{type(exc).__name__}: {exc}"
        traj.extra_logs["episode_traceback_lines"] = float(len(traceback.format_exc().splitlines()))
    finally:
        agent.close()
        service.unpark(trajectory_id)
    end = time.perf_counter()
    traj.wall_s = end - start
    traj.finished_s = end - t0
    return traj


async def _run(service: TurnService, agent_cls: type, tokenizer, cfg: RolloutConfig, traj: Trajectory,
               t0: float, agent: AgentThread | AgentOnLoop, limiter: asyncio.Semaphore | None = None,
               sample_index: int | None = None) -> None:
    where = f"{cfg.agent_func_path or agent_cls.__name__}: "
    instance = agent_cls()
    states = {"observation": traj.prompt, "label": traj.label}
    if sample_index is not None:
        states[WAR_SAMPLE_INDEX] = int(sample_index)
    reset = await agent.call(instance.reset(states), cfg.tool_timeout_s, limiter)
    if not isinstance(reset, dict) or not isinstance(reset.get("observation"), str):
        raise AgentContractError(f"{where}reset() must return a dict with a str 'observation'")
    limits = turn_limits(reset.get(WAR_TURN_LIMITS), f"{where}reset()")  # WAR's own bound of the first turn
    observation_text = _start_context(tokenizer, cfg, traj, reset["observation"])
    if observation_text is None:
        return
    # the object the agent sees: OpenRLHF's, set again before each turn (agent.py:94)
    sampling = initial_sampling_params(cfg.max_new_tokens_per_turn, cfg.temperature, cfg.top_p)
    agent_logs: set[str] = set()
    generated = 0
    for turn in range(cfg.max_turns):
        budget = cfg.max_context_tokens - len(traj.token_ids)
        if budget <= 0:
            traj.end_reason = "max_context"
            return
        sampling.max_tokens = min(cfg.turn_token_cap, budget)
        params = engine_sampling_kwargs(sampling, limits, turn_seed(cfg.seed, traj.trajectory_id, turn), where)
        dispatched = time.perf_counter()
        try:
            out = await service.generate_turn(traj.trajectory_id, traj.group_id, traj.token_ids, params,
                                              turn, generated)
        except Exception as exc:
            traj.end_reason = "engine_error"
            traj.error = f"turn {turn}: {type(exc).__name__}: {exc}"
            return
        rec = _append_turn(traj, out, params, turn, dispatched - t0, time.perf_counter() - dispatched)
        if rec is None:
            return
        generated += rec.end - rec.start
        action_text = out.text if out.text is not None else vllm_text(  # the engine's own, else rebuilt
            tokenizer, traj.token_ids[:rec.start], traj.token_ids[rec.start:rec.end], out.finish_reason, sampling)
        states = {"observation_text": observation_text, "action_text": action_text, "label": traj.label,
                  "sampling_params": sampling}
        step = await _tool_step(service, agent, instance, states, cfg, traj, rec, limiter, where)
        if step is None:
            return
        traj.reward += step["rewards"]
        traj.score = step["scores"] if step["scores"] is not None else traj.reward
        if step["from_agent"]:  # the last step's logs, as OpenRLHF keeps them (agent.py:127)
            for key in agent_logs - set(step["extra_logs"]):
                traj.extra_logs.pop(key, None)
            traj.extra_logs.update(step["extra_logs"])
            agent_logs = set(step["extra_logs"])
        if step["environment_images"] and hasattr(tokenizer, "image_processor"):
            raise AgentContractError(f"{where}step() returned environment_images: WAR's pool runs text-only "
                                     "episodes (OpenRLHF would add them to a VLM's context, agent.py:130-146)")
        feedback = _encode(tokenizer, step["environment_feedback"])
        room = cfg.max_context_tokens - len(traj.token_ids)
        observation_text = observation_text + action_text + step["environment_feedback"]
        traj.token_ids.extend(feedback[:room])  # beyond the context: never a turn's input nor a sample's
        traj.action_mask.extend([0] * len(feedback[:room]))
        traj.logprobs.extend([0.0] * len(feedback[:room]))
        if step["sampling_params"] is not None:  # the agent's, for every later turn (agent.py:165-166)
            sampling = step["sampling_params"]
        limits = step[WAR_TURN_LIMITS]
        if step["done"]:
            traj.end_reason = "done"
            return
        if len(feedback) >= room:
            traj.end_reason = "max_context"  # the observation leaves no room for a reply
            return
    traj.end_reason = "max_turns"


def _start_context(tokenizer, cfg: RolloutConfig, traj: Trajectory, observation_text: str) -> str | None:
    """The first observation as the trajectory's context, with room for one turn (as OpenRLHF's
    executor leaves it: its max_new_tokens, or 1 token when the context alone bounds a turn).
    Returns the observation text the agent sees, or None when the episode ends here."""
    tokens = _encode(tokenizer, observation_text)
    reserve = cfg.max_new_tokens_per_turn if cfg.max_new_tokens_per_turn is not None else 1
    room = cfg.max_context_tokens - min(reserve, cfg.max_context_tokens - 1)
    if len(tokens) > room:
        if cfg.prompt_overflow == "end":
            traj.token_ids, traj.action_mask, traj.logprobs = list(tokens), [0] * len(tokens), [0.0] * len(tokens)
            traj.end_reason = "prompt_too_long"
            traj.error = (f"prompt has {len(tokens)} tokens; max_context_tokens {cfg.max_context_tokens} leaves "
                          f"{room} after one turn of max_new_tokens_per_turn")
            return None
        # OpenRLHF's MultiTurnAgentExecutor: keep the last tokens, leave room for one turn
        traj.extra_logs["prompt_truncated_tokens"] = float(len(tokens) - room)
        tokens = tokens[-room:]
        observation_text = tokenizer.decode(tokens, skip_special_tokens=False)
    traj.token_ids = list(tokens)
    traj.action_mask = [0] * len(tokens)
    traj.logprobs = [0.0] * len(tokens)
    return observation_text


def _append_turn(traj: Trajectory, out: TurnResult, params: dict[str, Any], turn: int, dispatched_s: float,
                 generate_s: float) -> TurnRecord | None:
    """Append a turn's tokens and log-probs to the trajectory; None (episode ended) when the engine
    answered outside its contract: such a turn is never a sample."""
    action = list(out.token_ids)
    lps = list(out.logprobs) if out.logprobs else [0.0] * len(action)
    if len(lps) != len(action) or len(action) > params["max_tokens"]:
        traj.end_reason = "engine_error"
        traj.error = (f"turn {turn}: engine {out.engine} returned {len(action)} tokens and {len(lps)} "
                      f"logprobs for max_tokens {params['max_tokens']}")
        return None
    begin = len(traj.token_ids)
    traj.token_ids.extend(action)
    traj.action_mask.extend([1] * len(action))
    traj.logprobs.extend(float(x) for x in lps)
    rec = TurnRecord(index=turn, engine=out.engine, start=begin, end=len(traj.token_ids),
                     prompt_tokens=out.num_prompt_tokens, cached_tokens=out.num_cached_tokens,
                     finish_reason=str(out.finish_reason), dispatched_s=dispatched_s, generate_s=generate_s,
                     attempts=out.attempts, policy_versions=out.weight_versions,
                     estimated_cached_tokens=out.estimated_cached_tokens, queue_s=out.queue_s, prefill_s=out.prefill_s)
    traj.turns.append(rec)
    traj.truncated = out.finish_reason == "length"
    return rec


async def _tool_step(service: TurnService, agent: "AgentThread | AgentOnLoop", instance: Any, states: dict[str, Any],
                     cfg: RolloutConfig, traj: Trajectory, rec: TurnRecord, limiter: asyncio.Semaphore | None,
                     where: str) -> dict[str, Any] | None:
    """The environment's step after a turn, the trajectory parked on its engine meanwhile. A failing
    or slow tool ends the episode (``on_tool_error: end``: returns None) or is observed as an error
    text; a broken step result raises the agent's contract error."""
    service.park(traj.trajectory_id, rec.engine)
    t_tool = time.perf_counter()
    try:
        raw = await agent.call(instance.step(states), cfg.tool_timeout_s, limiter)
    except Exception as exc:
        msg = (f"tool timed out after {cfg.tool_timeout_s:g} s" if isinstance(exc, asyncio.TimeoutError)
               else f"{type(exc).__name__}: {exc}")
        rec.tool_error = msg
        traj.extra_logs["tool_errors"] = traj.extra_logs.get("tool_errors", 0.0) + 1.0
        if cfg.on_tool_error == "end":
            rec.tool_s = time.perf_counter() - t_tool
            traj.reward, traj.score = 0.0, 0.0
            traj.end_reason, traj.error = "tool_error", msg
            return None
        raw = {"rewards": 0.0, "scores": None, "environment_feedback": tool_error_text(msg), "done": False}
    finally:
        service.unpark(traj.trajectory_id)
    step = check_step_result(raw, f"{where}step()")  # the agent's contract: its error if broken
    step["from_agent"] = rec.tool_error is None
    rec.tool_s = time.perf_counter() - t_tool
    return step
