"""Episodes beside their engine (``RolloutConfig.episode_host: engine``).

With the default (``driver``) every turn crosses from the pool's process to an engine and back:
a dispatch decision, the turn channel, the answer, the agent's step on the pool's side. That
path costs the pool's process about three times what OpenRLHF's ``MultiTurnAgentExecutor``
costs inside its engine actor (``docs/benchmarks.md``, "The pool's per-turn path"), and at
thousands of episodes per step one driver process does it for every engine.

Here the pool only places an episode (its dispatcher's admission and placement of the first
turn) and sends the whole episode to that engine in one call; :class:`EpisodeHost`, inside
the engine's actor, runs it with :func:`~.episode.run_episode`, the same loop the pool runs
(agent, tokenizer and engine in one process, as OpenRLHF runs agents), every turn on this
engine. What the pool gives up: per-turn placement (a hosted trajectory stays where it was
placed, as under a sticky router) and per-turn facts while the episode runs (its finished
turns reach the dispatcher's cache model and the global suffix index when the episode
ends). Failures keep their meaning: a turn's engine error or timeout ends the episode with
``engine_error`` and the pool runs it again, as it does for episodes on its own loop.

On the wire an episode comes back as :func:`trajectory_to_wire`'s dict (msgpack-native), the
prompt and label left out (the pool has them).
"""

from __future__ import annotations

import asyncio
from dataclasses import fields
from typing import Any, Sequence

from .config import RolloutConfig
from .deadline import within
from .episode import run_episode
from .trajectory import Trajectory, TurnRecord
from .turn_result import TurnResult

__all__ = ["EpisodeHost", "trajectory_to_wire", "trajectory_from_wire"]


_WIRE_FIELDS = tuple(f.name for f in fields(Trajectory) if f.name not in ("prompt", "label", "turns"))


def trajectory_to_wire(traj: Trajectory) -> dict[str, Any]:
    """A trajectory as msgpack-native values, without its prompt and label. Not ``asdict``: that
    deep-copies every token id and logprob one by one (milliseconds for a long episode)."""
    out = {name: getattr(traj, name) for name in _WIRE_FIELDS}
    out["turns"] = [dict(t.__dict__) for t in traj.turns]  # TurnRecord holds plain values
    return out


def trajectory_from_wire(wire: dict[str, Any], prompt: str, label: Any, *, engine: int,
                         time_offset_s: float = 0.0) -> Trajectory:
    """The trajectory :func:`trajectory_to_wire` sent, with its prompt and label again. Every
    turn must name ``engine`` (the one that hosted it); ``time_offset_s`` moves the turns'
    dispatch times from the host's clock (seconds since the episode started there) to the
    batch's. A field missing or of the wrong kind raises ``ValueError`` naming it."""
    try:
        turns = []
        for t in wire["turns"]:
            t = dict(t)
            t["policy_versions"] = tuple(int(v) for v in t["policy_versions"])
            t["dispatched_s"] = float(t["dispatched_s"]) + time_offset_s
            rec = TurnRecord(**t)
            if rec.engine != engine:
                raise ValueError(f"turn {rec.index} names engine {rec.engine}, hosted on engine {engine}")
            turns.append(rec)
        values = {k: v for k, v in wire.items() if k != "turns"}
        traj = Trajectory(prompt=prompt, label=label, turns=turns, **values)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"hosted episode from engine {engine}: malformed trajectory ({type(exc).__name__}: {exc})") \
            from None
    return traj


class _LocalTurns:
    """The episode loop's ``TurnService`` inside the engine's actor: every turn on this engine,
    bounded by ``turn_timeout_s``; parking counted for the engine's load report."""

    def __init__(self, host: "EpisodeHost", cfg: RolloutConfig) -> None:
        self.host = host
        self.cfg = cfg

    async def generate_turn(self, trajectory_id: str, group_id: str, context: Sequence[int],
                            sampling_params: dict[str, Any], turn_index: int, tokens_so_far: int) -> TurnResult:
        engine = self.host.engine
        # the trajectory's own list, as the engine copies it (an int32 array in between cost two
        # passes over the whole context per turn: ~40 us at 1.5k tokens, growing with the context)
        try:
            answer = await within(engine.generate_tokens(context, sampling_params, None, trajectory_id, group_id),
                                  self.cfg.turn_timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no answer to a turn within {self.cfg.turn_timeout_s:g} s") from None
        answer.pop("load_now", None)
        return TurnResult.from_engine(answer, engine=engine.engine_index, prompt_tokens=len(context))

    def park(self, trajectory_id: str, engine: int) -> None:
        self.host.parked.add(trajectory_id)

    def unpark(self, trajectory_id: str) -> None:
        self.host.parked.discard(trajectory_id)


class EpisodeHost:
    """Runs whole episodes beside one engine (a ``WarEngine`` in this process)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.parked: set[str] = set()  # hosted trajectories waiting on their tool
        self.running = 0
        self.episodes = 0
        self._configs: dict[str, RolloutConfig] = {}
        self._agents: dict[str, type] = {}
        self._tokenizers: dict[str, Any] = {}
        self._limiters: dict[str, tuple[Any, asyncio.Semaphore]] = {}

    def _config(self, key: str, config: dict[str, Any]) -> RolloutConfig:
        cfg = self._configs.get(key)
        if cfg is None:
            cfg = RolloutConfig.from_dict(dict(config), source=f"hosted episode config {key}")
            if len(self._configs) >= 16:  # a long job's pools come and go: keep the newest
                self._configs.pop(next(iter(self._configs)))
            self._configs[key] = cfg
        return cfg

    def _agent(self, path: str) -> type:
        if not path:
            raise ValueError("RolloutConfig.agent_func_path: episodes hosted beside their engine load the agent "
                             "from its file there; the pool was given an agent class without a file")
        cls = self._agents.get(path)
        if cls is None:
            from .agents import load_agent_class

            cls = self._agents[path] = load_agent_class(path)
        return cls

    def _tokenizer(self, name: str) -> Any:
        tok = self._tokenizers.get(name)
        if tok is None:
            from transformers import AutoTokenizer

            tok = self._tokenizers[name] = AutoTokenizer.from_pretrained(name)
        return tok

    def _limiter(self, key: str, size: int) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        got = self._limiters.get(key)
        if got is None or got[0] is not loop:
            got = self._limiters[key] = (loop, asyncio.Semaphore(size))
        return got[1]

    async def run(self, key: str, config: dict[str, Any], prompt: str, label: Any, trajectory_id: str,
                  group_id: str, sample_index: int | None = None) -> dict[str, Any]:
        """One episode to its end, here; returns :func:`trajectory_to_wire`'s dict. ``key`` names
        the pool's settings (``config``, a :meth:`RolloutConfig.as_dict`), parsed once."""
        cfg = self._config(key, config)
        agent_cls = self._agent(cfg.agent_func_path)
        tokenizer = self._tokenizer(cfg.engine.model)  # the pool's default tokenizer, as it loads it
        self.running += 1
        try:
            traj = await run_episode(_LocalTurns(self, cfg), agent_cls, tokenizer, cfg, prompt=prompt, label=label,
                                     trajectory_id=trajectory_id, group_id=group_id,
                                     limiter=self._limiter(key, cfg.max_agent_calls_in_flight),
                                     sample_index=sample_index)
        finally:
            self.running -= 1
            self.episodes += 1
        return trajectory_to_wire(traj)
