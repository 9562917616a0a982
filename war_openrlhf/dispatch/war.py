"""WAR's workload-aware turn dispatch: cache hits vs. queueing, with hysteresis and a tail bias.

Per ``choose()`` (costs are in *prefill-token equivalents*: the time to prefill one token = 1):

* cache model: :class:`~.block_index.BlockHashIndex`, per engine an LRU of 16-token block hashes
  (vLLM-style chained hashes) bounded by ``kv_capacity_tokens // 16``; the request's chain is
  kept per trajectory and extended incrementally (:class:`~.block_index.TrajectoryChain`).
  ``cached_e`` = longest cached prefix on engine e, in tokens (capped at ``len(context) - 1``:
  the engine always computes the last token).
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
* ``kv_capacity_tokens``: per engine (int or sequence); ``None`` takes it from the EngineState
  snapshots (the index follows the snapshot's value whenever it changes).
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Union

import numpy as np

from .base import DispatchPolicy, EngineState, TurnRequest
from .block_index import BLOCK_SIZE, BlockHashIndex, TrajectoryChain

_UNSET_CAPACITY = 1 << 62  # until the first snapshot tells the capacity


class WARPolicy(DispatchPolicy):
    name = "war"

    def __init__(self, num_engines: int, *,
                 kv_capacity_tokens: Union[None, int, Sequence[int]] = None,
                 prefill_cost_per_token: float = 1.0,
                 decode_cost_per_token: float = 1.0,
                 expected_turn_tokens: int = 256,
                 move_margin: float = 2048.0,
                 tail_weight: float = 1.0,
                 progress_turns: int = 16) -> None:
        super().__init__(num_engines)
        for name, val in (("prefill_cost_per_token", prefill_cost_per_token),
                          ("decode_cost_per_token", decode_cost_per_token),
                          ("expected_turn_tokens", expected_turn_tokens),
                          ("move_margin", move_margin), ("tail_weight", tail_weight)):
            if val < 0:
                raise ValueError(f"{name} must be >= 0, got {val}")
        if progress_turns <= 0:
            raise ValueError(f"progress_turns must be positive, got {progress_turns}")
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
        self._cap_tokens_seen: Dict[int, int] = {}
        self.trajectories: Dict[str, TrajectoryChain] = {}
        self.last_scores: Dict[int, float] = {}  # engine -> score of the last decision
        self.moves = 0

    def _progress(self, req: TurnRequest) -> float:
        if req.expected_tokens:
            p = req.tokens_so_far / req.expected_tokens
        else:
            p = req.turn_index / self.progress_turns
        return 0.0 if p < 0.0 else (1.0 if p > 1.0 else p)

    def choose(self, request: TurnRequest, engines: Sequence[EngineState]) -> int:
        healthy = self._healthy(engines)
        if self._caps_from_snapshot:
            seen = self._cap_tokens_seen
            for e in healthy:
                if seen.get(e.engine_id) != e.kv_capacity_tokens:
                    seen[e.engine_id] = e.kv_capacity_tokens
                    self.index.set_capacity(e.engine_id, e.kv_capacity_tokens // BLOCK_SIZE)

        traj = self.trajectories.get(request.trajectory_id)
        is_new = traj is None
        if is_new:
            traj = self.trajectories[request.trajectory_id] = TrajectoryChain()
        ctx = request.context_token_ids
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
            cached = blocks * BLOCK_SIZE
            scores[eid] -= pw * (cached if cached <= max_cached else max_cached)
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
        self.index.touch(engine_id, traj.hashes)
        traj.hint[engine_id] = len(traj.hashes)

    def on_trajectory_finished(self, trajectory_id: str) -> None:
        # Its blocks stay in the engines' LRUs: vLLM keeps freed blocks as evictable cache.
        self.trajectories.pop(trajectory_id, None)

    def cached_tokens(self, engine_id: int, context: np.ndarray) -> int:
        """Modelled prefix-cache hit (tokens) of ``context`` on an engine (no side effects)."""
        tc = TrajectoryChain()
        tc.sync(context)
        return self.index.matched_blocks(engine_id, tc.hashes) * BLOCK_SIZE
