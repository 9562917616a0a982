"""Rollout pool configuration (defaults documented in configs/rollout.yaml).

One YAML file describes a pool: its engines (an :class:`~war_openrlhf.engine.EngineConfig`
under ``engine``, which carries the speculation mode, the switch and the index budget), the
dispatch policy and its options (``dispatch_kwargs``, checked against the policy's typed
options, :class:`~war_openrlhf.dispatch.PolicyOptions`), and the episode limits. A bad key,
type or value names the key and the file.

A :class:`RolloutConfig` is frozen: it is complete when built and never changes afterwards
(``dataclasses.replace`` makes another). Building it settles what its inputs imply, once: an
``engine`` given as a mapping becomes an :class:`EngineConfig`, and ``kv_events`` (the
dispatcher reads the engines' KV events) turns on ``engine.kv_events`` (the engines publish
them).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..config_checks import check_int, check_number, dataclass_from_dict, load_yaml
from ..dispatch import POLICIES, PolicyOptions
from ..engine.config import EngineConfig

ON_TOOL_ERROR = ("observe", "end")
ENGINE_RECOVERY = ("off", "reinstate", "restart")
TURN_TRANSPORTS = ("direct", "ray")
AGENT_RUNNERS = ("thread", "loop")
EPISODE_HOSTS = ("driver", "engine")


@dataclass(frozen=True)
class RolloutConfig:
    """A WAR rollout pool and the episodes it runs."""

    num_engines: int = 2
    engine: EngineConfig = field(default_factory=EngineConfig)
    dispatch_policy: str = "war"
    dispatch_kwargs: dict = field(default_factory=dict)
    agent_func_path: str = ""
    n_samples_per_prompt: int = 4
    max_turns: int = 8
    max_context_tokens: int = 2048
    max_new_tokens_per_turn: int | None = 256  # None: only the context bounds a turn (OpenRLHF's way)
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    tool_timeout_s: float = 30.0
    on_tool_error: str = "observe"
    engine_retries: int = 3
    max_agent_calls_in_flight: int = 256  # agent reset/step calls running at once
    agent_runner: str = "thread"  # thread: each episode's agent on its own thread; loop: on the pool's event loop
    turn_timeout_s: float = 900.0  # an engine silent this long on one turn is hung: treated as dead
    log_sync_interval_s: float = 0.05
    stats_interval_s: float = 2.0
    load_interval_s: float = 0.1  # engines' queue, KV and measured step cost for the dispatcher; 0: off
    turn_transport: str = "direct"  # direct: turns on a socket to each engine actor; ray: a Ray call per turn
    freeze_heap: bool = True  # the heap from before a batch skips garbage collections while it runs (gc_heap.py)
    episode_host: str = "driver"  # engine: whole episodes run beside their engine (rollout/episode_host.py)
    turn_priority: str = "none"  # longest_first: predicted stragglers' turns first (dispatch/turn_priority.py)
    progress: bool = True
    warm_up: bool = True
    dump_dir: str = ""
    prompt_overflow: str = "truncate"
    on_failed_episode: str = "fail"  # fail: the step fails loudly; drop_group: its GRPO group is dropped
    kv_events: bool = False  # the dispatcher corrects its model of each engine's cache with vLLM's KV events
    record_cache_estimates: bool = False  # benchmarks: each turn records the dispatcher's estimate of its cached prefix
    engine_recovery: str = "reinstate"  # off | reinstate (a hung engine that answers again) | restart (also a new actor)
    recovery_probe_interval_s: float = 10.0  # how often a dead-marked engine is probed / a restart retried

    def __post_init__(self) -> None:
        if self.on_failed_episode not in ("fail", "drop_group"):
            raise ValueError(f"RolloutConfig.on_failed_episode: '{self.on_failed_episode}' is not one of fail, drop_group")
        engine = self.engine
        if isinstance(engine, dict):
            engine = EngineConfig.from_dict(engine, source="RolloutConfig.engine")
        if self.kv_events and not engine.kv_events:  # the engines must publish what the dispatcher reads
            engine = replace(engine, kv_events=True)
        if engine is not self.engine:  # settled while building, before anyone holds the object
            object.__setattr__(self, "engine", engine)
        for name, minimum in (("num_engines", 1), ("n_samples_per_prompt", 1), ("max_turns", 1),
                              ("max_context_tokens", 2), ("engine_retries", 0), ("max_agent_calls_in_flight", 1)):
            check_int("RolloutConfig", name, getattr(self, name), minimum)
        check_int("RolloutConfig", "max_new_tokens_per_turn", self.max_new_tokens_per_turn, 1, nullable=True)
        check_int("RolloutConfig", "seed", self.seed, 0, nullable=True)
        if self.dispatch_policy not in POLICIES:
            raise ValueError(f"RolloutConfig.dispatch_policy: unknown policy '{self.dispatch_policy}'; "
                             f"known: {', '.join(sorted(POLICIES))}")
        if not isinstance(self.dispatch_kwargs, dict):
            raise ValueError("RolloutConfig.dispatch_kwargs: must be a mapping of the policy's options")
        self.dispatch_options  # noqa: B018 - checks each option's name, type and value
        if self.engine_recovery not in ENGINE_RECOVERY:
            raise ValueError(f"RolloutConfig.engine_recovery: '{self.engine_recovery}' is not one of "
                             f"{', '.join(ENGINE_RECOVERY)} (off: a dead or hung engine stays out; reinstate: "
                             "a hung engine that answers again with current weights comes back; restart: "
                             "also kill a dead or hung engine's actor and start a new one in its place)")
        if self.on_tool_error not in ON_TOOL_ERROR:
            raise ValueError(f"RolloutConfig.on_tool_error: '{self.on_tool_error}' is not one of "
                             f"{', '.join(ON_TOOL_ERROR)} (observe: the error becomes the tool's "
                             "output; end: the episode ends with reward 0)")
        if self.prompt_overflow not in ("truncate", "end"):
            raise ValueError(f"RolloutConfig.prompt_overflow: '{self.prompt_overflow}' is not one of truncate, end "
                             "(truncate: keep the prompt's last tokens, as OpenRLHF does; end: end the episode)")
        for name in ("tool_timeout_s", "log_sync_interval_s", "stats_interval_s", "turn_timeout_s",
                     "recovery_probe_interval_s"):  # seconds
            check_number("RolloutConfig", name, getattr(self, name), gt=0)
        check_number("RolloutConfig", "load_interval_s", self.load_interval_s, ge=0)
        if self.turn_transport not in TURN_TRANSPORTS:
            raise ValueError(f"RolloutConfig.turn_transport: '{self.turn_transport}' is not one of "
                             f"{', '.join(TURN_TRANSPORTS)} (direct: each turn on a TCP connection to its engine "
                             "actor; ray: a Ray actor call per turn)")
        if self.agent_runner not in AGENT_RUNNERS:
            raise ValueError(f"RolloutConfig.agent_runner: '{self.agent_runner}' is not one of "
                             f"{', '.join(AGENT_RUNNERS)} (thread: each episode's agent on a thread of its own, "
                             "a blocking tool stalls only its episode; loop: agents on the pool's event loop, "
                             "for agents whose tools never block it)")
        if self.episode_host not in EPISODE_HOSTS:
            raise ValueError(f"RolloutConfig.episode_host: '{self.episode_host}' is not one of "
                             f"{', '.join(EPISODE_HOSTS)} (driver: every turn dispatched from the pool; engine: "
                             "the pool places each episode, which then runs beside its engine)")
        if self.episode_host == "engine" and self.turn_priority != "none":
            raise ValueError("RolloutConfig.turn_priority: longest_first sets each turn's priority from the pool's "
                             "predictor, which episodes hosted beside their engine (episode_host: engine) do not "
                             "consult; use one or the other")
        if self.turn_priority not in ("none", "longest_first"):
            raise ValueError(f"RolloutConfig.turn_priority: '{self.turn_priority}' is not one of none, longest_first")
        if self.turn_priority != "none" and self.engine.scheduling_policy != "priority":
            raise ValueError("RolloutConfig.turn_priority: longest_first orders turns by vLLM request priority, "
                             "which engines honour only with engine.scheduling_policy: priority (set it)")
        check_number("RolloutConfig", "temperature", self.temperature, ge=0)
        check_number("RolloutConfig", "top_p", self.top_p, gt=0, le=1)
        if self.max_new_tokens_per_turn is not None and self.max_new_tokens_per_turn >= self.max_context_tokens:
            raise ValueError(f"RolloutConfig.max_new_tokens_per_turn ({self.max_new_tokens_per_turn}) must be "
                             f"below max_context_tokens ({self.max_context_tokens})")
        if self.engine.model and self.max_context_tokens > self.engine.max_model_len:
            raise ValueError(f"RolloutConfig.max_context_tokens ({self.max_context_tokens}) exceeds "
                             f"engine.max_model_len ({self.engine.max_model_len}); lower it or raise "
                             "engine.max_model_len")

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "RolloutConfig") -> "RolloutConfig":
        return dataclass_from_dict(cls, data, source, nested={"engine": EngineConfig.from_dict})

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> "RolloutConfig":
        """Load ``path``; ``overrides`` replace top-level keys (``engine`` merges key by key)."""
        data = load_yaml(path)
        eng = overrides.pop("engine", None)
        if eng:
            data["engine"] = {**(data.get("engine") or {}), **eng}
        return cls.from_dict({**data, **overrides}, source=str(path))

    @property
    def dispatch_options(self) -> PolicyOptions:
        """``dispatch_kwargs`` as the policy's typed options (``POLICIES[dispatch_policy].Options``)."""
        return POLICIES[self.dispatch_policy].Options.from_dict(self.dispatch_kwargs, "RolloutConfig.dispatch_kwargs",
                                                                self.dispatch_policy)

    @property
    def turn_token_cap(self) -> int:
        """The most tokens one model turn may generate (before the context budget applies)."""
        if self.max_new_tokens_per_turn is None:
            return self.max_context_tokens - 1
        return self.max_new_tokens_per_turn

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
