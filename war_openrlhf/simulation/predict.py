"""What WAR would gain on a user's own trajectories: the simulator's step time per configuration.

Each configuration is a dispatch policy and a speculation mode, as ``bench_rollout`` runs them on
real engines: OpenRLHF's rollout (its group placement, no drafting) is the baseline, beside
vLLM's own ``suffix`` method (one flag), WAR's scheduling with and without its global index, and
the peers' routers (verl's sticky and KV-aware, Dynamo's, SGLang's) without drafting.

Speculation enters as what drafting achieves on *these* trajectories: the replay
(:mod:`.spec_replay`) runs every turn with the mode's proposer and verifies each draft against
the recorded response, giving tokens per verification step and drafted tokens per step; the
simulator then prices steps with them. The replay accepts a draft token when it equals the
recorded one (greedy verification): with sampling at temperature 1 real acceptance is lower.
WAR's load-aware switch turns drafting off where it does not pay; it is modelled as the faster of
drafting on and off for the whole step (``war``'s row says which).

The replay samples whole groups (``replay_groups``): drafting's rate per turn needs a few
thousand turns, not every turn of a large trace set. Replays and simulations run in worker
processes (one per core; they read the trajectories through ``fork``, never pickled).

Everything else (prefill, prefix caching at the engine's block size, KV limits and eviction,
batching, tool latency, placement) is the simulator's own (:mod:`.cluster`), with its cost model
(a preset or a file ``bench_engine --fit-costs`` wrote).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

__all__ = ["CONFIGS", "PredictSettings", "predict"]

#: name: (dispatch policy, speculation mode)
CONFIGS: dict[str, tuple[str, str]] = {
    "openrlhf": ("least_loaded", "none"),
    "openrlhf_vllm_suffix": ("least_loaded", "vllm_suffix"),
    "war": ("war", "war"),
    "war_sched_only": ("war", "none"),
    "war_spec_only": ("least_loaded", "war"),
    "verl_sticky": ("sticky", "none"),
    "verl_kv_aware": ("verl_kv_aware", "none"),
    "dynamo_kv": ("dynamo_kv", "none"),
    "sglang_cache_aware": ("sglang_cache_aware", "none"),
    "war_longest_first": ("war", "war"),
}
DEFAULT_CONFIGS = ("openrlhf", "openrlhf_vllm_suffix", "war", "war_sched_only", "verl_sticky", "dynamo_kv")
SWITCHED = ("war", "war_spec_only", "war_longest_first")  # WAR's engines switch drafting by load
#: engines with vLLM priority scheduling, each turn's priority its trajectory's predicted remaining
#: turns (the pool's ``turn_priority: longest_first``; the predictor learns from the run's groups)
PRIORITY_CONFIGS = ("war_longest_first",)


@dataclass(frozen=True)
class PredictSettings:
    """The cluster a prediction is for."""

    engines: int = 8
    kv_tokens: int | None = None  # per engine; None: the cost model's
    cost_model: str = "h100_qwen7b"  # a preset name or a fitted cost-model JSON file
    tool_latency_s: float | None = None  # None: the trajectories' recorded latencies, else 1 s
    steps: int = 1
    draft_tokens: int = 16  # most tokens drafted per step (EngineConfig.num_speculative_tokens)
    replay_engines: int | None = None  # engines of the speculation replay (None: min(engines, 8))
    replay_groups: int | None = 32  # groups the speculation replay samples (None: all of them)
    seed: int = 0

    def __post_init__(self) -> None:
        from ..config_checks import check_int, check_number

        check_int("PredictSettings", "engines", self.engines, 1)
        check_int("PredictSettings", "kv_tokens", self.kv_tokens, 16, nullable=True)
        check_int("PredictSettings", "steps", self.steps, 1)
        check_int("PredictSettings", "draft_tokens", self.draft_tokens, 1)
        check_int("PredictSettings", "replay_engines", self.replay_engines, 1, nullable=True)
        check_int("PredictSettings", "replay_groups", self.replay_groups, 1, nullable=True)
        if self.tool_latency_s is not None:
            check_number("PredictSettings", "tool_latency_s", self.tool_latency_s, ge=0)


def _proposer(mode: str, engines: int):
    from ..speculation.proposers import PerEngineSuffixProposer, WarGlobalProposer

    return PerEngineSuffixProposer(engines) if mode == "vllm_suffix" else WarGlobalProposer(engines)


def measure_speculation(trajectories: Sequence[Any], mode: str, settings: PredictSettings,
                        progress: bool = False) -> dict[str, float]:
    """Tokens per verification step and drafted tokens per step of ``mode`` on the trajectories:
    on a seeded sample of ``replay_groups`` whole groups (what drafting finds is a per-turn rate;
    vLLM's suffix method rebuilds a tree of each request's prompt, so replaying every turn of a
    large trace set would take the prediction tens of minutes)."""
    import numpy as np

    from ..traces import group_trajectories
    from .spec_replay import ReplayConfig, replay

    engines = settings.replay_engines or min(settings.engines, 8)
    groups = group_trajectories(trajectories)
    if settings.replay_groups is not None and len(groups) > settings.replay_groups:
        keys = sorted(groups)
        pick = np.random.default_rng(settings.seed).choice(len(keys), settings.replay_groups, replace=False)
        groups = {keys[i]: groups[keys[i]] for i in sorted(pick)}
    result = replay(groups, _proposer(mode, engines),
                    ReplayConfig(engines=engines, k=settings.draft_tokens, steps=settings.steps, seed=settings.seed),
                    progress=progress)
    steps = max(result.verification_steps, 1)
    return {"tokens_per_step": result.tokens_per_step, "acceptance": result.acceptance_rate,
            "drafted_per_step": result.draft_tokens / steps, "replay_engines": engines,
            "replay_groups": len(groups), "replay_trajectories": sum(len(g) for g in groups.values())}


#: what worker processes read (set before they fork: the trajectories are not pickled)
_SHARED: dict[str, Any] = {}


def _replay_job(mode: str) -> dict[str, float]:
    return measure_speculation(_SHARED["trajectories"], mode, _SHARED["settings"])


def _key(name: str, mode: str | None = None) -> tuple[str, str, bool]:
    """One simulation: (policy, speculation mode, priority scheduling)."""
    policy, own_mode = CONFIGS[name]
    return policy, own_mode if mode is None else mode, name in PRIORITY_CONFIGS


def _simulate_job(policy: str, cfg) -> float:
    from .cluster import simulate

    return simulate(_SHARED["prepared"], policy, cfg).makespan_s


def predict(trajectories: Sequence[Any], settings: PredictSettings, configs: Sequence[str] = DEFAULT_CONFIGS,
            progress: Callable[[str], None] | None = None, jobs: int | None = None) -> dict[str, Any]:
    """Predicted step time of each configuration and its gain over ``openrlhf`` (always run).
    ``jobs``: worker processes for the replays and simulations (None: one per core; 1: none)."""
    import os
    from concurrent.futures import ProcessPoolExecutor

    from .cluster import SimConfig, prepare_trajectories

    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise ValueError(f"configs: unknown {', '.join(unknown)}; known: {', '.join(CONFIGS)}")
    configs = ["openrlhf"] + [c for c in configs if c != "openrlhf"]
    say = progress or (lambda _msg: None)
    t0 = time.perf_counter()
    prepared = prepare_trajectories(trajectories)
    recorded = all(getattr(t, "tool_delays_s", None) is not None for t in trajectories)
    if settings.tool_latency_s is not None and recorded:  # the user's figure replaces the recorded ones
        prepared = prepare_trajectories([_without_delays(t) for t in trajectories])
    latency = settings.tool_latency_s if settings.tool_latency_s is not None else (None if recorded else 1.0)
    timing = {"prepare_s": time.perf_counter() - t0, "replay_s": 0.0, "simulate_s": 0.0}
    modes = sorted({CONFIGS[c][1] for c in configs} - {"none"})
    pairs = sorted({_key(c) for c in configs} | {_key(c, "none") for c in configs if c in SWITCHED})

    def sim_config(mode: str, spec: dict[str, dict[str, float]], priority: bool = False):
        s = spec.get(mode) if mode != "none" else None
        return SimConfig(num_engines=settings.engines, preset=settings.cost_model,
                         turn_priority="longest_first" if priority else "none",
                         kv_capacity_tokens=settings.kv_tokens, steps=settings.steps, seed=settings.seed,
                         tool_delay_s=latency if latency is not None else 1.0,
                         spec_tokens_per_step=max(1.0, s["tokens_per_step"]) if s else 1.0,
                         spec_drafted_per_step=s["drafted_per_step"] if s else 0.0)

    _SHARED.update(trajectories=trajectories, settings=settings, prepared=prepared)
    import multiprocessing

    # workers read the trajectories from _SHARED as forked; where a process cannot fork: none
    can_fork = "fork" in multiprocessing.get_all_start_methods()
    workers = max(1, min(jobs or os.cpu_count() or 1, len(modes) + len(pairs))) if can_fork else 1
    spec: dict[str, dict[str, float]] = {}
    memo: dict[tuple[str, str], float] = {}
    try:
        if workers == 1:
            for mode in modes:
                say(f"speculation replay: {mode}")
                spec[mode] = measure_speculation(trajectories, mode, settings, progress=progress is not None)
            timing["replay_s"] = time.perf_counter() - t0 - timing["prepare_s"]
            for policy, mode, prio in pairs:
                say(f"simulating {policy} ({mode}{', longest first' if prio else ''})")
                memo[(policy, mode, prio)] = _simulate_job(policy, sim_config(mode, spec, prio))
        else:
            ctx = multiprocessing.get_context("fork")
            say(f"{len(modes)} speculation replays and {len(pairs)} simulations on {workers} processes")
            with ProcessPoolExecutor(workers, mp_context=ctx) as ex:
                # simulations without drafting need no replay: they start with the replays
                plain = {ex.submit(_simulate_job, p, sim_config("none", {}, q)): (p, m, q) for p, m, q in pairs
                         if m == "none"}
                replays = {m: ex.submit(_replay_job, m) for m in modes}
                spec = {m: f.result() for m, f in replays.items()}
                timing["replay_s"] = time.perf_counter() - t0 - timing["prepare_s"]
                drafted = {ex.submit(_simulate_job, p, sim_config(m, spec, q)): (p, m, q) for p, m, q in pairs
                           if m != "none"}
                for f, key in {**plain, **drafted}.items():
                    memo[key] = f.result()
    finally:
        _SHARED.clear()
    timing["simulate_s"] = time.perf_counter() - t0 - timing["prepare_s"] - timing["replay_s"]

    rows = {}
    for name in configs:
        policy, mode, prio = _key(name)
        row: dict[str, Any] = {"policy": policy, "speculation": mode, "step_s": memo[(policy, mode, prio)]}
        if prio:
            row["turn_priority"] = "longest_first"
        if name in SWITCHED:  # the switch keeps drafting off where it costs more than it saves
            off = memo[(policy, "none", prio)]
            row["step_s_drafting_on"], row["step_s_drafting_off"] = row["step_s"], off
            row["switch"] = "on" if row["step_s"] <= off else "off"
            row["step_s"] = min(row["step_s"], off)
        rows[name] = row
    base = rows["openrlhf"]["step_s"]
    for row in rows.values():
        row["x_openrlhf"] = base / row["step_s"] if row["step_s"] > 0 else None
    return {"configs": rows, "speculation": spec,
            "tool_latency": "recorded" if latency is None else f"{latency:g} s a tool call",
            "seconds": time.perf_counter() - t0, "timing": timing, "processes": workers}


def _without_delays(t):
    from types import SimpleNamespace

    return SimpleNamespace(trajectory_id=t.trajectory_id, group_id=t.group_id, turns=t.turns, tool_delays_s=None)
